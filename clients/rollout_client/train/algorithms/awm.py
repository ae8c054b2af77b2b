"""Advantage Weighted Matching (``rollout_client.awm``): the flow-matching loss on the final latents,
each sample's term weighted by its advantage, with an optional KL to the EMA of the trained weights."""

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch

from rollout_client.awm import awm_loss, signed_advantages
from rollout_client.grpo import group_advantages, row_batches
from rollout_client.nft import anchor_loss, velocities
from rollout_client.train.algorithms.base import register
from rollout_client.train.algorithms.nft import ForwardProcess
from rollout_client.train.options import NOT_NEGATIVE, Options, option, positive

if TYPE_CHECKING:
    from rollout_client.train.config import TrainConfig
    from rollout_client.train.rollouts import Rollout


@dataclasses.dataclass
class AWMConfig(Options):
    """AWM's options (``config.awm``)"""

    KEY: ClassVar[str] = "awm"
    FLAG_PREFIX: ClassVar[str] = "awm_"

    power: float = option(
        0.25,
        "awm: the power p of the robust weighting (t / p) ((l + 1e-3)^p - 1e-3^p) of each "
        "sample's flow-matching error l (1: the plain error, times t)",
        rule=positive(),
        algorithms=("awm",),
    )
    kl: float = option(
        0.0,
        "awm: weight of the squared velocity distance to the EMA of --ema-decay (0: none)",
        rule=NOT_NEGATIVE,
        algorithms=("awm",),
    )

    def conflict(self, config: "TrainConfig", world: int) -> str | None:
        if self.kl and not config.ema_decay:
            return "--awm-kl pulls towards the EMA of the trained weights: it needs --ema-decay"
        return None


@register("awm", options=AWMConfig)
class AdvantageWeightedMatching(ForwardProcess):
    def update(self, rollout: "Rollout", rewards: torch.Tensor, iteration: int) -> float:
        """--nft-draws optimizer steps, each on every sample's final latent noised afresh: AWM's loss, plus
        with --awm-kl the weighted squared distance to the EMA's velocities at the same points. Returns
        the mean loss, the KL included."""
        config, trainer = self.config, self.trainer
        trajectories = rollout.trajectories
        advantages = signed_advantages(
            group_advantages(rewards, torch.tensor([t.prompt_index for t in trajectories]))
        )
        _, draws = self.draws(trajectories, iteration)
        pieces = row_batches(trajectories, config.optim.micro_batch)
        total = 0.0
        for x_s, target, levels in draws:
            v_ema = None
            if config.awm.kl > 0:
                with trainer.ema.applied(trainer.parameters):
                    v_ema = self.velocities_of(trajectories, pieces, x_s, levels)
            trainer.zero_grad()
            step_loss = 0.0
            for rows in pieces:
                v = velocities(trainer.transformer, [trajectories[k] for k in rows], x_s[rows], levels[rows])
                loss = awm_loss(v, target[rows], levels[rows], advantages[rows], config.awm.power)
                if v_ema is not None:
                    loss = loss + config.awm.kl * anchor_loss(v, v_ema[rows])
                loss = loss * len(rows) / len(trajectories)
                step_loss += loss.item()
                total += loss.item() / config.nft.draws
                loss.backward()
            trainer.optimizer_step(step_loss)
        return total
