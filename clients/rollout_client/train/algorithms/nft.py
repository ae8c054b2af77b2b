"""DiffusionNFT (``rollout_client.nft``): a flow-matching style loss on the final latents against the
rollout policy's own velocities; no step's log-prob enters it."""

from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_client.grpo import group_advantages, row_batches
from rollout_client.nft import (
    final_latents,
    nft_loss,
    nft_x0_loss,
    noise_levels,
    noised,
    optimality,
    velocities,
)
from rollout_client.train.algorithms.base import Algorithm, register

if TYPE_CHECKING:
    from rollout_client import Trajectory
    from rollout_client.train.rollouts import Rollout


@register("nft")
class DiffusionNFT(Algorithm):
    latents = rollout_pb2.LATENT_SELECTION_FINAL_ONLY
    max_grad_norm = 1.0

    @classmethod
    def refusal(cls, args, world: int) -> str | None:
        if world > 1:
            return f"--algorithm nft runs on one trainer rank, not {world}"
        # NFT scores no step: nothing to window or to score early, no step Gaussians for the KL, and
        # its old velocities must be the rollout policy's, which a stale rollout is not.
        for flag in ("window", "kl_beta", "grpo_guard", "async_", "score_while_streaming"):
            if getattr(args, flag):
                return (
                    f"--{flag.rstrip('_').replace('_', '-')} is for FlowGRPO: --algorithm nft scores no step"
                )
        return None

    def update(self, rollout: "Rollout", rewards: torch.Tensor, iteration: int) -> float:
        """--nft-draws optimizer steps, each on every sample's final latent noised afresh, against the
        velocities of the policy that rolled them out (computed at every draw's points before the first
        step). Returns the mean loss."""
        config, transformer = self.config, self.trainer.transformer
        trajectories: list[Trajectory] = rollout.trajectories
        advantages = group_advantages(rewards, torch.tensor([t.prompt_index for t in trajectories]))
        generator = torch.Generator().manual_seed(
            config.seed * 1_000_033 + iteration
        )  # a resumed run draws alike
        x = final_latents(trajectories).to(config.device)
        r = optimality(advantages)
        pieces = row_batches(trajectories, config.optim.micro_batch)
        draws = []
        with torch.no_grad():
            for _ in range(config.nft.draws):
                levels = noise_levels(len(trajectories), generator)
                x_s, target = noised(x, torch.randn(x.shape, generator=generator).to(config.device), levels)
                v_old = torch.empty_like(x_s)
                for rows in pieces:
                    v_old[rows] = velocities(
                        transformer, [trajectories[k] for k in rows], x_s[rows], levels[rows]
                    )
                draws.append((x_s, target, levels, v_old))
        total = 0.0
        for x_s, target, levels, v_old in draws:
            self.trainer.zero_grad()
            for rows in pieces:
                v = velocities(transformer, [trajectories[k] for k in rows], x_s[rows], levels[rows])
                if config.nft.loss == "x0":
                    loss = nft_x0_loss(
                        v, v_old[rows], x_s[rows], x[rows], levels[rows], r[rows], config.nft.beta
                    )
                else:
                    loss = nft_loss(v, v_old[rows], target[rows], r[rows], config.nft.beta)
                loss = loss * len(rows) / len(trajectories)
                loss.backward()
                total += loss.item() / config.nft.draws
            self.trainer.optimizer_step()
        return total
