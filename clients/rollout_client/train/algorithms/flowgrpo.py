"""FlowGRPO: a PPO-clipped step on the log-probs of the stochastic steps, with group-standardised
rewards (``rollout_client.grpo``); with ``--score-while-streaming`` each step is scored as it arrives."""

import math
from typing import TYPE_CHECKING

import torch

from rollout_client.grpo import (
    clipped_policy_loss,
    group_advantages,
    guarded_policy_loss,
    kl_to_reference,
    micro_batches,
    row_batches,
    step_transitions,
    tree_edges,
)
from rollout_client.train.algorithms.base import Algorithm, register
from rollout_client.train.averages import base_model
from rollout_client.train.rollouts import Rollout, stochastic_steps

if TYPE_CHECKING:
    from rollout_client import Collector, Step, Trajectory
    from rollout_client.train.config import TrainConfig


class PolicyUpdate:
    """One clipped policy step, accumulated piece by piece ((step, rows) micro-batches).

    A piece scored before the advantages are known (while the rollout still streams) keeps its graph
    until ``finish``; once they are known, each piece is backpropagated at once, so memory is bounded
    by one micro-batch."""

    def __init__(self, transformer: torch.nn.Module, config: "TrainConfig"):
        self.transformer, self.config = transformer, config
        self.pending: list[tuple[int, list[int], tuple]] = []  # (step, rows, (transition, reference))
        self.scored_steps: set[int] = set()
        self.weight = 0.0  # of one row at one step in the loss, once the rollout is complete
        self.loss = self.kl = self.ratio_max_dev = 0.0

    def score_ready(self, collector: "Collector") -> None:
        """Score the steps that have fully arrived and are not scored yet (advantages unknown)."""
        steps = [i for i in stochastic_steps(collector) if i not in self.scored_steps and collector.ready(i)]
        if not steps:
            return
        trajectories = collector.trajectories()
        for i, rows in micro_batches(trajectories, steps, self.config.optim.micro_batch):
            self.pending.append((i, rows, self._score(trajectories, i, rows)))
        self.scored_steps.update(steps)

    def finish(self, collector: "Collector", advantages: torch.Tensor) -> None:
        """Backpropagate every scored step with the per-sample advantages, scoring the steps not
        scored yet."""
        steps, trajectories = stochastic_steps(collector), collector.trajectories()
        self.weight = 1.0 / (len(steps) * len(trajectories))  # the loss is a mean over steps and samples
        for i, rows, scored in self.pending:
            self._backward(trajectories, advantages[rows], i, rows, scored)
        todo = [i for i in steps if i not in self.scored_steps]
        for i, rows in micro_batches(trajectories, todo, self.config.optim.micro_batch):
            self._backward(trajectories, advantages[rows], i, rows, self._score(trajectories, i, rows))

    def finish_tree(self, leaves: list["Trajectory"], node_advantages: torch.Tensor) -> None:
        """Backpropagate every edge of the tree once, on a leaf below it, with its node's advantage."""
        edges = tree_edges(leaves)
        self.weight = 1.0 / len(edges)  # the loss is a mean over edges
        for i in sorted({edge.step for edge in edges}):
            at_step = [edge for edge in edges if edge.step == i]
            holders = [leaves[edge.row] for edge in at_step]
            for piece in row_batches(holders, self.config.optim.micro_batch):
                rows = [at_step[k].row for k in piece]
                edge_advantages = node_advantages[[at_step[k].node for k in piece]]
                self._backward(leaves, edge_advantages, i, rows, self._score(leaves, i, rows))

    def _score(self, trajectories, i, rows):
        pieces = [trajectories[r] for r in rows]
        transition = step_transitions(self.transformer, pieces, i, self.config.device)
        reference = None
        if self.config.optim.kl_beta > 0:
            with torch.no_grad(), base_model(self.transformer):
                reference = step_transitions(self.transformer, pieces, i, self.config.device).means
        return transition, reference

    def _backward(self, trajectories, piece_advantages, i, rows, scored) -> None:
        transition, reference = scored
        old = torch.stack([trajectories[r].log_probs[i] for r in rows]).to(transition.log_probs.device)
        ratio = torch.exp(transition.log_probs.detach() - old)
        self.ratio_max_dev = max(self.ratio_max_dev, (ratio - 1).abs().max().item())
        piece_advantages = piece_advantages.to(old.device)
        if self.config.optim.grpo_guard:
            loss = self._guarded_loss([trajectories[r] for r in rows], i, transition, old, piece_advantages)
        else:
            loss = clipped_policy_loss(transition.log_probs, old, piece_advantages, self.config.clip_range)
        if reference is not None:
            kl = kl_to_reference(transition.means, reference, transition.stds).mean()
            self.kl += kl.item() * len(rows) * self.weight
            loss = loss + self.config.optim.kl_beta * kl
        (loss * len(rows) * self.weight).backward()
        self.loss += loss.item() * len(rows) * self.weight

    def _guarded_loss(self, pieces, i, transition, old, piece_advantages) -> torch.Tensor:
        if not all(t.log_prob_constants for t in pieces):
            raise ValueError(
                "--grpo-guard needs the Gaussian log-density: the server streams log-probs without constants"
            )
        dts = torch.stack([t.sigmas[i] - t.sigmas[i + 1] for t in pieces]).float().to(old.device)
        # Sync mode: the weights are the rollout's until this iteration's optimizer step, so the rollout
        # policy's step means are the trainer's, detached (as equal as the ratio's ratio_max_dev says).
        old_means = transition.means.detach()
        return guarded_policy_loss(
            transition.log_probs,
            old,
            transition.means,
            old_means,
            transition.stds,
            dts,
            piece_advantages,
            self.config.clip_range,
        )


@register("flowgrpo")
class FlowGRPO(Algorithm):
    def start(self) -> None:
        self.policy_update = PolicyUpdate(self.trainer.transformer, self.config)

    def on_step(self, rollout: Rollout, step: "Step") -> None:
        if self.config.rollout.score_while_streaming:
            self.policy_update.score_ready(rollout.collector)

    def advantages(self, trajectories: list["Trajectory"], rewards: torch.Tensor) -> torch.Tensor:
        """Each sample's advantage: its reward standardised within its prompt's group."""
        return group_advantages(rewards, torch.tensor([t.prompt_index for t in trajectories]))

    def update(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> float:
        trajectories = rollout.trajectories
        self.trainer.zero_grad()
        self.policy_update.finish(rollout.collector, self.advantages(trajectories, rewards))
        self.trainer.optimizer_step(self.policy_update.loss)
        return self.policy_update.loss

    @property
    def ratio_max_dev(self) -> float:
        return self.policy_update.ratio_max_dev

    def metrics(self, rollout: Rollout) -> dict:
        return {
            **super().metrics(rollout),
            "kl": self.policy_update.kl if self.config.optim.kl_beta > 0 else math.nan,
            "scored_steps": " ".join(map(str, stochastic_steps(rollout.collector))),
            "pruned_leaves": 0,
        }
