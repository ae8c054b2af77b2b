"""A tree rollout's branch points and prune points, and the steps whose previews are streamed: each
counted before any is read, and the tree bounded before anything grows."""

from typing import TYPE_CHECKING

from rollout.v1 import rollout_pb2
from rollout_core import steps
from rollout_core.tree import Tree
from rollout_server.validation.context import Problems, finite_in
from rollout_server.validation.schedule import MIN_NOISE_LEVEL

if TYPE_CHECKING:
    from rollout_server.limits import Limits


def tree_problems(
    request: rollout_pb2.RolloutRequest, resolved: rollout_pb2.RolloutRequest, limits: "Limits"
) -> Problems:
    """The branch points (taken into ``resolved``), the prune points and the preview steps."""
    bad = _branch_problems(request, resolved, limits)
    resolved.branches.extend(request.branches)
    bad += _prune_point_problems(request, resolved.num_steps, limits)
    return bad + _preview_step_problems(request, resolved.num_steps, limits)


def _branch_problems(
    request: rollout_pb2.RolloutRequest, resolved: rollout_pb2.RolloutRequest, limits: "Limits"
) -> Problems:
    """The problems of a tree request's branch points: steps in range and strictly increasing,
    factors at least 1, and a tree within the node and width limits (that a forking step draws
    noise needs the schedule: ``Runner.prepare`` checks it). Counted before anything grows: a
    request of huge factors costs no more than a small one."""
    branches = list(request.branches)
    if not branches:
        return []
    if len(branches) > limits.max_steps:
        return [("branches", f"{len(branches)} branch points exceed {limits.max_steps} steps")]
    bad = []
    num_steps = resolved.num_steps
    sampler = steps.SAMPLERS_BY_ENUM.get(resolved.sampler)
    for k, branch in enumerate(branches):
        if branch.step >= num_steps:
            bad.append((f"branches[{k}].step", f"must be < num_steps ({num_steps}), got {branch.step}"))
        elif k and branch.step <= branches[k - 1].step:
            bad.append((f"branches[{k}].step", "branch steps must be strictly increasing"))
        if branch.factor < 1:
            bad.append((f"branches[{k}].factor", "must be at least 1"))
        if branch.HasField("noise_level") and sampler is not None:
            level = branch.noise_level
            if not finite_in(level, MIN_NOISE_LEVEL, sampler.max_noise_level):
                bad.append(
                    (
                        f"branches[{k}].noise_level",
                        f"must be in [{MIN_NOISE_LEVEL}, {sampler.max_noise_level}] for {sampler.name}, "
                        f"got {level}",
                    )
                )
    if bad or not resolved.seeds:
        return bad
    # At most max_steps factors below 2^32: exact integers, computed at once.
    nodes, leaves = Tree.size(len(resolved.seeds), [branch.factor for branch in branches])
    if leaves > limits.max_running_samples:
        bad.append(("branches", f"{leaves} leaves: above {limits.max_running_samples} samples at once"))
    if nodes > limits.max_tree_nodes:
        bad.append(("branches", f"{nodes} nodes: the tree is above {limits.max_tree_nodes} nodes"))
    return bad


def _prune_point_problems(request: rollout_pb2.RolloutRequest, num_steps: int, limits: "Limits") -> Problems:
    """The steps a tree rollout is held at for its caller's prune: only a tree is pruned, and a hold
    after step s serves a prune at step s + 1, which must exist. Counted before any is read."""
    count = len(request.prune_points)
    if not count:
        return []
    if not request.branches:
        return [("prune_points", "only a tree rollout (one with branches) can be pruned")]
    if count > limits.max_steps:
        return [("prune_points", f"{count} prune points exceed {limits.max_steps} steps")]
    points, bad = list(request.prune_points), []
    for k, point in enumerate(points):
        if point >= num_steps - 1:
            bad.append(
                (f"prune_points[{k}]", f"must be < num_steps - 1 ({num_steps - 1}): no step follows {point}")
            )
        elif k and point <= points[k - 1]:
            bad.append((f"prune_points[{k}]", "prune points must be strictly increasing"))
    return bad


def _preview_step_problems(request: rollout_pb2.RolloutRequest, num_steps: int, limits: "Limits") -> Problems:
    """The steps whose x0_hat is decoded and streamed: distinct steps of the rollout, in any order.
    Counted before any is read: each costs a decode of every row."""
    count = len(request.preview_steps)
    if count > min(num_steps, limits.max_steps):
        return [("preview_steps", f"{count} preview steps exceed the {num_steps} steps of the rollout")]
    bad, seen = [], set()
    for k, step in enumerate(request.preview_steps):
        if step >= num_steps:
            bad.append((f"preview_steps[{k}]", f"must be < num_steps ({num_steps}), got {step}"))
        elif step in seen:
            bad.append((f"preview_steps[{k}]", f"step {step} is listed twice"))
        seen.add(step)
    return bad
