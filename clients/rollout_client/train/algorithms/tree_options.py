"""The tree rollouts' options (``config.tree``; registered with ``TreeGRPO``): the branch points, the
stochastic steps, the advantages, and ``--prune-at``'s early termination."""

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

from rollout_client.train.options import ConfigError, Options, at_least, option, parses
from rollout_client.train.rollouts import branch_points

if TYPE_CHECKING:
    from rollout_client.train.config import TrainConfig

TREE_ADVANTAGES = ("branch-mean", "branch-log-prob", "backed-up")  # the first is the default
TREE_SDE = ("all", "forks")  # --tree-sde; the first is the default
DEFAULT_PRUNE_KEEP = 4


@dataclasses.dataclass
class TreeConfig(Options):
    """Tree rollouts (BranchGRPO, TreeGRPO)

    ``config.tree``; ``points`` "" samples flat groups."""

    KEY: ClassVar[str] = "tree"

    points: str = option(
        "",
        "tree rollouts: branch points step:factor[:noise_level], comma-separated (e.g. 0:2,3:2,6:2)",
        flag="--tree",
        rule=parses(branch_points),
    )
    sde: str = option(
        TREE_SDE[0],
        "with --tree: every step stochastic, or only the branch steps (the others deterministic: "
        "a prompt's leaves differ only where they fork)",
        flag="--tree-sde",
        choices=TREE_SDE,
    )
    prune_at: int | None = option(
        None,
        "with --tree: when this step arrives, prune each prompt's middle nodes by predicted reward",
        rule=at_least(0),
    )
    prune_keep: int | None = option(
        None,
        "with --prune-at: the nodes each prompt keeps there, the best half and the worst half "
        f"(default {DEFAULT_PRUNE_KEEP})",
        rule=at_least(2, " (a prompt's advantages compare at least two of its nodes)"),
    )
    advantages: str | None = option(
        None,
        "with --tree: BranchGRPO's fused rewards (mean or log-prob weighted), or TreeGRPO's backed-up "
        f"(default {TREE_ADVANTAGES[0]})",
        flag="--tree-advantages",
        choices=TREE_ADVANTAGES,
    )

    @property
    def keep(self) -> int:
        """The nodes each prompt keeps at ``prune_at``."""
        return DEFAULT_PRUNE_KEEP if self.prune_keep is None else self.prune_keep

    @property
    def advantage_rule(self) -> str:
        return self.advantages or TREE_ADVANTAGES[0]

    def leaves_per_root(self) -> int:
        return math.prod(branch.factor for branch in branch_points(self.points))

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"prune_keep": self.keep, "tree_advantages": self.advantage_rule}

    def check(self) -> None:
        branches = branch_points(self.points)
        problem = None
        if any(branch.factor < 1 for branch in branches):
            problem = "--tree: every branch step must be in [0, --steps), every factor at least 1"
        elif not self.points and self.advantages is not None:
            problem = "--tree-advantages scores the nodes of a tree: it needs --tree"
        elif self.prune_keep is not None and self.prune_at is None:
            problem = "--prune-keep is what --prune-at keeps: it needs --prune-at"
        elif self.prune_at is not None and not any(branch.factor > 1 for branch in branches):
            problem = "--prune-at prunes a tree: it needs --tree, with a factor above 1"
        elif not self.points and self.sde != TREE_SDE[0]:
            problem = "--tree-sde picks a tree's stochastic steps: it needs --tree"
        if problem:
            raise ConfigError(problem)

    def conflict(self, config: "TrainConfig", world: int) -> str | None:
        """The branch steps inside the run's steps; one trainer rank; and a prune that prunes something,
        in time: after the tree's first fork (the roots before it are whole groups), before the last
        step (the prune stops nodes at the next one), keeping fewer nodes than a prompt has there."""
        steps, branches = config.rollout.steps, branch_points(self.points)
        if any(not 0 <= branch.step < steps for branch in branches):
            return "--tree: every branch step must be in [0, --steps), every factor at least 1"
        if world > 1 and (flags := self.flags_set("points", "prune_at")):
            return f"{flags[0]} runs on one trainer rank, not {world}"
        if self.prune_at is None:
            return None
        at, forks = self.prune_at, [branch.step for branch in branches if branch.factor > 1]
        if config.rollout.async_:
            return "--prune-at prunes as the rollout streams to the trainer: it needs sync mode"
        if at < forks[0]:
            return f"--prune-at {at} is before --tree's first fork at step {forks[0]}: only roots are there"
        if at >= steps - 1:
            return f"--prune-at must be below --steps - 1 ({steps - 1}): its prune stops the next step"
        nodes = config.rollout.group_size * math.prod(b.factor for b in branches if b.step <= at)
        if self.keep >= nodes:
            return (
                f"--prune-keep {self.keep} prunes nothing: a prompt has {nodes} nodes at step {at} "
                "(--group-size times --tree's factors up to it)"
            )
        return None
