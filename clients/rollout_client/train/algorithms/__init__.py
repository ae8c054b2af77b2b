"""The training algorithms, registered by name (see ``base``)."""

from rollout_client.train.algorithms import flowgrpo, nft, tree  # noqa: F401 - each registers itself
from rollout_client.train.algorithms.base import ALGORITHMS, Algorithm, register


def algorithm_name(args) -> str:
    """The registered algorithm a run trains with: --algorithm, whose FlowGRPO is the tree variant
    with --tree."""
    return "tree" if args.tree else args.algorithm


__all__ = ["ALGORITHMS", "Algorithm", "algorithm_name", "register"]
