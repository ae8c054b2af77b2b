"""``resolve``: a RolloutRequest checked field by field, each concern in its module, and returned with
every default filled in and explicit seeds; the prompts, the request id and what the stream carries are
checked here."""

from rollout.v1 import rollout_pb2
from rollout_core import dtypes
from rollout_core.layout import SampleLayout, sample_layout
from rollout_server.errors import InvalidRequest
from rollout_server.limits import MAX_POLICY_VERSION, Limits
from rollout_server.validation.context import Problems, ServingContext, defaults_proto
from rollout_server.validation.guidance import guidance_problems
from rollout_server.validation.media import image_problems, shape_problems
from rollout_server.validation.schedule import (
    STEP_FIELDS,
    sampler_problems,
    step_count_problems,
    unstable_step_problems,
)
from rollout_server.validation.trees import tree_problems

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


def resolve(request: rollout_pb2.RolloutRequest, context: ServingContext) -> rollout_pb2.RolloutRequest:
    """Validate ``request`` and return a copy with every default filled in and explicit seeds.
    InvalidRequest names every bad field, in the order the checks below run (a check that needs
    fields checked before it runs only once they are valid)."""
    limits = context.limits
    defaults = defaults_proto(context)
    resolved = rollout_pb2.RolloutRequest()
    resolved.CopyFrom(defaults)
    resolved.MergeFrom(request)
    # MergeFrom appends repeated fields: take the request's own.
    del resolved.seeds[:], resolved.stochastic_steps[:], resolved.debug_tensors[:], resolved.branches[:]
    del resolved.sigmas[:]

    layout, layout_problems = sample_layout(request, limits.max_samples)
    bad = _prompt_problems(request, layout, limits)
    bad += layout_problems
    bad += image_problems(request, context)
    if layout is not None:
        resolved.request_id = layout.request_id
        resolved.samples_per_prompt = layout.group_size
        resolved.seeds.extend(layout.seeds)
        if layout.base_seed is not None:
            resolved.base_seed = layout.base_seed
    seeds_refused = any(field == "seeds" for field, _ in bad)
    bad += shape_problems(request, resolved, layout, context, seeds_refused)
    bad += step_count_problems(request, resolved, context)
    bad += guidance_problems(request, resolved, defaults, context)
    bad += sampler_problems(request, resolved)
    bad += tree_problems(request, resolved, limits)
    # Only a trainer's schedule is probed: a family's own is its pipeline scheduler's, whose sigmas
    # are normal numbers well apart.
    if request.sigmas and not any(field.partition("[")[0] in STEP_FIELDS for field, _ in bad):
        bad += unstable_step_problems(resolved)
    bad += _stream_problems(request, resolved)
    if bad:
        raise InvalidRequest(bad)
    return resolved


def _prompt_problems(
    request: rollout_pb2.RolloutRequest, layout: SampleLayout | None, limits: Limits
) -> Problems:
    """The request id (``layout``'s, made up where the request sets none) and the prompts."""
    bad: Problems = []
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
    return bad


def _stream_problems(request: rollout_pb2.RolloutRequest, resolved: rollout_pb2.RolloutRequest) -> Problems:
    """What the stream carries (the latent selection and dtype, the debug tensors: taken into
    ``resolved``) and the policy version it waits for."""
    bad: Problems = []
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
    return bad
