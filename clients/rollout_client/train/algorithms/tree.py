"""Tree rollouts (BranchGRPO, TreeGRPO): every edge of each prompt's trees trained once with its node's
advantage, and ``--prune-at``'s early termination of the middle nodes while the tree streams."""

import io
from typing import TYPE_CHECKING

import grpc
import torch
from PIL import Image as PILImage

from rollout_client.grpo import backed_up_advantages, branch_advantages
from rollout_client.train.algorithms.base import register
from rollout_client.train.algorithms.flowgrpo import FlowGRPO
from rollout_client.train.algorithms.tree_options import TreeConfig
from rollout_client.train.rollouts import Rollout, say

if TYPE_CHECKING:
    from rollout_client import RolloutClient, Step, Trajectory
    from rollout_client.rewards import Reward
    from rollout_client.train.config import TrainConfig


def tree_advantages(leaves: list["Trajectory"], rewards: torch.Tensor, rule: str) -> torch.Tensor:
    """The advantage of every node of the leaves' tree, float32 [nodes], by --tree-advantages."""
    tree = leaves[0].tree
    leaf_rewards = {leaf.sample_index: reward for leaf, reward in zip(leaves, rewards.tolist(), strict=True)}
    if rule == "backed-up":
        return backed_up_advantages(tree, leaf_rewards)
    if rule == "branch-mean":
        return branch_advantages(tree, leaf_rewards)
    # Each node's own steps' log-probs, summed: read on a leaf below it.
    own = torch.zeros(len(tree), dtype=torch.float64)
    for leaf in leaves:
        for node_id in leaf.node_path:
            node = tree[node_id]
            own[node_id] = leaf.log_probs[node.start_step : node.end_step].nan_to_num().double().sum()
    return branch_advantages(tree, leaf_rewards, fusion="log_prob", node_log_probs=own)


class EarlyTermination:
    """--prune-at S --prune-keep K on a tree rollout: when step S and its previews have arrived, each
    node that took it is scored by the reward of its preview, the server's decode of its predicted
    final image x0 = x_S - sigma_S v (flow matching's estimate from the step's velocity; the first
    frame of a video). Per prompt, the K / 2 best and K / 2 worst nodes go on (a group's extremes
    carry its advantages) and the others are pruned with their subtrees. The server holds the rollout
    after step S (its prune point, whose previews it sends first) until this answer, which it always
    gets (an empty prune says "none"), so the nodes stop at step S + 1."""

    def __init__(self, client: "RolloutClient", reward: "Reward", config: "TrainConfig"):
        self.client, self.reward, self.step, self.keep = (
            client,
            reward,
            config.tree.prune_at,
            config.tree.keep,
        )

    def prune(self, rollout: Rollout, step: "Step") -> None:
        collector = rollout.collector
        message = collector.started.message
        previews = collector.previews[self.step]
        images = [PILImage.open(io.BytesIO(previews[node][0])) for node in step.nodes]
        prompts = [message.resolved.prompts[collector.tree[node].prompt_index] for node in step.nodes]
        scores = self.reward(images, prompts).tolist()
        pruned = []
        for p in set(collector.tree[node].prompt_index for node in step.nodes):
            ranked = sorted(
                (score, node)
                for node, score in zip(step.nodes, scores, strict=True)
                if collector.tree[node].prompt_index == p
            )
            best = self.keep // 2
            pruned += [node for _, node in ranked[self.keep - best : len(ranked) - best]]
        rollout.prune_asked += len(pruned)
        try:
            answer = self.client.prune(collector.started, sorted(pruned))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            say(
                f"rollout {step.request_id}: the prune at step {self.step} stopped nothing: {error.details()}"
            )
            return
        rollout.prune_stopped += len(set(pruned) & set(answer.nodes))
        if pruned and answer.step != self.step + 1:
            say(f"rollout {step.request_id}: the prune at step {self.step} landed at step {answer.step}")


@register("tree", options=TreeConfig)
class TreeGRPO(FlowGRPO):
    """FlowGRPO's clipped loss on the edges of tree rollouts (``--tree``)."""

    @classmethod
    def refusal(cls, config: "TrainConfig", world: int) -> str | None:
        # Edges are trained once each with their node's advantage: FlowGRPO's clipped loss only, on
        # the whole tree once it has arrived, with every step stochastic.
        flags = config.rollout.flags_set("window", "score_while_streaming")
        if flags:
            return f"{flags[0]} does not go with --tree"
        if config.algorithm in ("nft", "awm"):
            algorithm = config.algorithm
            return f"--tree trains edges with FlowGRPO's loss: it does not go with --algorithm {algorithm}"
        return None

    def __init__(self, trainer):
        super().__init__(trainer)
        config = self.config
        self.early = None
        if config.tree.prune_at is not None:
            self.early = EarlyTermination(trainer.client, trainer.reward, config)

    def on_step(self, rollout: Rollout, step: "Step") -> None:
        if self.early is not None and step.index == self.early.step:
            self.early.prune(rollout, step)

    def update(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> float:
        leaves = rollout.trajectories
        self.trainer.zero_grad()
        advantages = tree_advantages(leaves, rewards, self.config.tree.advantage_rule)
        self.policy_update.finish_tree(leaves, advantages)
        self.trainer.optimizer_step(self.policy_update.loss)
        return self.policy_update.loss

    def metrics(self, rollout: Rollout) -> dict:
        collector = rollout.collector
        pruned = sum(leaf.id in collector.pruned for leaf in collector.tree.leaves)
        return {**super().metrics(rollout), "pruned_leaves": pruned}
