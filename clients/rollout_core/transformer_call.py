"""How a velocity is computed from the transformer and the frozen env: the one rule that the server
runs and that a trainer replays.

For each env branch (``positive``, and ``negative`` with true CFG)::

    v_branch = transformer(hidden_states=x.to(model_dtype),
                           timestep=(timesteps[B] / timestep_divisor).to(model_dtype),
                           **env[branch])[0].float()

where ``timesteps`` holds each row's timestep as float32 (a trainer replaying one step passes that
step's timestep for every row; a server batching rollouts at different steps passes one per row: the
numbers each row is fed are the same either way).

then the guidance rule combines the branches in float32:

* ``none``: v = v_positive
* ``true_cfg``: v = v_negative + scale * (v_positive - v_negative)   (also SD3's classic CFG)
* ``true_cfg_norm_rescale`` (Qwen-Image): c = v_negative + scale * (v_positive - v_negative), then
  v = c * ||v_positive|| / ||c||, norms over the last dimension
"""

from collections.abc import Iterable, Mapping
from typing import Any

import torch

GUIDANCE_RULES = ("none", "true_cfg", "true_cfg_norm_rescale")


def call_transformer(
    transformer: torch.nn.Module,
    x: torch.Tensor,
    timestep: float | torch.Tensor,
    env: Mapping[str, Any],
    model_dtype: torch.dtype,
    timestep_divisor: float,
) -> torch.Tensor:
    """One branch's velocity, float32, for the batch ``x`` [B, ...]; ``timestep`` is one value for
    every row, or float32 [B], one per row."""
    fed_timestep = torch.as_tensor(timestep, dtype=torch.float32, device=x.device).expand(x.shape[0])
    fed_timestep = (fed_timestep / timestep_divisor).to(model_dtype)
    output = transformer(hidden_states=x.to(model_dtype), timestep=fed_timestep, **env)
    return (output[0] if isinstance(output, tuple) else output.sample).float()


def apply_guidance(rule: str, scale: float, velocities: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Combine branch velocities (float32) by the guidance rule."""
    if rule not in GUIDANCE_RULES:
        raise ValueError(f"unknown guidance rule {rule!r}; expected one of {GUIDANCE_RULES}")
    if rule == "none":
        return velocities["positive"]
    positive, negative = velocities["positive"], velocities["negative"]
    combined = negative + scale * (positive - negative)
    if rule == "true_cfg":
        return combined
    return combined * (
        torch.norm(positive, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
    )


def stack_envs(envs: Iterable[Mapping[str, Any]], batched_keys: Iterable[str]) -> dict[str, Any]:
    """Batch per-sample envs: batched tensors concatenate along dim 0, batched lists concatenate,
    shared (and absent, None) entries are taken from the first env."""
    envs = list(envs)
    batched = set(batched_keys)
    stacked = {}
    for key, first in envs[0].items():
        if key not in batched or first is None:
            stacked[key] = first
        elif isinstance(first, torch.Tensor):
            stacked[key] = torch.cat([env[key] for env in envs])
        else:
            stacked[key] = [item for env in envs for item in env[key]]
    return stacked
