"""How far the trained velocity field has moved from the base model's, as one number per iteration.

``VelocityProbe(transformer, trajectories, seed)`` fixes its points once, from the first rollout the
run trains on: the first ``SAMPLES`` trajectories' last streamed latents z, each noised to every level
s of ``LEVELS`` with seeded noise, ``(1 - s) z + s eps`` (the high levels are where a sample's layout
is decided). ``ratio(transformer)`` is then ``|v_policy| / |v_base|`` over all those points (the root
of the summed squares of each), with the base the same transformer with its LoRA disabled: 1 for the
base model, above 1 for a policy whose velocities grow, the drift a reward can hide.
"""

import torch

from rollout_client.grpo import row_batches
from rollout_client.nft import noised, velocities
from rollout_client.train.averages import base_model

SAMPLES = 8
LEVELS = (0.25, 0.5, 0.75, 1.0)


class VelocityProbe:
    def __init__(self, transformer: torch.nn.Module, trajectories: list, seed: int, device: str):
        first = [trajectories[k] for k in row_batches(trajectories, SAMPLES)[0]]  # one transformer call
        z = torch.stack(
            [t.latents[max(i for i, kept in enumerate(t.latent_mask) if kept)] for t in first]
        ).to(device)
        eps = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed)).to(device)
        points = [noised(z, eps, torch.full((len(first),), level))[0] for level in LEVELS]
        self.x = torch.cat(points)
        self.levels = torch.tensor(LEVELS).repeat_interleave(len(first))
        self.trajectories = first * len(LEVELS)
        with base_model(transformer):
            self.base_norm = self._norm(transformer)

    @torch.no_grad()
    def _norm(self, transformer: torch.nn.Module) -> float:
        v = velocities(transformer, self.trajectories, self.x, self.levels)
        return v.double().pow(2).sum().sqrt().item()

    def ratio(self, transformer: torch.nn.Module) -> float:
        return self._norm(transformer) / self.base_norm
