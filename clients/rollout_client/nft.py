r"""What a DiffusionNFT-style trainer computes on streamed samples: RL on the forward (noising)
process, with no per-step log-probs (Zheng et al., 2025, "DiffusionNFT: Online Diffusion
Reinforcement with Forward Process").

A sample's final latent x (the clean x_T of its trajectory) is noised afresh to
``x_s = (1 - s) x + s eps`` at a level s, whose flow-matching target velocity is ``v* = eps - x``.
With ``v_old`` the velocity of the policy that rolled the samples out and ``v`` the trained one, both
on the sample's own (positive) conditioning, DiffusionNFT defines an implicit positive and negative
policy::

    v_plus  = (1 - beta) * v_old + beta * v
    v_minus = (1 + beta) * v_old - beta * v

and, with ``r`` in [0, 1] the sample's optimality::

    loss = mean over samples of  r * mean((v_plus - v*)^2) + (1 - r) * mean((v_minus - v*)^2)

At ``v = v_old`` its gradient is ``2 beta (2 r - 1) (v - v*) dv/dtheta``: samples better than their
group are fitted like flow-matching data, worse ones are pushed away, with no likelihood and no
sampler in the loss (any sampler, CFG included, may produce the samples).

* ``optimality(advantages, clip)``: ``r = 0.5 + 0.5 * clamp(A / clip, -1, 1)`` from the group
  advantages (``rollout_client.grpo.group_advantages``): with the default clip of 2, a sample two
  of its group's stds above the group's mean is fully positive.
* ``noised(x, eps, levels)``: x_s and v* for the given noise and levels [B].
* ``noise_levels(count, generator, minimum)``: levels drawn logit-normal, ``sigmoid(N(0, 1))``, the
  density that flow-matching pretraining uses (the shapes preset's included), mapped into
  ``[minimum, 1)`` (Flow-Factory's NFT configs train the high-noise half, ``minimum`` 0.5, where a
  sample's layout is decided).
* ``velocities(transformer, trajectories, x, levels)``: the transformer's velocity at x [B, ...] on
  each trajectory's positive env, by the stream's transformer-call rule, at timestep
  ``level * timesteps[0] / sigmas[0]`` (diffusers' flow-matching schedulers feed
  ``sigma * num_train_timesteps``; the ratio comes from the trajectory's own schedule).
* ``nft_loss(v, v_old, target, r, beta)``: the loss above (scalar).
* ``nft_x0_loss(v, v_old, x_s, x, levels, r, beta)``: the official DiffusionNFT scripts' form of
  it, on the predicted clean sample ``x0_pm = x_s - s v_pm`` (whose target is x itself), each
  sample's squared error divided by its own mean absolute error, detached (clipped below at 1e-5),
  and by beta::

      w_pm = stop_gradient(max(mean(|x0_pm - x|), 1e-5))
      loss = mean over samples of  (r * mean((x0_plus - x)^2) / w_plus
                                    + (1 - r) * mean((x0_minus - x)^2) / w_minus) / beta

  Since ``x0_pm - x = s (v* - v_pm)``, a sample's term is ``s mean((v_pm - v*)^2) / mean(|v_pm -
  v*|)``: every sample pulls with a force of about s, however far its prediction is, so neither the
  noisiest levels nor the samples furthest off dominate the step. (The official scripts also
  multiply by their advantage clip, a constant factor of the learning rate, left out here.)
* ``anchor_loss(v, v_reference)``: ``mean over samples of mean((v - v_reference)^2)``, the
  squared distance of the trained velocity to the reference model's (the base model, e.g. with the
  LoRA disabled) at the same points: DiffusionNFT's KL term, which the trainer weighs with
  ``--nft-anchor`` (the official 1e-4 is inert at small batches; the trainer logs the gradient
  norms of both terms so a weight can be chosen that bites).
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rollout_core import dtypes
from rollout_core.transformer_call import call_transformer, stack_envs

if TYPE_CHECKING:
    from rollout_client.trajectory import Trajectory

POSITIVE = "positive"


def optimality(advantages: torch.Tensor, clip: float = 2.0) -> torch.Tensor:
    """[B] in [0, 1]: 0.5 at the group's mean, 1 (0) at ``clip`` stds above (below) it."""
    if not clip > 0:
        raise ValueError(f"the optimality clip must be positive, got {clip}")
    return 0.5 + 0.5 * (advantages.float() / clip).clamp(-1.0, 1.0)


def final_latents(trajectories: Sequence["Trajectory"]) -> torch.Tensor:
    """float32 [B, ...]: each trajectory's last latent, the sample itself."""
    for trajectory in trajectories:
        if not trajectory.latent_mask[-1]:
            raise ValueError(
                f"sample {trajectory.sample_index} has no final latent: request LATENT_SELECTION_FINAL_ONLY "
                "or more"
            )
    return torch.stack([trajectory.latents[-1] for trajectory in trajectories])


def noise_levels(count: int, generator: torch.Generator | None = None, minimum: float = 0.0) -> torch.Tensor:
    """float32 [count] in (minimum, 1): ``minimum + (1 - minimum) sigmoid(N(0, 1))``."""
    levels = torch.sigmoid(torch.randn(count, generator=generator))
    return levels if minimum == 0 else minimum + (1 - minimum) * levels


def noised(x: torch.Tensor, eps: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_s, v*): ``(1 - s) x + s eps`` and ``eps - x`` for the levels s [B]."""
    s = levels.view(-1, *([1] * (x.ndim - 1))).to(x.dtype)
    return (1 - s) * x + s * eps, eps - x


def velocities(
    transformer: torch.nn.Module,
    trajectories: Sequence["Trajectory"],
    x: torch.Tensor,
    levels: torch.Tensor,
) -> torch.Tensor:
    """float32 [B, ...]: the velocity at x (one row per trajectory, at its noise level) on each
    trajectory's positive env; gradients flow unless the caller disables them. The trajectories must
    share one transformer call and env shapes (the samples of one request do)."""
    first = trajectories[0]
    call = first.transformer_call
    if any(t.transformer_call != call for t in trajectories):
        raise ValueError("the trajectories differ in transformer call: pass them apart")
    scale = float(first.timesteps[0] / first.sigmas[0])
    env = stack_envs([t.env[POSITIVE] for t in trajectories], call.batched_env_keys)
    env = {
        key: value.to(x.device) if isinstance(value, torch.Tensor) else value for key, value in env.items()
    }
    return call_transformer(
        transformer,
        x,
        (levels * scale).to(x.device),
        env,
        dtypes.BY_NAME[call.model_dtype],
        call.timestep_divisor,
        call.conditioning,
        call.form,
        call.batched_env_keys,
    )


def nft_loss(
    v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: torch.Tensor, beta: float = 1.0
) -> torch.Tensor:
    """DiffusionNFT's loss (scalar; see the module docstring)."""
    v_plus = (1 - beta) * v_old + beta * v
    v_minus = (1 + beta) * v_old - beta * v
    dims = tuple(range(1, v.ndim))
    positive = (v_plus - target).pow(2).mean(dim=dims)
    negative = (v_minus - target).pow(2).mean(dim=dims)
    r = r.to(v.device)
    return (r * positive + (1 - r) * negative).mean()


def nft_x0_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    x_s: torch.Tensor,
    x: torch.Tensor,
    levels: torch.Tensor,
    r: torch.Tensor,
    beta: float = 1.0,
) -> torch.Tensor:
    """DiffusionNFT's loss on the predicted clean sample with the per-sample adaptive weight (scalar;
    see the module docstring): ``x_s`` the noised samples at ``levels`` [B], ``x`` the samples."""
    s = levels.view(-1, *([1] * (x.ndim - 1))).to(device=v.device, dtype=v.dtype)
    dims = tuple(range(1, v.ndim))

    def weighted_error(prediction: torch.Tensor) -> torch.Tensor:
        error = x_s - s * prediction - x
        weight = error.detach().abs().mean(dim=dims).clamp_min(1e-5)
        return error.pow(2).mean(dim=dims) / weight

    positive = weighted_error((1 - beta) * v_old + beta * v)
    negative = weighted_error((1 + beta) * v_old - beta * v)
    r = r.to(v.device)
    return ((r * positive + (1 - r) * negative) / beta).mean()


def anchor_loss(v: torch.Tensor, v_reference: torch.Tensor) -> torch.Tensor:
    """The mean over samples of the mean squared velocity distance to the reference (scalar)."""
    return (v - v_reference.to(v.device)).pow(2).mean()
