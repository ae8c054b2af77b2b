r"""What a FlowGRPO-style trainer computes on streamed trajectories: log-probs with gradients, group
advantages and the clipped policy loss.

* ``step_log_probs(transformer, trajectories, i)``: the log-prob of step i of each trajectory under
  ``transformer``, differentiable, float32 [B]. The rows of a micro-batch go through one forward per
  CFG branch (env stacked by the stream's batching rule), guidance and the step math run in float32,
  and the streamed x_{i+1} is scored, exactly as the server scored it: at the policy the rollout ran
  on, ``step_log_probs`` equals the streamed log-prob up to the model's float rounding. The caller
  bounds memory by the micro-batch it passes (and backpropagates per micro-batch).
* ``group_advantages(rewards, groups)``: per prompt group,
  ``A = (r - mean_group(r)) / (std_group(r) + eps)``, the population std, eps = 1e-4 (FlowGRPO's
  per-prompt stat tracking).
* ``clipped_policy_loss(log_probs, old_log_probs, advantages, clip_range)``: PPO's clipped surrogate
  as FlowGRPO writes it, with ``rho = exp(log_probs - old_log_probs)`` and ``A`` clipped to
  [-adv_clip_max, adv_clip_max] (FlowGRPO: 5)::

      loss = mean(max(-A * rho, -A * clip(rho, 1 - clip_range, 1 + clip_range)))

  FlowGRPO's clip ranges are small: 1e-4 (1e-5 with Flow-GRPO-Fast and CPS).
"""

from collections.abc import Sequence

import torch

from rollout_client.trajectory import Trajectory
from rollout_core import dtypes, steps
from rollout_core.transformer_call import apply_guidance, call_transformer, stack_envs


def _on(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _env_shapes(trajectory: Trajectory) -> list:
    return sorted(
        (branch, key, tuple(value.shape))
        for branch, env in trajectory.env.items()
        for key, value in env.items()
        if isinstance(value, torch.Tensor)
    )


def step_log_probs(
    transformer: torch.nn.Module,
    trajectories: Sequence[Trajectory],
    i: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """float32 [B]: the log-prob of step ``i`` of each trajectory, recomputed with ``transformer``
    (gradients flow unless the caller disables them). Step i must be stochastic in each, with x_i
    and x_{i+1} streamed; all must share one transformer-call rule and env shapes (e.g. the samples
    of one request: split other mixes by request)."""
    device = torch.device(device)
    first = trajectories[0]
    call = first.transformer_call
    for trajectory in trajectories:
        if not (trajectory.stochastic[i] and trajectory.latent_mask[i] and trajectory.latent_mask[i + 1]):
            raise ValueError(
                f"step {i} of sample {trajectory.sample_index} is not stochastic, or x_{i} or x_{i + 1} "
                "was not streamed"
            )
        if trajectory.transformer_call != call or _env_shapes(trajectory) != _env_shapes(first):
            raise ValueError("the trajectories differ in transformer call or env shapes: pass them apart")
    model_dtype = dtypes.BY_NAME[call["model_dtype"]]
    x = torch.stack([t.latents[i] for t in trajectories]).to(device)
    timesteps = torch.stack([t.timesteps[i] for t in trajectories])
    velocities = {}
    for branch in first.env:
        env = stack_envs([t.env[branch] for t in trajectories], call["batched_env_keys"])
        env = {key: _on(value, device) for key, value in env.items()}
        velocities[branch] = call_transformer(
            transformer, x, timesteps, env, model_dtype, call["timestep_divisor"]
        )
    v = apply_guidance(call["guidance_rule"], call["guidance_rule_scale"], velocities)
    log_probs = []
    for row, trajectory in enumerate(trajectories):
        kind, sigmas, level = trajectory.sampler_type, trajectory.sigmas, trajectory.noise_level
        mean = steps.transition_mean(kind, x[row : row + 1], v[row : row + 1], sigmas, i, level)
        sd = steps.noise_std(kind, sigmas, i, level)
        x_next = trajectory.latents[i + 1].unsqueeze(0).to(device)
        log_probs.append(steps.log_prob(x_next - mean, sd, trajectory.log_prob_constants))
    return torch.cat(log_probs)


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Per-sample advantages [N]: each reward standardised within its group (the samples sharing a
    value of ``groups``, e.g. a prompt), with the population std."""
    rewards = rewards.double()
    advantages = torch.empty_like(rewards)
    for group in torch.unique(groups):
        members = groups == group
        values = rewards[members]
        advantages[members] = (values - values.mean()) / (values.std(correction=0) + eps)
    return advantages.float()


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float = 5.0,
) -> torch.Tensor:
    """PPO's clipped surrogate (scalar; see the module docstring)."""
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean()
