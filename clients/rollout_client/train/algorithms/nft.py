"""The forward-process algorithms, which train on each sample's final latent noised afresh and score
no step's log-prob: DiffusionNFT (``rollout_client.nft``) here, AWM (``rollout_client.awm``) in ``awm``."""

import contextlib
import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch

from rollout.v1 import rollout_pb2
from rollout_client.grpo import group_advantages, row_batches
from rollout_client.nft import (
    anchor_loss,
    final_latents,
    nft_loss,
    nft_x0_loss,
    noise_levels,
    noised,
    optimality,
    velocities,
)
from rollout_client.train.algorithms.base import Algorithm, register
from rollout_client.train.averages import WeightAverage, base_model, ramped_decay
from rollout_client.train.options import FRACTION, NOT_NEGATIVE, Options, at_least, option, positive

if TYPE_CHECKING:
    from rollout_client import Trajectory
    from rollout_client.train.config import TrainConfig
    from rollout_client.train.rollouts import Rollout


@dataclasses.dataclass
class NFTConfig(Options):
    """DiffusionNFT's options (AWM's draws too).

    ``config.nft``; AWM draws its noises and levels by ``draws`` and ``min_level``."""

    KEY: ClassVar[str] = "nft"
    FLAG_PREFIX: ClassVar[str] = "nft_"

    beta: float = option(1.0, "nft: the implicit policies' step beta", rule=positive())
    loss: str = option(
        "velocity",
        "nft: the loss on the velocities (rollout_client.nft.nft_loss), or the official scripts' on "
        "the predicted clean sample, each sample divided by its own mean absolute error (nft_x0_loss)",
        choices=("velocity", "x0"),
    )
    anchor: float = option(
        0.0,
        "nft: weight of the squared velocity distance to the base model "
        "(rollout_client.nft.anchor_loss); its gradient norm and the policy term's are logged",
        rule=NOT_NEGATIVE,
    )
    old_decay: float = option(
        0.0,
        "nft: roll out with an old policy that follows the trained one, old <- eta old + "
        "(1 - eta) theta after each iteration, eta ramping up to this (0: roll out with the trained one)",
        rule=FRACTION,
        algorithms=("nft",),
    )
    old_ramp: int = option(
        20,
        "nft: the iterations over which the old policy's eta ramps from 0 to --nft-old-decay",
        rule=at_least(0),
        algorithms=("nft",),
    )
    draws: int = option(
        4,
        "nft and awm: optimizer steps per iteration, each on a fresh noise and level of every sample",
        rule=at_least(1),
    )
    min_level: float = option(
        0.0,
        "nft and awm: draw the noise levels in [this, 1) only (0.5: the high-noise half)",
        rule=FRACTION,
        algorithms=("nft", "awm"),
    )

    def conflict(self, config: "TrainConfig", world: int) -> str | None:
        if config.optim.train == "full" and self.anchor:
            return "--nft-anchor compares with the base model through the LoRA: it needs --train lora"
        return None


class ForwardProcess(Algorithm):
    """What DiffusionNFT and AWM share: the final latents only, one trainer rank, the gradients clipped
    to 1, and --nft-draws optimizer steps per iteration, each on every sample noised afresh at levels
    drawn in [--nft-min-level, 1)."""

    latents = rollout_pb2.LATENT_SELECTION_FINAL_ONLY
    max_grad_norm = 1.0

    @classmethod
    def refusal(cls, config: "TrainConfig", world: int) -> str | None:
        if world > 1:
            return f"--algorithm {cls.name} runs on one trainer rank, not {world}"
        # It scores no step: nothing to window or to score early, no step Gaussians for the KL, and its
        # loss compares with the rollout policy, which a stale rollout is not.
        flags = [
            *config.rollout.flags_set("window"),
            *config.optim.flags_set("kl_beta", "grpo_guard"),
            *config.rollout.flags_set("async_", "score_while_streaming"),
        ]
        return f"{flags[0]} is for FlowGRPO: --algorithm {cls.name} scores no step" if flags else None

    def draws(self, trajectories: list["Trajectory"], iteration: int):
        """The iteration's samples x [B, ...] and --nft-draws (x_s, v*, levels) of them, seeded by the
        run's seed and the iteration (a resumed run draws alike)."""
        config = self.config
        generator = torch.Generator().manual_seed(config.seed * 1_000_033 + iteration)
        x = final_latents(trajectories).to(config.device)
        draws = []
        for _ in range(config.nft.draws):
            levels = noise_levels(len(trajectories), generator, config.nft.min_level)
            x_s, target = noised(x, torch.randn(x.shape, generator=generator).to(config.device), levels)
            draws.append((x_s, target, levels))
        return x, draws

    @torch.no_grad()
    def velocities_of(self, trajectories, pieces, x_s, levels) -> torch.Tensor:
        """The velocities at ``x_s`` of the weights the transformer holds now, without gradients."""
        out = torch.empty_like(x_s)
        for rows in pieces:
            out[rows] = velocities(
                self.trainer.transformer, [trajectories[k] for k in rows], x_s[rows], levels[rows]
            )
        return out


@register("nft", options=NFTConfig)
class DiffusionNFT(ForwardProcess):
    def __init__(self, trainer):
        super().__init__(trainer)
        # --nft-old-decay: the rollouts and v_old come from an old policy that follows the trained one.
        self.old = WeightAverage(trainer.parameters) if self.config.nft.old_decay > 0 else None

    @property
    def own_rollout_policy(self) -> bool:
        return self.old is not None

    def rollout_weights(self):
        return self.old.applied(self.trainer.parameters) if self.old is not None else contextlib.nullcontext()

    def state(self) -> dict:
        return {} if self.old is None else {"old": self.old.state_dict()}

    def load_state(self, state: dict) -> None:
        if self.old is not None:
            self.old.load_state_dict(state["old"])

    def update(self, rollout: "Rollout", rewards: torch.Tensor, iteration: int) -> float:
        """--nft-draws optimizer steps, each on every sample's final latent noised afresh, against the
        velocities of the policy that rolled them out (computed at every draw's points before the first
        step), plus with --nft-anchor the weighted anchor to the base model's velocities at the same
        points; then the old policy (--nft-old-decay) moves towards the trained one. Returns the mean
        loss, the anchor included."""
        config, transformer, parameters = self.config, self.trainer.transformer, self.trainer.parameters
        trajectories: list[Trajectory] = rollout.trajectories
        advantages = group_advantages(rewards, torch.tensor([t.prompt_index for t in trajectories]))
        x, draws = self.draws(trajectories, iteration)
        r = optimality(advantages)
        pieces = row_batches(trajectories, config.optim.micro_batch)
        with self.rollout_weights():  # swapped in once for every draw
            old = [self.velocities_of(trajectories, pieces, x_s, levels) for x_s, _, levels in draws]
        references = [None] * len(draws)
        if config.nft.anchor > 0:
            with base_model(transformer):
                references = [
                    self.velocities_of(trajectories, pieces, x_s, levels) for x_s, _, levels in draws
                ]
        points = [
            (*draw, v_old, v_reference)
            for draw, v_old, v_reference in zip(draws, old, references, strict=True)
        ]
        total = 0.0
        self.grad_norms = {"policy": 0.0, "anchor": 0.0}
        for x_s, target, levels, v_old, v_reference in points:
            self.trainer.zero_grad()
            step_loss = 0.0
            policy_grads = anchor_grads = None
            for rows in pieces:
                v = velocities(transformer, [trajectories[k] for k in rows], x_s[rows], levels[rows])
                if config.nft.loss == "x0":
                    loss = nft_x0_loss(
                        v, v_old[rows], x_s[rows], x[rows], levels[rows], r[rows], config.nft.beta
                    )
                else:
                    loss = nft_loss(v, v_old[rows], target[rows], r[rows], config.nft.beta)
                loss = loss * len(rows) / len(trajectories)
                step_loss += loss.item()
                total += loss.item() / config.nft.draws
                if v_reference is None:
                    loss.backward()
                    continue
                # The two terms' gradients apart, so their norms can be logged against each other.
                anchor = config.nft.anchor * anchor_loss(v, v_reference[rows]) * len(rows) / len(trajectories)
                step_loss += anchor.item()
                total += anchor.item() / config.nft.draws
                policy_grads = _accumulated(
                    policy_grads,
                    torch.autograd.grad(loss, parameters, retain_graph=True, materialize_grads=True),
                )
                anchor_grads = _accumulated(
                    anchor_grads, torch.autograd.grad(anchor, parameters, materialize_grads=True)
                )
            if v_reference is not None:
                for parameter, policy_grad, anchor_grad in zip(
                    parameters, policy_grads, anchor_grads, strict=True
                ):
                    parameter.grad = policy_grad + anchor_grad
                self.grad_norms["policy"] += _norm(policy_grads) / config.nft.draws
                self.grad_norms["anchor"] += _norm(anchor_grads) / config.nft.draws
            self.trainer.optimizer_step(step_loss)
        if self.old is not None:
            self.old.update(parameters, ramped_decay(iteration, config.nft.old_decay, config.nft.old_ramp))
        return total

    def metrics(self, rollout: "Rollout") -> dict:
        """Also, with ``--nft-anchor``, the gradient norms of the policy term and of the weighted anchor
        term (means over the draws, before clipping)."""
        row = super().metrics(rollout)
        if self.config.nft.anchor > 0:
            row["policy_grad_norm"], row["anchor_grad_norm"] = (
                self.grad_norms["policy"],
                self.grad_norms["anchor"],
            )
        return row


def _accumulated(total: tuple | None, grads: tuple) -> tuple:
    return grads if total is None else tuple(a + b for a, b in zip(total, grads, strict=True))


def _norm(grads: tuple) -> float:
    return torch.sqrt(sum(grad.double().pow(2).sum() for grad in grads)).item()
