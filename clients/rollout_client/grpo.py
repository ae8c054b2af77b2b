r"""What a FlowGRPO-style trainer computes on streamed trajectories: log-probs with gradients, group
advantages, the clipped policy loss, the KL penalty and the Flow-GRPO-Fast step window.

* ``step_transitions(transformer, trajectories, i)``: step i of each trajectory recomputed under
  ``transformer``, differentiable: the transition mean [B, ...], its std [B] and the log-prob of the
  streamed x_{i+1} [B] (float32). The rows go through one forward per CFG branch (env stacked by the
  stream's batching rule), guidance and the step math run in float32, and the streamed x_{i+1} is
  scored exactly as the server scored it: at the policy the rollout ran on, the log-prob equals the
  streamed one up to the model's float rounding. ``step_log_probs`` is its log-prob alone.
* ``micro_batches(trajectories, steps, size)``: the (step, rows) pieces to score, at most ``size``
  rows each: memory is bounded by what one piece's forward and backward hold (``row_batches``: the
  pieces of rows alone).
* ``group_advantages(rewards, groups)``: per prompt group,
  ``A = (r - mean_group(r)) / (std_group(r) + eps)``, the population std, eps = 1e-4 (FlowGRPO's
  per-prompt stat tracking).
* ``clipped_policy_loss(log_probs, old_log_probs, advantages, clip_range)``: PPO's clipped surrogate
  as FlowGRPO writes it, with ``rho = exp(log_probs - old_log_probs)`` and ``A`` clipped to
  [-adv_clip_max, adv_clip_max] (FlowGRPO: 5)::

      loss = mean(max(-A * rho, -A * clip(rho, 1 - clip_range, 1 + clip_range)))

  FlowGRPO's clip ranges are small: 1e-4 (1e-5 with Flow-GRPO-Fast and CPS).
* ``kl_to_reference(means, reference_means, stds)``: per sample, the KL divergence between the
  step's Gaussian under the policy and under the reference policy (the base model, e.g. with the
  LoRA disabled), which share the std, as a mean over latent elements like the log-prob::

      KL = mean((mean - reference_mean)^2) / (2 sd^2)

  FlowGRPO adds ``beta * mean(KL)`` to the loss (beta = 0.04 for most of its rewards, 0 by default).
* ``sde_window(num_steps, size, generator)``: Flow-GRPO-Fast's window: ``size`` consecutive
  stochastic steps starting at a random step in [0, num_steps // 2) (clipped to fit), the rest ODE;
  only the window is trained on. Send it as the request's ``stochastic_steps``.
"""

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from rollout_core import dtypes, steps
from rollout_core.transformer_call import apply_guidance, call_transformer, stack_envs

if TYPE_CHECKING:
    from rollout_client.trajectory import Trajectory


def _on(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _call_key(trajectory: "Trajectory") -> tuple:
    """Trajectories with equal keys can share one batched forward: same transformer call and expert
    per step, same latent shape, same env tensor shapes per branch."""
    shapes = sorted(
        (branch, key, tuple(value.shape))
        for branch, env in trajectory.env.items()
        for key, value in env.items()
        if isinstance(value, torch.Tensor)
    )
    return (
        trajectory.transformer_call,
        tuple(trajectory.step_transformers),
        tuple(trajectory.latents.shape[1:]),
        tuple(shapes),
    )


class Transition(NamedTuple):
    """Step i of B trajectories recomputed under a transformer (float32)."""

    log_probs: torch.Tensor  # [B]: the streamed x_{i+1} scored under N(means, stds^2)
    means: torch.Tensor  # [B, ...]
    stds: torch.Tensor  # [B]


Transformer = torch.nn.Module | Mapping[str, torch.nn.Module]


def expert(transformer: Transformer, trajectory: "Trajectory", i: int) -> torch.nn.Module:
    """The module that replays step ``i``: ``transformer`` itself, or, given the pipeline's experts
    by component name (Wan 2.2: ``{"transformer": ..., "transformer_2": ...}``), the one that ran it."""
    if not isinstance(transformer, Mapping):
        return transformer
    name = trajectory.step_transformers[i] if trajectory.step_transformers else "transformer"
    return transformer[name]


def step_transitions(
    transformer: Transformer,
    trajectories: Sequence["Trajectory"],
    i: int,
    device: str | torch.device = "cpu",
) -> Transition:
    """Step ``i`` of each trajectory recomputed with ``transformer`` (gradients flow unless the caller
    disables them), or with the expert that ran it when given the experts by name. Step i must be
    stochastic in each, with x_i and x_{i+1} streamed; all must share one transformer-call rule, env
    shapes and expert at step i (e.g. the samples of one request: split other mixes by request, as
    ``micro_batches`` does)."""
    device = torch.device(device)
    first = trajectories[0]
    call = first.transformer_call
    model, first_key = expert(transformer, first, i), _call_key(first)
    for trajectory in trajectories:
        if not (trajectory.stochastic[i] and trajectory.latent_mask[i] and trajectory.latent_mask[i + 1]):
            raise ValueError(
                f"step {i} of sample {trajectory.sample_index} is not stochastic, or x_{i} or x_{i + 1} "
                "was not streamed"
            )
        if _call_key(trajectory) != first_key or expert(transformer, trajectory, i) is not model:
            raise ValueError(
                "the trajectories differ in transformer call, env shapes or expert: pass them apart"
            )
    model_dtype = dtypes.BY_NAME[call.model_dtype]
    x = torch.stack([t.latents[i] for t in trajectories]).to(device)
    timesteps = torch.stack([t.timesteps[i] for t in trajectories])
    velocities = {}
    for branch in first.env:
        env = stack_envs([t.env[branch] for t in trajectories], call.batched_env_keys)
        env = {key: _on(value, device) for key, value in env.items()}
        velocities[branch] = call_transformer(
            model, x, timesteps, env, model_dtype, call.timestep_divisor, call.conditioning
        )
    v = apply_guidance(call.guidance_rule, call.guidance_rule_scale, velocities)
    means, stds, log_probs = [], [], []
    for row, trajectory in enumerate(trajectories):
        kind, sigmas, level = trajectory.sampler_type, trajectory.sigmas, trajectory.noise_level
        mean = steps.transition_mean(kind, x[row : row + 1], v[row : row + 1], sigmas, i, level)
        sd = steps.noise_std(kind, sigmas, i, level).to(device)
        x_next = trajectory.latents[i + 1].unsqueeze(0).to(device)
        means.append(mean)
        stds.append(sd.reshape(1))
        log_probs.append(steps.log_prob(x_next - mean, sd, trajectory.log_prob_constants))
    return Transition(torch.cat(log_probs), torch.cat(means), torch.cat(stds))


def step_log_probs(
    transformer: Transformer,
    trajectories: Sequence["Trajectory"],
    i: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """float32 [B]: the log-prob of step ``i`` of each trajectory under ``transformer``."""
    return step_transitions(transformer, trajectories, i, device).log_probs


def row_batches(trajectories: Sequence["Trajectory"], size: int) -> list[list[int]]:
    """Row indices into ``trajectories`` in pieces of at most ``size``, each of one transformer call
    and env shapes (one batched forward each), covering every row once."""
    if size < 1:
        raise ValueError("a micro-batch holds at least one row")
    kinds: dict[tuple, list[int]] = {}
    for row, trajectory in enumerate(trajectories):
        kinds.setdefault(_call_key(trajectory), []).append(row)
    return [rows[start : start + size] for rows in kinds.values() for start in range(0, len(rows), size)]


def micro_batches(
    trajectories: Sequence["Trajectory"], step_indices: Iterable[int], size: int
) -> Iterator[tuple[int, list[int]]]:
    """(step, row indices into ``trajectories``) pieces covering every trajectory at every given step,
    at most ``size`` rows each: ``row_batches`` at each step, so each piece can go to
    ``step_transitions`` as one batch."""
    pieces = row_batches(trajectories, size)
    for i in step_indices:
        for rows in pieces:
            yield i, rows


def sde_window(
    num_steps: int, size: int, generator: torch.Generator | None = None, last_start: int | None = None
) -> list[int]:
    """Flow-GRPO-Fast's stochastic window: ``size`` consecutive steps from a start drawn uniformly in
    [0, last_start] (default ``num_steps // 2 - 1``), shifted so the window fits."""
    if not 1 <= size <= num_steps:
        raise ValueError(f"a window of {size} steps does not fit {num_steps} steps")
    last_start = max(num_steps // 2 - 1, 0) if last_start is None else last_start
    start = int(torch.randint(0, last_start + 1, (), generator=generator))
    start = min(start, num_steps - size)
    return list(range(start, start + size))


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


def kl_to_reference(means: torch.Tensor, reference_means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """[B]: KL(policy step || reference step) per sample, a mean over latent elements (see the module
    docstring); ``stds`` are the step's noise stds, shared by both Gaussians."""
    squared = (means.float() - reference_means.float()) ** 2
    per_sample = squared.mean(dim=tuple(range(1, squared.ndim)))
    return per_sample / (2 * stds.float() ** 2)
