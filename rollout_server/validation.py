"""Request validation: turn a RolloutRequest into a fully resolved one, or name every bad field.

Every problem is collected (not just the first) and reported as a google.rpc.BadRequest field
violation, so a trainer sees at once everything that is wrong with its request.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

from rollout.v1 import rollout_pb2
from rollout_core import dtypes, solvers, steps, wire
from rollout_core.layout import DEFAULT_GROUP_SIZE, sample_layout
from rollout_core.tree import Tree
from rollout_server import images
from rollout_server.errors import InvalidRequest
from rollout_server.families.base import FamilyAdapter, FamilyDefaults, MediaShape
from rollout_server.limits import MAX_POLICY_VERSION, Limits
from rollout_server.parallel import ParallelDims, split_inputs
from rollout_server.sampler import LATENT_RANGE, unstable_step

LATENT_SELECTIONS = {
    rollout_pb2.LATENT_SELECTION_ALL,
    rollout_pb2.LATENT_SELECTION_AROUND_STOCHASTIC,
    rollout_pb2.LATENT_SELECTION_FINAL_ONLY,
    rollout_pb2.LATENT_SELECTION_NONE,
}
DEBUG_TENSORS = {
    rollout_pb2.DEBUG_TENSOR_EPS,
    rollout_pb2.DEBUG_TENSOR_MEAN,
    rollout_pb2.DEBUG_TENSOR_SD,
    rollout_pb2.DEBUG_TENSOR_VELOCITY,
}
SCALE_FIELDS = ("guidance_scale", "true_cfg_scale")
# Smallest positive noise level: below it sd is lost in the float32 rounding of the latents, so a
# 'stochastic' step would be deterministic in all but name.
MIN_NOISE_LEVEL = 1e-6
# Smallest sigma of a trainer's schedule but its final 0: float32's smallest normal number, 2^-126. The
# steps divide by sigma (the SDE means by 2 sigma, the solvers' ratios and log-SNRs), which overflows
# or loses its precision on a subnormal one.
MIN_SIGMA = torch.finfo(torch.float32).tiny
# The fields a trainer's schedule is probed with (``sampler.unstable_step``): checked once these are valid.
STEP_FIELDS = {"sigmas", "num_steps", "sampler", "noise_level", "solver", "stochastic_steps", "branches"}


# Client strings quoted in messages and logs are cut to this many characters.
MAX_QUOTED_CHARS = 120
# A trainer's x_0 may take this many bytes besides its tensor's: the safetensors header of one
# tensor (its length, a JSON line of name, dtype, shape and offsets, padding) and some metadata.
INITIAL_LATENTS_HEADER_BYTES = 4096


def quoted(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """A client-supplied string made safe for a log line or an error message: escaped (no newline or
    control character survives, so it cannot forge a log line) and cut to ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


@dataclass(frozen=True)
class ServingContext:
    """What validation needs to know about the loaded model."""

    defaults: FamilyDefaults
    side_multiple: int
    limits: Limits
    min_side: int = 1  # height and width are at least this many pixels
    cfg_scale_field: str = "true_cfg_scale"
    cfg_off_scale: float = 1.0  # the CFG scale at and below which no negative branch runs
    scale_fields: tuple[str, ...] = SCALE_FIELDS  # the scales the model reads
    # Models with two experts (Wan 2.2): the pipeline's boundary_ratio; they take guidance_scale_2 and
    # boundary_ratio. None: one expert.
    boundary_ratio: float | None = None
    max_frames: int = 1  # the family's; image families take 1
    frame_step: int = 0  # video families: num_frames - 1 is a multiple of it
    min_steps: int = 1  # the fewest steps the model's schedule is defined for
    solver: str = solvers.FALLBACK_SOLVER  # the family's deterministic solver (its pipeline's)
    # One sample's latent shape for a media shape (None: not checked against max_latent_elements).
    latent_shape: Callable[[MediaShape], tuple[int, ...]] | None = None
    # Sequence parallelism: one sample's generated tokens must divide by seq_len_divisor.
    generated_tokens: Callable[[MediaShape], int] | None = None
    seq_len_divisor: int = 1
    # Image-conditioned families: one conditioning image per prompt, whose tokens (when concatenated
    # on the sequence) the split cuts together with the generated ones.
    takes_images: bool = False
    conditioning_tokens: Callable[[MediaShape], int] = lambda shape: 0
    image_encoding: str = ""  # how the family encodes a conditioning image

    @property
    def has_cfg(self) -> bool:
        """Whether the model runs CFG at all: it reads its ``cfg_scale_field``. A guidance-distilled
        model (FLUX.2 [dev]) or a step-distilled one (a distilled FLUX.2 [klein]) reads none, so
        GetServerInfo states no CFG field for it, and the rule "none"."""
        return self.cfg_scale_field in self.scale_fields

    @property
    def max_request_bytes(self) -> int:
        """The largest request this server receives (see ``Limits.max_request_bytes``)."""
        return self.limits.max_request_bytes(self.takes_images)

    @classmethod
    def of(
        cls, adapter: FamilyAdapter, defaults: FamilyDefaults, limits: Limits, seq_len_divisor: int = 1
    ) -> "ServingContext":
        """The context of a loaded model, with the request ``defaults`` it serves, split across ranks
        into ``seq_len_divisor`` parts."""
        return cls(
            defaults=defaults,
            side_multiple=adapter.side_multiple,
            limits=limits,
            min_side=adapter.min_side,
            cfg_scale_field=adapter.cfg_scale_field,
            cfg_off_scale=adapter.cfg_off_scale,
            scale_fields=adapter.scale_fields,
            boundary_ratio=adapter.boundary_ratio,
            max_frames=adapter.max_frames,
            frame_step=adapter.frame_step,
            min_steps=adapter.min_steps,
            solver=adapter.solver,
            latent_shape=adapter.latent_shape,
            generated_tokens=adapter.generated_tokens,
            seq_len_divisor=seq_len_divisor,
            takes_images=adapter.takes_images,
            conditioning_tokens=adapter.conditioning_tokens,
            image_encoding=adapter.image_encoding,
        )


def defaults_proto(context: ServingContext) -> rollout_pb2.RolloutRequest:
    """The defaults applied to unset request fields, as GetServerInfo reports them."""
    d = context.defaults
    return rollout_pb2.RolloutRequest(
        samples_per_prompt=DEFAULT_GROUP_SIZE,
        height=d.height,
        width=d.width,
        num_frames=d.frames,
        num_steps=d.num_steps,
        guidance_scale=d.guidance_scale,
        true_cfg_scale=d.true_cfg_scale,
        sampler=steps.DEFAULT_SAMPLER.enum,
        solver=solvers.SOLVERS[context.solver].enum,
        noise_level=d.noise_level,
        latents=rollout_pb2.LATENT_SELECTION_ALL,
        latent_dtype=rollout_pb2.TENSOR_DTYPE_FLOAT32,
        images=True,
        boundary_ratio=context.boundary_ratio,
    )


def _finite_in(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


def resolve(request: rollout_pb2.RolloutRequest, context: ServingContext) -> rollout_pb2.RolloutRequest:
    """Validate ``request`` and return a copy with every default filled in and explicit seeds."""
    limits = context.limits
    bad: list[tuple[str, str]] = []
    defaults = defaults_proto(context)
    resolved = rollout_pb2.RolloutRequest()
    resolved.CopyFrom(defaults)
    resolved.MergeFrom(request)
    # MergeFrom appends repeated fields: take the request's own.
    del resolved.seeds[:], resolved.stochastic_steps[:], resolved.debug_tensors[:], resolved.branches[:]
    del resolved.sigmas[:]

    layout, layout_problems = sample_layout(request, limits.max_samples)
    request_id = layout.request_id if layout else request.request_id
    if len(request_id) > limits.max_request_id_chars or not request_id.isprintable():
        bad.append(("request_id", f"must be printable and at most {limits.max_request_id_chars} characters"))

    if not request.prompts:
        bad.append(("prompts", "at least one prompt is required"))
    elif len(request.prompts) > limits.max_samples:
        # Counted before any per-prompt check: a million prompts must cost no more than one.
        bad.append(("prompts", f"{len(request.prompts)} prompts exceed {limits.max_samples} samples"))
    else:
        for i, prompt in enumerate(request.prompts):
            if not prompt.strip():
                bad.append((f"prompts[{i}]", "must not be empty"))
            elif len(prompt) > limits.max_prompt_chars:
                bad.append(
                    (f"prompts[{i}]", f"longer than {limits.max_prompt_chars} characters ({len(prompt)})")
                )
    bad.extend(layout_problems)
    bad.extend(_image_problems(request, context))
    if layout is not None:
        resolved.request_id = layout.request_id
        resolved.samples_per_prompt = layout.group_size
        resolved.seeds.extend(layout.seeds)
        if layout.base_seed is not None:
            resolved.base_seed = layout.base_seed

    for field in ("height", "width"):
        side = getattr(resolved, field)
        if not 0 < side <= limits.max_side:
            bad.append((field, f"must be in [1, {limits.max_side}] pixels, got {side}"))
        elif side % context.side_multiple:
            bad.append((field, f"must be a multiple of {context.side_multiple}, got {side}"))
        elif side < context.min_side:
            bad.append((field, f"must be at least {context.min_side} pixels, got {side}"))

    frames, step = resolved.num_frames, context.frame_step
    if not 0 < frames <= context.max_frames:
        allowed = "1 for this image model" if context.max_frames == 1 else f"in [1, {context.max_frames}]"
        bad.append(("num_frames", f"must be {allowed}, got {frames}"))
    elif step and (frames - 1) % step:
        bad.append(("num_frames", f"must be {step}k + 1 (1, {step + 1}, {2 * step + 1}, ...), got {frames}"))
    elif context.latent_shape is not None and not any(field in ("height", "width") for field, _ in bad):
        elements = math.prod(context.latent_shape(MediaShape.of(resolved)))
        if elements > limits.max_latent_elements:
            bad.append(
                ("num_frames", f"a latent of {elements} elements is above {limits.max_latent_elements}")
            )
    if request.initial_latents:
        if context.latent_shape is None or any(
            f in ("height", "width", "num_frames", "seeds") for f, _ in bad
        ):
            bad.append(("initial_latents", "needs a valid size and samples to be checked against"))
        elif layout is not None:
            shape = (len(layout.seeds), *context.latent_shape(MediaShape.of(resolved)))
            if problem := _initial_latents_problem(request.initial_latents, shape):
                bad.append(("initial_latents", problem))
    divisor = context.seq_len_divisor
    if divisor > 1 and not any(field in ("height", "width", "num_frames") for field, _ in bad):
        # The split image tokens (and the conditioning image's, appended to them) are gathered back at
        # the output: they must cut into equal parts.
        shape = MediaShape.of(resolved)
        tokens = context.generated_tokens(shape) + context.conditioning_tokens(shape)
        if tokens % divisor:
            size = f"{resolved.height} x {resolved.width} pixels, {frames} frame(s)"
            bad.append(
                ("height", f"{size}: {tokens} tokens, which do not split evenly across {divisor} ranks")
            )

    min_steps = context.min_steps
    if request.sigmas:
        min_steps = 1  # the family's schedule has a minimum, a given one does not
        schedule_problem = _sigmas_problem(request, limits)
        if schedule_problem:
            bad.append(("sigmas", schedule_problem))
        else:
            resolved.num_steps = len(request.sigmas) - 1
            resolved.sigmas.extend(request.sigmas)
    num_steps = resolved.num_steps
    if not min_steps <= num_steps <= limits.max_steps:
        bad.append(("num_steps", f"must be in [{min_steps}, {limits.max_steps}], got {num_steps}"))

    if not _finite_in(resolved.guidance_scale, 0.0, 100.0):
        bad.append(("guidance_scale", f"must be finite and in [0, 100], got {resolved.guidance_scale}"))
    if not _finite_in(resolved.true_cfg_scale, 1.0, 100.0):
        bad.append(("true_cfg_scale", f"must be finite and in [1, 100], got {resolved.true_cfg_scale}"))
    # A model that does not read its CFG field (step- or guidance-distilled) runs without CFG.
    reads = f"its CFG scale is {context.cfg_scale_field}" if context.has_cfg else "it runs without CFG"
    for field in SCALE_FIELDS:
        # A scale the model does not read would be ignored: refused, unless it is the default that a
        # started event echoes (so a resolved request can be resent).
        ignored = request.HasField(field) and getattr(request, field) != getattr(defaults, field)
        if field not in context.scale_fields and ignored:
            bad.append((field, f"this model does not use it; {reads}"))
    if request.negative_prompt and getattr(resolved, context.cfg_scale_field) <= context.cfg_off_scale:
        needs = (
            f"is only used with {context.cfg_scale_field} > {context.cfg_off_scale:g}"
            if context.has_cfg
            else "this model runs without CFG"
        )
        bad.append(("negative_prompt", needs))
    if len(request.negative_prompt) > limits.max_prompt_chars:
        bad.append(("negative_prompt", f"longer than {limits.max_prompt_chars} characters"))
    bad.extend(_expert_problems(request, resolved, context))

    # An unset sampler or solver (0) is not merged over the defaults: they stay the served ones.
    sampler = steps.SAMPLERS_BY_ENUM.get(resolved.sampler)
    if sampler is None:
        bad.append(("sampler", f"unknown sampler type {request.sampler}"))
    elif not _finite_in(resolved.noise_level, 0.0, sampler.max_noise_level):
        bad.append(
            (
                "noise_level",
                f"must be in [0, {sampler.max_noise_level}] for {sampler.name}, got {resolved.noise_level}",
            )
        )
    elif 0.0 < resolved.noise_level < MIN_NOISE_LEVEL:
        bad.append(("noise_level", f"must be 0 or at least {MIN_NOISE_LEVEL}, got {resolved.noise_level}"))
    if resolved.solver not in solvers.SOLVERS_BY_ENUM:
        bad.append(("solver", f"unknown solver {request.solver}; expected one of {list(solvers.SOLVERS)}"))

    chosen = list(request.stochastic_steps)
    if chosen:
        if sampler is not None and not sampler.stochastic:
            bad.append(("stochastic_steps", f"the {sampler.name} sampler has no stochastic steps"))
        elif any(i >= num_steps for i in chosen):
            bad.append(("stochastic_steps", f"indices must be < num_steps ({num_steps})"))
        elif any(b <= a for a, b in zip(chosen, chosen[1:], strict=False)):
            bad.append(("stochastic_steps", "indices must be strictly increasing"))
        resolved.stochastic_steps.extend(chosen)
    bad.extend(_branch_problems(request, resolved, limits))
    resolved.branches.extend(request.branches)
    bad.extend(_prune_point_problems(request, num_steps, limits))
    bad.extend(_preview_step_problems(request, num_steps, limits))
    # Only a trainer's schedule is probed: a family's own is its pipeline scheduler's, whose sigmas
    # are normal numbers well apart.
    if request.sigmas and not any(field.partition("[")[0] in STEP_FIELDS for field, _ in bad):
        bad.extend(_unstable_step_problems(resolved))
    if not request.HasField("log_prob_constants") and sampler is not None:
        resolved.log_prob_constants = sampler.log_prob_constants

    if request.latents == rollout_pb2.LATENT_SELECTION_UNSPECIFIED:
        resolved.latents = rollout_pb2.LATENT_SELECTION_ALL
    elif request.latents not in LATENT_SELECTIONS:
        bad.append(("latents", f"unknown latent selection {request.latents}"))
    if request.latent_dtype == rollout_pb2.TENSOR_DTYPE_UNSPECIFIED:
        resolved.latent_dtype = rollout_pb2.TENSOR_DTYPE_FLOAT32
    elif request.latent_dtype not in dtypes.LATENT:
        bad.append(("latent_dtype", f"unknown tensor dtype {request.latent_dtype}"))

    if request.HasField("min_policy_version") and request.min_policy_version > MAX_POLICY_VERSION:
        bad.append(
            ("min_policy_version", f"must be at most {MAX_POLICY_VERSION} (policy versions stay below 2^63)")
        )

    debug = list(request.debug_tensors)
    if any(d not in DEBUG_TENSORS for d in debug):
        bad.append(("debug_tensors", "unknown or unspecified debug tensor"))
    elif len(set(debug)) != len(debug):
        bad.append(("debug_tensors", "each debug tensor may be listed once"))
    resolved.debug_tensors.extend(debug)

    if bad:
        raise InvalidRequest(bad)
    return resolved


def _expert_problems(
    request: rollout_pb2.RolloutRequest, resolved: rollout_pb2.RolloutRequest, context: ServingContext
) -> list[tuple[str, str]]:
    """The second expert's fields: refused on a model with one; on one with two, guidance_scale_2
    resolved to guidance_scale when unset (WanPipeline's default), and bounded as it is."""
    fields = ("guidance_scale_2", "boundary_ratio")
    if context.boundary_ratio is None:
        return [
            (field, "this model has one expert: no transformer_2")
            for field in fields
            if request.HasField(field)
        ]
    bad = []
    if not request.HasField("guidance_scale_2"):
        resolved.guidance_scale_2 = resolved.guidance_scale
    elif not _finite_in(resolved.guidance_scale_2, 0.0, 100.0):
        bad.append(("guidance_scale_2", f"must be finite and in [0, 100], got {resolved.guidance_scale_2}"))
    elif (
        resolved.guidance_scale <= context.cfg_off_scale
        and resolved.guidance_scale_2 != resolved.guidance_scale
    ):
        # The pipeline runs CFG on guidance_scale alone: the second scale would be ignored.
        bad.append(("guidance_scale_2", f"is only used with guidance_scale > {context.cfg_off_scale:g}"))
    if not _finite_in(resolved.boundary_ratio, 0.0, 1.0):
        bad.append(("boundary_ratio", f"must be finite and in [0, 1], got {resolved.boundary_ratio}"))
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


def _sigmas_problem(request: rollout_pb2.RolloutRequest, limits: Limits) -> str:
    """What is wrong with a trainer's schedule, or "": T + 1 values for T in [1, max_steps] (counted
    before any is read) and num_steps if set, finite, strictly decreasing, in (0, 1] but the last 0."""
    count = len(request.sigmas)
    if not 2 <= count <= limits.max_steps + 1:
        return f"{count} values: a schedule of T steps has T + 1, T in [1, {limits.max_steps}]"
    if request.HasField("num_steps") and request.num_steps != count - 1:
        return f"{count} values for num_steps {request.num_steps}: num_steps + 1 are needed"
    sigmas = list(request.sigmas)
    if not all(math.isfinite(s) for s in sigmas):
        return "every value must be finite"
    if sigmas[-1] != 0:
        return f"the last value must be 0, got {sigmas[-1]}"
    if not all(MIN_SIGMA <= s <= 1 for s in sigmas[:-1]):
        return (
            f"every value but the last must be in [{MIN_SIGMA:.9g}, 1] (float32's smallest normal number: "
            "the steps divide by sigma)"
        )
    if any(b >= a for a, b in zip(sigmas, sigmas[1:], strict=False)):
        return "the values must be strictly decreasing"
    return ""


def step_noise_levels(request: rollout_pb2.RolloutRequest) -> list[float]:
    """[T]: the noise level of each step of a resolved request (a branch point's own, else the
    request's)."""
    levels = [request.noise_level] * request.num_steps
    for branch in request.branches:
        if branch.HasField("noise_level"):
            levels[branch.step] = branch.noise_level
    return levels


def _unstable_step_problems(resolved: rollout_pb2.RolloutRequest) -> list[tuple[str, str]]:
    """A trainer's schedule whose step coefficients are not finite in float32 for the request's
    sampler, noise levels, stochastic steps and solver (each step probed as a rollout takes it)."""
    sigmas = torch.tensor(list(resolved.sigmas), dtype=torch.float32)
    sampler = steps.SAMPLERS_BY_ENUM[resolved.sampler]
    solver = solvers.SOLVERS_BY_ENUM[resolved.solver].name
    levels = step_noise_levels(resolved)
    i = unstable_step(sampler.name, solver, sigmas, levels, list(resolved.stochastic_steps))
    if i is None:
        return []
    return [
        (
            "sigmas",
            f"step {i} (sigma {resolved.sigmas[i]:.9g} to {resolved.sigmas[i + 1]:.9g}): its coefficients "
            f"are not finite in float32 (sampler {sampler.name}, noise level {levels[i]:g}, solver {solver})",
        )
    ]


def _image_problems(request: rollout_pb2.RolloutRequest, context: ServingContext) -> list[tuple[str, str]]:
    """The conditioning images: one per prompt for an image-conditioned family, none otherwise, each
    checked up to its pixels (see rollout_server.images); counted before any is read."""
    count, limit = len(request.condition_images), context.limits.max_condition_images
    if not context.takes_images:
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


def read_images(resolved: rollout_pb2.RolloutRequest, context: ServingContext) -> list[images.ConditionImage]:
    """The conditioning images of a resolved request, each decoded once, converted and resized to
    the request's size: what the engine works from. Decoded only once every field is valid, so a
    request refused for a field costs no decode. InvalidRequest naming each whose pixels do not
    decode."""
    read, bad = [], []
    for i, image in enumerate(resolved.condition_images):
        try:
            read.append(
                images.read(
                    image.data, context.limits, resolved.width, resolved.height, context.image_encoding
                )
            )
        except images.BadImage as error:
            bad.append((f"condition_images[{i}]", str(error)))
    if bad:
        raise InvalidRequest(bad)
    return read


def _branch_problems(
    request: rollout_pb2.RolloutRequest, resolved: rollout_pb2.RolloutRequest, limits: Limits
) -> list[tuple[str, str]]:
    """The problems of a tree request's branch points: steps in range and strictly increasing,
    factors at least 1, and a tree within the node and width limits (that a forking step draws
    noise needs the schedule: ``Runner.prepare`` checks it). Counted before anything grows: a
    request of huge factors costs no more than a small one."""
    branches = list(request.branches)
    if not branches:
        return []
    if len(branches) > limits.max_steps:
        return [("branches", f"{len(branches)} branch points exceed {limits.max_steps} steps")]
    bad = []
    num_steps = resolved.num_steps
    sampler = steps.SAMPLERS_BY_ENUM.get(resolved.sampler)
    for k, branch in enumerate(branches):
        if branch.step >= num_steps:
            bad.append((f"branches[{k}].step", f"must be < num_steps ({num_steps}), got {branch.step}"))
        elif k and branch.step <= branches[k - 1].step:
            bad.append((f"branches[{k}].step", "branch steps must be strictly increasing"))
        if branch.factor < 1:
            bad.append((f"branches[{k}].factor", "must be at least 1"))
        if branch.HasField("noise_level") and sampler is not None:
            level = branch.noise_level
            if not _finite_in(level, MIN_NOISE_LEVEL, sampler.max_noise_level):
                bad.append(
                    (
                        f"branches[{k}].noise_level",
                        f"must be in [{MIN_NOISE_LEVEL}, {sampler.max_noise_level}] for {sampler.name}, "
                        f"got {level}",
                    )
                )
    if bad or not resolved.seeds:
        return bad
    # At most max_steps factors below 2^32: exact integers, computed at once.
    nodes, leaves = Tree.size(len(resolved.seeds), [branch.factor for branch in branches])
    if leaves > limits.max_running_samples:
        bad.append(("branches", f"{leaves} leaves: above {limits.max_running_samples} samples at once"))
    if nodes > limits.max_tree_nodes:
        bad.append(("branches", f"{nodes} nodes: the tree is above {limits.max_tree_nodes} nodes"))
    return bad


def _prune_point_problems(
    request: rollout_pb2.RolloutRequest, num_steps: int, limits: Limits
) -> list[tuple[str, str]]:
    """The steps a tree rollout is held at for its caller's prune: only a tree is pruned, and a hold
    after step s serves a prune at step s + 1, which must exist. Counted before any is read."""
    count = len(request.prune_points)
    if not count:
        return []
    if not request.branches:
        return [("prune_points", "only a tree rollout (one with branches) can be pruned")]
    if count > limits.max_steps:
        return [("prune_points", f"{count} prune points exceed {limits.max_steps} steps")]
    points, bad = list(request.prune_points), []
    for k, point in enumerate(points):
        if point >= num_steps - 1:
            bad.append(
                (f"prune_points[{k}]", f"must be < num_steps - 1 ({num_steps - 1}): no step follows {point}")
            )
        elif k and point <= points[k - 1]:
            bad.append((f"prune_points[{k}]", "prune points must be strictly increasing"))
    return bad


def _preview_step_problems(
    request: rollout_pb2.RolloutRequest, num_steps: int, limits: Limits
) -> list[tuple[str, str]]:
    """The steps whose x0_hat is decoded and streamed: distinct steps of the rollout, in any order.
    Counted before any is read: each costs a decode of every row."""
    count = len(request.preview_steps)
    if count > min(num_steps, limits.max_steps):
        return [("preview_steps", f"{count} preview steps exceed the {num_steps} steps of the rollout")]
    bad, seen = [], set()
    for k, step in enumerate(request.preview_steps):
        if step >= num_steps:
            bad.append((f"preview_steps[{k}]", f"must be < num_steps ({num_steps}), got {step}"))
        elif step in seen:
            bad.append((f"preview_steps[{k}]", f"step {step} is listed twice"))
        seen.add(step)
    return bad


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
