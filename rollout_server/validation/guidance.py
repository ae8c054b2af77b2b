"""Guidance: the CFG and guidance scales the model reads (a scale it ignores is refused), the negative
prompt, and a two-expert model's second scale and boundary."""

from rollout.v1 import rollout_pb2
from rollout_server.validation.context import Problems, ServingContext, finite_in

SCALE_FIELDS = ("guidance_scale", "true_cfg_scale")


def guidance_problems(
    request: rollout_pb2.RolloutRequest,
    resolved: rollout_pb2.RolloutRequest,
    defaults: rollout_pb2.RolloutRequest,
    context: ServingContext,
) -> Problems:
    """The scales in their ranges and read by the model (or left at their ``defaults``), the negative
    prompt only where CFG runs and within the prompt length, then the second expert's fields."""
    model, bad = context.model, []
    if not finite_in(resolved.guidance_scale, 0.0, 100.0):
        bad.append(("guidance_scale", f"must be finite and in [0, 100], got {resolved.guidance_scale}"))
    if not finite_in(resolved.true_cfg_scale, 1.0, 100.0):
        bad.append(("true_cfg_scale", f"must be finite and in [1, 100], got {resolved.true_cfg_scale}"))
    # A model that does not read its CFG field (step- or guidance-distilled) runs without CFG.
    reads = f"its CFG scale is {model.cfg_scale_field}" if context.has_cfg else "it runs without CFG"
    for field in SCALE_FIELDS:
        # A scale the model does not read would be ignored: refused, unless it is the default that a
        # started event echoes (so a resolved request can be resent).
        ignored = request.HasField(field) and getattr(request, field) != getattr(defaults, field)
        if field not in model.scale_fields and ignored:
            bad.append((field, f"this model does not use it; {reads}"))
    if request.negative_prompt and getattr(resolved, model.cfg_scale_field) <= model.cfg_off_scale:
        needs = (
            f"is only used with {model.cfg_scale_field} > {model.cfg_off_scale:g}"
            if context.has_cfg
            else "this model runs without CFG"
        )
        bad.append(("negative_prompt", needs))
    if len(request.negative_prompt) > context.limits.max_prompt_chars:
        bad.append(("negative_prompt", f"longer than {context.limits.max_prompt_chars} characters"))
    return bad + _expert_problems(request, resolved, context)


def _expert_problems(
    request: rollout_pb2.RolloutRequest, resolved: rollout_pb2.RolloutRequest, context: ServingContext
) -> Problems:
    """The second expert's fields: refused on a model with one; on one with two, guidance_scale_2
    resolved to guidance_scale when unset (WanPipeline's default), and bounded as it is."""
    fields = ("guidance_scale_2", "boundary_ratio")
    if context.model.boundary_ratio is None:
        return [
            (field, "this model has one expert: no transformer_2")
            for field in fields
            if request.HasField(field)
        ]
    bad = []
    cfg_off_scale = context.model.cfg_off_scale
    if not request.HasField("guidance_scale_2"):
        resolved.guidance_scale_2 = resolved.guidance_scale
    elif not finite_in(resolved.guidance_scale_2, 0.0, 100.0):
        bad.append(("guidance_scale_2", f"must be finite and in [0, 100], got {resolved.guidance_scale_2}"))
    elif resolved.guidance_scale <= cfg_off_scale and resolved.guidance_scale_2 != resolved.guidance_scale:
        # The pipeline runs CFG on guidance_scale alone: the second scale would be ignored.
        bad.append(("guidance_scale_2", f"is only used with guidance_scale > {cfg_off_scale:g}"))
    if not finite_in(resolved.boundary_ratio, 0.0, 1.0):
        bad.append(("boundary_ratio", f"must be finite and in [0, 1], got {resolved.boundary_ratio}"))
    return bad
