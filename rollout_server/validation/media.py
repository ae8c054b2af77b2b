"""What a request generates and conditions on: its size and frames, the latent they make, their tokens
split across ranks, a trainer's x_0 of that latent, and the conditioning images."""

import math
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from rollout.v1 import rollout_pb2
from rollout_core import wire
from rollout_server import images
from rollout_server.errors import InvalidRequest
from rollout_server.families.base import FamilyAdapter, MediaShape
from rollout_server.parallel import ParallelDims, split_inputs
from rollout_server.quoting import quoted
from rollout_server.sampler import LATENT_RANGE

if TYPE_CHECKING:
    from rollout_core.layout import SampleLayout
    from rollout_server.validation.context import Problems, ServingContext

# A trainer's x_0 may take this many bytes besides its tensor's: the safetensors header of one
# tensor (its length, a JSON line of name, dtype, shape and offsets, padding) and some metadata.
INITIAL_LATENTS_HEADER_BYTES = 4096


def shape_problems(
    request: rollout_pb2.RolloutRequest,
    resolved: rollout_pb2.RolloutRequest,
    layout: "SampleLayout | None",
    context: "ServingContext",
    seeds_refused: bool,
) -> "Problems":
    """height and width, num_frames (and the latent they make), a trainer's initial_latents of that
    latent for ``layout``'s samples (unchecked where ``seeds_refused``), and under sequence parallelism
    the tokens they make, which must cut into equal parts."""
    limits, model = context.limits, context.model
    bad: Problems = []
    for field in ("height", "width"):
        side = getattr(resolved, field)
        if not 0 < side <= limits.max_side:
            bad.append((field, f"must be in [1, {limits.max_side}] pixels, got {side}"))
        elif side % model.side_multiple:
            bad.append((field, f"must be a multiple of {model.side_multiple}, got {side}"))
        elif side < model.min_side:
            bad.append((field, f"must be at least {model.min_side} pixels, got {side}"))

    frames, step = resolved.num_frames, model.frame_step
    if not 0 < frames <= model.max_frames:
        allowed = "1 for this image model" if model.max_frames == 1 else f"in [1, {model.max_frames}]"
        bad.append(("num_frames", f"must be {allowed}, got {frames}"))
    elif step and (frames - 1) % step:
        bad.append(("num_frames", f"must be {step}k + 1 (1, {step + 1}, {2 * step + 1}, ...), got {frames}"))
    elif not bad:
        elements = math.prod(model.latent_shape(MediaShape.of(resolved)))
        if elements > limits.max_latent_elements:
            bad.append(
                ("num_frames", f"a latent of {elements} elements is above {limits.max_latent_elements}")
            )
    size_refused = bool(bad)
    if request.initial_latents:
        if size_refused or seeds_refused:
            bad.append(("initial_latents", "needs a valid size and samples to be checked against"))
        elif layout is not None:
            shape = (len(layout.seeds), *model.latent_shape(MediaShape.of(resolved)))
            if problem := _initial_latents_problem(request.initial_latents, shape):
                bad.append(("initial_latents", problem))
    divisor = context.seq_len_divisor
    if divisor > 1 and not size_refused:
        # The split image tokens (and the conditioning image's, appended to them) are gathered back at
        # the output: they must cut into equal parts.
        shape = MediaShape.of(resolved)
        tokens = model.generated_tokens(shape) + model.conditioning_tokens(shape)
        if tokens % divisor:
            size = f"{resolved.height} x {resolved.width} pixels, {frames} frame(s)"
            bad.append(
                ("height", f"{size}: {tokens} tokens, which do not split evenly across {divisor} ranks")
            )
    return bad


def initial_latents(data: bytes) -> torch.Tensor:
    """The x_0 of a request's ``initial_latents``, once ``resolve`` has checked it."""
    return safetensors.torch.load(data)[wire.X_0]


def _initial_latents_problem(data: bytes, shape: tuple[int, ...]) -> str:
    """What is wrong with a trainer's x_0, or "": its size bounded before it is parsed, then one
    finite float32 tensor ``x_0`` of ``shape``."""
    needed = math.prod(shape) * 4
    if len(data) > needed + INITIAL_LATENTS_HEADER_BYTES:
        return f"{len(data)} bytes: a float32 x_0 of shape {list(shape)} takes {needed} and a header"
    try:
        tensors = safetensors.torch.load(data)
    except Exception as error:  # noqa: BLE001 - any failure to parse is the client's bad bytes
        return f"not a safetensors buffer: {quoted(str(error))}"
    if list(tensors) != [wire.X_0]:
        return f"must hold one tensor named {wire.X_0!r}, got {quoted(str(sorted(tensors)))}"
    x0 = tensors[wire.X_0]
    if x0.dtype != torch.float32:
        return f"x_0 must be float32, got {x0.dtype}"
    if tuple(x0.shape) != shape:
        return f"x_0 must have shape {list(shape)} (samples, *layout.shape), got {list(x0.shape)}"
    if not torch.isfinite(x0).all():
        return "x_0 must be finite"
    if (peak := x0.abs().max().item()) > LATENT_RANGE:
        return f"x_0's elements must be at most {LATENT_RANGE:g} in magnitude, got {peak:.3g}"
    return ""


def image_problems(request: rollout_pb2.RolloutRequest, context: "ServingContext") -> "Problems":
    """The conditioning images: one per prompt for an image-conditioned family, none otherwise, each
    checked up to its pixels (see rollout_server.images); counted before any is read."""
    count, limit = len(request.condition_images), context.limits.max_condition_images
    if not context.model.takes_images:
        return [("condition_images", "this model takes no conditioning images")] if count else []
    if count > limit:  # never read a million
        return [("condition_images", f"{count} images: at most {limit} in one request")]
    if count != len(request.prompts):
        return [("condition_images", f"{count} images for {len(request.prompts)} prompts: one per prompt")]
    bad = []
    for i, image in enumerate(request.condition_images):
        try:
            images.check_header(image.data, context.limits)
        except images.BadImage as error:
            bad.append((f"condition_images[{i}]", str(error)))
    return bad


def read_images(
    resolved: rollout_pb2.RolloutRequest, context: "ServingContext"
) -> list[images.ConditionImage]:
    """The conditioning images of a resolved request, each decoded once, converted and resized to
    the request's size: what the engine works from. Decoded only once every field is valid, so a
    request refused for a field costs no decode. InvalidRequest naming each whose pixels do not
    decode."""
    read, bad = [], []
    encoding = context.model.image_encoding
    for i, image in enumerate(resolved.condition_images):
        try:
            read.append(images.read(image.data, context.limits, resolved.width, resolved.height, encoding))
        except images.BadImage as error:
            bad.append((f"condition_images[{i}]", str(error)))
    if bad:
        raise InvalidRequest(bad)
    return read


def check_prompt_tokens(
    dims: ParallelDims, adapter: FamilyAdapter, envs: dict[str, list[dict[str, Any]]]
) -> None:
    """Ring attention cuts the text tokens into equal parts too, and their count is known only once
    the prompts are encoded (``envs``: per branch, per prompt). InvalidRequest names each prompt
    whose tokens do not split."""
    if dims.uneven_text:
        return
    text_inputs = {
        name: dim
        for name, dim in split_inputs(adapter.transformer).items()
        if name not in adapter.generated_inputs
    }
    bad: dict[str, str] = {}
    for branch, per_prompt in envs.items():
        for p, env in enumerate(per_prompt):
            for name, dim in text_inputs.items():
                value = env.get(name)
                if isinstance(value, torch.Tensor) and value.shape[dim] % dims.seq_len_divisor:
                    field = "negative_prompt" if branch == "negative" else f"prompts[{p}]"
                    bad[field] = (
                        f"{name} has {value.shape[dim]} tokens, which do not split evenly across "
                        f"{dims.seq_len_divisor} ranks"
                    )
    if bad:
        raise InvalidRequest(list(bad.items()))
