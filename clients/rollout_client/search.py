"""Step-wise search: greedy best-of-K at chosen steps of a rollout, on one tree request whose holds and
prunes leave a single path per sample (DRM's step-wise sampling, with a reward read on previews).

For chosen steps s_1 < ... < s_m the request branches K ways at each (``branches``): every node alive
at s forks into K children, each drawing its own noise of step s and after. A child's first state of
its own is x_{s+1}, so its preview at step s + 1 (``preview_steps``: the server's decode of
x0_hat = x_{s+1} - sigma_{s+1} v_{s+1}) is what the reward scores, and s + 1 is a prune point: the
server holds the rollout after step s + 1 until the client has pruned, per sample, every child but the
best of its K (ties: the lowest node id). The pruned children stop at step s + 2, so a decision costs
K - 1 extra transformer rows of step s + 1 per sample (times the CFG branches), and each chosen step's
K children are the K successors of the one path kept so far.

A chosen step with s + 1 >= T - 1 has no prune point (no step follows T - 1): such late steps are
decided together at the end, where the best final image among the sample's leaves is kept.

The tree is admitted at its full width, samples x K^m leaves (``limits.max_running_samples``) and
its nodes (``limits.max_tree_nodes``), although the prunes keep K rows a sample running: so m is small
(``fitting_steps``). With K = 1 the tree has its roots alone and the rollout is plain sampling's,
bitwise (a tree whose factors are 1 is the flat rollout; previews and holds change no number).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_client.events import Event, Finished, Preview, Step
from rollout_client.preview_rewards import score_previews
from rollout_client.trajectory import Collector, Trajectory
from rollout_core.tree import Tree

if TYPE_CHECKING:
    from rollout_client.client import RolloutClient
    from rollout_client.rewards import Reward


@dataclass(frozen=True)
class Decision:
    """One sample's choice: at ``step``'s previews (or, with ``step`` = T, among its final images)
    ``candidates`` scored ``rewards``, and ``kept`` goes on."""

    step: int
    sample: int  # the root
    candidates: tuple[int, ...]
    rewards: tuple[float, ...]
    kept: int


@dataclass
class SearchResult:
    """A search's stream and what it chose. ``trajectories``: the kept leaf of each sample, in sample
    order. ``forwards``: the transformer rows the search took, counted from the streamed steps (per
    step, each distinct x_i of its rows, times the CFG branches), which the server's
    ``finished.transformer_rows`` confirms; ``plain_forwards``: what plain sampling of the same
    samples takes, T x samples x CFG branches."""

    request: rollout_pb2.RolloutRequest
    collector: Collector
    events: list[Event]
    trajectories: list[Trajectory]
    decisions: list[Decision] = field(default_factory=list)
    forwards: int = 0
    plain_forwards: int = 0

    def summary(self) -> dict:
        """The search as JSON values: its K, steps, decisions and forwards."""
        branches = self.request.branches
        return {
            "k": branches[0].factor if branches else 1,
            "steps": [branch.step for branch in branches],
            "forwards": self.forwards,
            "plain_forwards": self.plain_forwards,
            "kept": [t.sample_index for t in self.trajectories],
            "decisions": [
                {
                    "step": d.step,
                    "sample": d.sample,
                    "candidates": list(d.candidates),
                    "rewards": list(d.rewards),
                    "kept": d.kept,
                }
                for d in self.decisions
            ],
        }


def fitting_steps(k: int, samples: int, num_steps: int, limits: rollout_pb2.Limits) -> list[int]:
    """The earliest steps a search of factor ``k`` over ``samples`` samples can branch at within the
    server's tree limits (all of them below T for k = 1); ValueError when not even one fits."""
    steps: list[int] = []
    while len(steps) < num_steps:
        nodes, leaves = Tree.size(samples, [k] * (len(steps) + 1))
        if leaves > limits.max_running_samples or nodes > limits.max_tree_nodes:
            break
        steps.append(len(steps))
    if not steps:
        raise ValueError(
            f"a search of {k} over {samples} samples does not fit the server's limits "
            f"({limits.max_running_samples} samples at once, {limits.max_tree_nodes} tree nodes)"
        )
    return steps


def decision_steps(steps: Sequence[int], num_steps: int) -> list[int]:
    """The steps whose previews decide and where the rollout is held: s + 1 for each chosen step s
    that leaves a step after it (s + 1 < T - 1)."""
    return [s + 1 for s in steps if s + 1 < num_steps - 1]


def search_request(
    request: rollout_pb2.RolloutRequest, k: int, steps: Sequence[int], num_steps: int
) -> rollout_pb2.RolloutRequest:
    """``request`` branching ``k`` ways at each of ``steps`` (strictly increasing), with previews and
    prune points at their decision steps; ``num_steps`` is the rollout's T (the request's, or the
    server's default). ValueError for a factor below 1 or steps out of order or range."""
    if k < 1:
        raise ValueError(f"a search keeps the best of K >= 1 children, got K = {k}")
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)) or not all(
        0 <= s < num_steps for s in steps
    ):
        raise ValueError(f"search steps must be strictly increasing in [0, {num_steps}), got {list(steps)}")
    if request.branches or request.prune_points:
        raise ValueError("a search builds the tree itself: send a request without branches or prune points")
    searched = rollout_pb2.RolloutRequest()
    searched.CopyFrom(request)
    searched.branches.extend(rollout_pb2.Branch(step=s, factor=k) for s in steps)
    deciding = decision_steps(steps, num_steps)
    searched.prune_points.extend(deciding)
    searched.preview_steps[:] = sorted(set(request.preview_steps) | set(deciding))
    return searched


def _best(candidates: Sequence[int], rewards: Sequence[float]) -> int:
    """The candidate of the highest reward; among equal rewards the lowest node id."""
    return max(zip(rewards, candidates, strict=True), key=lambda pair: (pair[0], -pair[1]))[1]


def step_search(
    client: "RolloutClient",
    request: rollout_pb2.RolloutRequest,
    reward: "Reward",
    k: int,
    steps: Sequence[int] | None = None,
) -> SearchResult:
    """Greedy best-of-``k`` at ``steps`` (default ``fitting_steps``) for each sample of ``request``
    (see the module docstring), scored by ``reward`` on previews and, for the late steps, on the final
    images (their first frames). The request's sampler must be stochastic at ``steps``, as any branch
    step (the server refuses it otherwise)."""
    info = client.server_info()
    num_steps = request.num_steps if request.HasField("num_steps") else info.defaults.num_steps
    if steps is None:
        per_prompt = (
            request.samples_per_prompt
            if request.HasField("samples_per_prompt")
            else info.defaults.samples_per_prompt
        )
        samples = len(request.seeds) or len(request.prompts) * per_prompt
        steps = fitting_steps(k, samples, num_steps, info.limits)
    searched = search_request(request, k, steps, num_steps)
    if k > 1 and len(decision_steps(steps, num_steps)) < len(steps) and not request.images:
        raise ValueError(
            "a search step too late for a prune point is decided on the final images: keep images on"
        )
    deciding = set(decision_steps(steps, num_steps))
    collector = Collector([image.data for image in request.condition_images])
    result = SearchResult(searched, collector, [], [])
    for event in client.stream(searched):
        result.events.append(event)
        collector.add(event)
        if isinstance(event, Step):
            result.forwards += _rows(collector, event)
        elif isinstance(event, Preview) and event.last and event.step in deciding:
            _decide(client, collector, reward, event.step, result)
        elif isinstance(event, Finished):
            cfg_branches = len(collector.started.env)
            result.plain_forwards = num_steps * len(collector.started.message.seeds) * cfg_branches
    if collector.finished is None:
        raise ValueError("incomplete rollout stream: no finished event")
    result.trajectories = _final_choice(collector, reward, result)
    return result


def _rows(collector: Collector, step: Step) -> int:
    """The transformer rows step ``step`` took: one per distinct x_i of its rows (at a branch step the
    children share their parent's), per CFG branch."""
    tree = collector.tree
    if tree is None:  # a flat rollout: every sample, every step
        return len(collector.started.message.seeds) * len(collector.started.env)
    return len({tree.owner(node, step.index).id for node in step.nodes}) * len(collector.started.env)


def _decide(
    client: "RolloutClient", collector: Collector, reward: "Reward", step: int, result: SearchResult
) -> None:
    """At a held decision step: per sample, keep the best-scored state x_step and prune the others; the
    prune (empty when nothing is pruned) lets the rollout go on."""
    tree = collector.tree
    by_row = score_previews(collector, reward, [step])[step]
    value = {tree.owner(node, step).id: reward_value for node, reward_value in by_row.items()}
    pruned = []
    for root in sorted({tree[node].root for node in value}):
        candidates = sorted(node for node in value if tree[node].root == root)
        rewards = [value[node] for node in candidates]
        kept = _best(candidates, rewards)
        result.decisions.append(Decision(step, root, tuple(candidates), tuple(rewards), kept))
        pruned += [node for node in candidates if node != kept]
    client.prune(collector.started, pruned)


def _final_choice(collector: Collector, reward: "Reward", result: SearchResult) -> list[Trajectory]:
    """The kept leaf of each sample: its only one, or the best final image among those left."""
    leaves = collector.trajectories()
    by_root: dict[int, list[Trajectory]] = {}
    for leaf in leaves:
        by_root.setdefault(leaf.node_path[0] if leaf.node_path else leaf.sample_index, []).append(leaf)
    kept = []
    num_steps = len(collector.started.message.stochastic)
    for root, candidates in sorted(by_root.items()):
        if len(candidates) > 1:
            images = [leaf.image() for leaf in candidates]
            rewards = torch.as_tensor(
                reward(images, [leaf.prompt for leaf in candidates]), dtype=torch.float64
            ).tolist()
            ids = [leaf.sample_index for leaf in candidates]
            best = _best(ids, rewards)
            result.decisions.append(Decision(num_steps, root, tuple(ids), tuple(rewards), best))
            candidates = [leaf for leaf in candidates if leaf.sample_index == best]
        kept.append(candidates[0])
    return kept
