"""The training algorithms, registered by name (see ``base``)."""

from rollout_client.train.algorithms import awm, flowgrpo, nft, step_grpo, tree  # noqa: F401 - each registers itself
from rollout_client.train.algorithms.base import ALGORITHMS, OPTIONS, Algorithm, register


def algorithm_name(tree_points: str, algorithm: str) -> str:
    """The registered algorithm a run trains with: ``algorithm`` (--algorithm), the tree variant when
    ``tree_points`` (--tree) names branch points, except Step-GRPO's, which trains on trees itself."""
    return "tree" if tree_points and algorithm != "step-grpo" else algorithm


__all__ = ["ALGORITHMS", "OPTIONS", "Algorithm", "algorithm_name", "register"]
