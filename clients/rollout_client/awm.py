r"""What an Advantage Weighted Matching trainer computes on streamed samples (Xue et al., 2025, "Advantage
Weighted Matching: Aligning RL with Pretraining in Diffusion Models"): the flow-matching loss of
pretraining on the policy's own samples, each sample's term weighted by its advantage.

A sample's final latent x is noised afresh to ``x_s = (1 - s) x + s eps`` (``rollout_client.nft.noised``),
whose target velocity is ``v* = eps - x``. With ``l = mean((v - v*)^2)`` the sample's flow-matching
error and ``A`` in [-1, 1] its advantage::

    w(l, s) = (s / p) * ((l + c)^p - c^p)          (c = 1e-3)
    loss    = mean over samples of  A * w(l, s)

At p = 1 this is ``s * A * l``: better samples than their group's mean (A > 0) are fitted like data,
worse ones (A < 0) are pushed away. A power below 1 (the default 0.25, a generalised Huber) makes
``dw/dl = s (l + c)^(p - 1)`` fall as the error grows: a sample the policy already misses by much gets a
small push, so pushing away from the bad samples cannot run off without bound, and a sample fitted
well pulls hard. The factor s weights the noisier levels, where the layout is decided, above the
nearly clean ones.

* ``signed_advantages(advantages, clip)``: ``A = clamp(advantages / clip, -1, 1)``, i.e.
  ``2 r - 1`` with DiffusionNFT's optimality r (``rollout_client.nft.optimality``).
* ``robust_weight(errors, levels, power)``: ``w(l, s)`` above, per sample [B].
* ``awm_loss(v, target, levels, advantages, power)``: the loss above (scalar), with the advantages
  already in [-1, 1].

The trainer adds a KL to a slowly moving average of the policy (``--awm-kl``, with
``rollout_client.nft.anchor_loss`` against the EMA's velocities), which holds the policy near where it
has been rather than near the base model.
"""

import torch

OFFSET = 1e-3  # c: keeps the weighting's gradient finite at l = 0


def signed_advantages(advantages: torch.Tensor, clip: float = 2.0) -> torch.Tensor:
    """[B] in [-1, 1]: 0 at the group's mean, 1 (-1) at ``clip`` stds above (below) it."""
    if not clip > 0:
        raise ValueError(f"the advantage clip must be positive, got {clip}")
    return (advantages.float() / clip).clamp(-1.0, 1.0)


def robust_weight(errors: torch.Tensor, levels: torch.Tensor, power: float = 0.25) -> torch.Tensor:
    """[B]: ``(s / p) ((l + c)^p - c^p)`` for the per-sample errors l and levels s."""
    if not power > 0:
        raise ValueError(f"the weighting's power must be positive, got {power}")
    s = levels.to(device=errors.device, dtype=errors.dtype)
    return s / power * ((errors + OFFSET).pow(power) - OFFSET**power)


def awm_loss(
    v: torch.Tensor, target: torch.Tensor, levels: torch.Tensor, advantages: torch.Tensor, power: float = 0.25
) -> torch.Tensor:
    """AWM's loss (scalar; see the module docstring): ``v`` the trained velocities at the noised samples,
    ``target`` their v*, ``levels`` [B] their noise levels, ``advantages`` [B] in [-1, 1]."""
    errors = (v - target).pow(2).mean(dim=tuple(range(1, v.ndim)))
    return (advantages.to(v.device) * robust_weight(errors, levels, power)).mean()
