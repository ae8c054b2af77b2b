"""Step-GRPO (DRM's dense per-step credit) on tree rollouts: each node of ``--tree``'s forks is rewarded
on the state it reaches, the reward of the preview (the server's decoded x0_hat) at its own next branch
step, or its final image for a leaf; its advantage standardises that reward among its siblings, the
children of one parent (``rollout_client.grpo.step_grpo_advantages``), and every edge trains with its
own node's advantage through FlowGRPO's clipped loss on the tree (``PolicyUpdate.finish_tree``)."""

from typing import TYPE_CHECKING

import torch

from rollout_client.grpo import step_grpo_advantages
from rollout_client.preview_rewards import score_previews
from rollout_client.train.algorithms.base import register
from rollout_client.train.algorithms.tree import TreeGRPO
from rollout_client.train.metrics import step_reward_column
from rollout_client.train.rewards import Rewards
from rollout_client.train.rollouts import Rollout, branch_points

if TYPE_CHECKING:
    from rollout_client import Step
    from rollout_client.train.config import TrainConfig


@register("step-grpo")
class StepGRPO(TreeGRPO):
    """``--algorithm step-grpo --tree ...``: the previews of every branch step after 0 are requested, so
    each node that forks has a preview at the end of its span, and scored with the run's reward as
    they arrive (after the stream with --async). ``node_advantages`` holds the last update's node
    advantages (float32 [nodes], NaN at a node with no transition of its own)."""

    @classmethod
    def refusal(cls, config: "TrainConfig", world: int) -> str | None:
        if not any(branch.factor > 1 for branch in branch_points(config.tree.points)):
            return (
                "--algorithm step-grpo compares the siblings of a fork: it needs --tree, with a factor "
                "above 1"
            )
        problem = super().refusal(config, world)
        if problem:
            return problem
        if config.tree.advantages is not None:
            return (
                "--tree-advantages is --tree's rule: --algorithm step-grpo standardises each node's "
                "step reward among its siblings"
            )
        if config.tree.prune_at is not None:
            return "--prune-at does not go with --algorithm step-grpo: each node is rewarded at its own end"
        return None

    @classmethod
    def preview_steps(cls, config: "TrainConfig") -> list[int]:
        """Every branch step above 0: the end of each node that forks (a root's, before the first fork,
        and each child's that forks again)."""
        return sorted({branch.step for branch in branch_points(config.tree.points) if branch.step > 0})

    def __init__(self, trainer):
        super().__init__(trainer)
        # A reward of its own: the trainer's keeps the terms of its call on the final images.
        self.preview_reward = Rewards(self.config.reward)
        self.node_advantages: torch.Tensor | None = None

    def on_step(self, rollout: Rollout, step: "Step") -> None:
        """Score the previews of the step (called once they have all arrived)."""
        if step.index in rollout.collector.previewed:
            score_previews(rollout.collector, self.preview_reward)

    def update(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> float:
        collector, leaves = rollout.collector, rollout.trajectories
        score_previews(collector, self.preview_reward)  # what --async's stream left unscored
        leaf_rewards = dict(zip([leaf.sample_index for leaf in leaves], rewards.tolist(), strict=True))
        self.node_advantages = step_grpo_advantages(collector.tree, collector.step_rewards, leaf_rewards)
        self.trainer.zero_grad()
        self.policy_update.finish_tree(leaves, self.node_advantages)
        self.trainer.optimizer_step(self.policy_update.loss)
        return self.policy_update.loss

    def metrics(self, rollout: Rollout) -> dict:
        """Also each preview step's mean reward over the distinct states previewed there."""
        collector, row = rollout.collector, super().metrics(rollout)
        for step, by_node in collector.step_rewards.items():
            by_state = {collector.tree.owner(node, step).id: value for node, value in by_node.items()}
            row[step_reward_column(step)] = sum(by_state.values()) / len(by_state)
        return row

    def columns(self) -> list[str]:
        return [step_reward_column(step) for step in self.preview_steps(self.config)]
