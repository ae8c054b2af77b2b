"""Tree rollouts: which nodes a branched request grows, what each one owns, and what it costs.

A request's ``branches`` are global branch points ``(step, factor)``, strictly increasing in step.
Every root (one per sample, with the sample's seed) runs from x_0; at branch step ``b`` each node
alive there forks into ``factor`` children. The node's forward at step b runs once, and each child
draws its own eps of step b, and of every later step, from its own seed (``noise.child_seed``). So:

* a node spans the transitions ``start_step <= i < end_step``: a root starts at 0, a child at its
  branch step, and a node ends at the next branch step (a leaf at T);
* a node owns the latents it produces, x_{start_step + 1} .. x_{end_step}, and a root also x_0;
* a leaf's trajectory is the path root -> leaf: x_j comes from the path's node that owns it, so
  siblings share every latent up to their branch step, bitwise;
* the forward at step i runs once per distinct x_i, i.e. once per node that owns x_i: the tree's
  transformer rows are ``sum_i owners(i) x branches`` (``branches`` = 2 with true CFG, else 1),
  against ``T x leaves x branches`` for a flat rollout of as many samples.

Nodes are numbered breadth first: the roots are 0 .. R - 1 (node k is sample k, as in a flat
rollout), then the children of each depth in their parents' order. A tree whose factors are all 1
has only roots, and its rollout is the flat one bitwise (child 0 keeps its parent's seed).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollout.v1 import rollout_pb2
from rollout_core.noise import child_seed

NO_PARENT = -1
# A node's fields that RolloutStarted.tree lists (TreeNode).
_LISTED = ("id", "parent", "start_step", "end_step", "seed", "root", "prompt_index")


@dataclass(frozen=True)
class Node:
    """One node of a rollout tree."""

    id: int
    parent: int  # NO_PARENT for a root
    start_step: int  # its first transition (a root: 0)
    end_step: int  # one past its last transition: the next branch step, or T for a leaf
    seed: int  # the seed its eps are drawn from (a root: its sample's)
    root: int  # the root sample it descends from
    prompt_index: int
    depth: int = 0  # 0 for a root
    children: tuple[int, ...] = ()

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def first_latent(self) -> int:
        """The first latent it owns: x_0 for a root, else the output of its first step."""
        return 0 if self.parent == NO_PARENT else self.start_step + 1

    def owns(self, j: int) -> bool:
        """Whether latent x_j is this node's."""
        return self.first_latent <= j <= self.end_step


@dataclass(frozen=True)
class Tree:
    """The nodes of one rollout, in id order (see the module docstring)."""

    nodes: tuple[Node, ...]
    num_steps: int
    branch_steps: tuple[int, ...] = ()

    @classmethod
    def grow(
        cls,
        seeds: Sequence[int],
        prompt_indices: Sequence[int],
        branches: Iterable[tuple[int, int]],
        num_steps: int,
    ) -> "Tree":
        """The tree of a request with per-sample ``seeds`` and ``branches`` as (step, factor) pairs,
        checked beforehand (strictly increasing steps in [0, num_steps), factors >= 1)."""
        branches = [(step, factor) for step, factor in branches if factor > 1]
        steps = [step for step, _ in branches]
        ends = [*steps, num_steps]
        nodes = [
            dict(id=k, parent=NO_PARENT, start_step=0, end_step=ends[0], seed=seed, root=k, prompt_index=p)
            for k, (seed, p) in enumerate(zip(seeds, prompt_indices, strict=True))
        ]
        frontier = list(range(len(nodes)))
        for depth, (step, factor) in enumerate(branches, start=1):
            children = []
            for parent_id in frontier:
                parent = nodes[parent_id]
                ids = list(range(len(nodes), len(nodes) + factor))
                parent["children"] = tuple(ids)
                for c, node_id in enumerate(ids):
                    nodes.append(
                        dict(
                            id=node_id,
                            parent=parent_id,
                            start_step=step,
                            end_step=ends[depth],
                            seed=child_seed(parent["seed"], step, c),
                            root=parent["root"],
                            prompt_index=parent["prompt_index"],
                            depth=depth,
                        )
                    )
                children.extend(ids)
            frontier = children
        return cls(tuple(Node(**node) for node in nodes), num_steps, tuple(steps))

    @classmethod
    def from_proto(cls, nodes: Sequence, num_steps: int) -> "Tree":
        """The tree a started event lists (``RolloutStarted.tree``: TreeNode messages by id)."""
        children: dict[int, list[int]] = {node.id: [] for node in nodes}
        depth: dict[int, int] = {}
        for node in nodes:  # parents come before their children
            if node.parent != NO_PARENT:
                children[node.parent].append(node.id)
            depth[node.id] = 0 if node.parent == NO_PARENT else depth[node.parent] + 1
        tree = tuple(
            Node(
                **{name: getattr(node, name) for name in _LISTED},
                depth=depth[node.id],
                children=tuple(children[node.id]),
            )
            for node in nodes
        )
        branch_steps = sorted({node.start_step for node in tree if node.parent != NO_PARENT})
        return cls(tree, num_steps, tuple(branch_steps))

    def to_proto(self) -> list[rollout_pb2.TreeNode]:
        """The nodes as ``RolloutStarted.tree`` lists them (TreeNode messages, by id)."""
        return [
            rollout_pb2.TreeNode(**{name: getattr(node, name) for name in _LISTED}) for node in self.nodes
        ]

    @staticmethod
    def size(samples: int, factors: Iterable[int]) -> tuple[int, int]:
        """(nodes, leaves) of a tree of ``samples`` roots with these branch factors, without growing it."""
        nodes = width = samples
        for factor in factors:
            width *= factor
            nodes += width if factor > 1 else 0
        return nodes, width

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    @property
    def roots(self) -> list[Node]:
        return [node for node in self.nodes if node.parent == NO_PARENT]

    @property
    def leaves(self) -> list[Node]:
        return [node for node in self.nodes if node.is_leaf]

    def path(self, node_id: int) -> list[Node]:
        """The nodes from the root down to ``node_id``."""
        path = [self.nodes[node_id]]
        while path[-1].parent != NO_PARENT:
            path.append(self.nodes[path[-1].parent])
        return path[::-1]

    def descendants(self, node_id: int) -> list[Node]:
        """``node_id``'s node and every node below it."""
        found, stack = [], [node_id]
        while stack:
            node = self.nodes[stack.pop()]
            found.append(node)
            stack.extend(node.children)
        return found

    def pruned_by(self, nodes: Iterable[int], pruned: Iterable[int] = ()) -> set[int]:
        """What a prune of ``nodes`` stops, after the ``pruned`` ones: those nodes, every node below
        them, and every node left with no leaf that is not stopped (so no node forks into nothing)."""
        stopped = set(pruned)
        for node_id in nodes:
            if node_id not in stopped:  # else its descendants are stopped already
                stopped.update(node.id for node in self.descendants(node_id))
        for node in reversed(self.nodes):  # children before parents
            if node.children and all(child in stopped for child in node.children):
                stopped.add(node.id)
        return stopped

    def leaves_under(self, node_id: int) -> list[Node]:
        return [node for node in self.descendants(node_id) if node.is_leaf]

    def owner(self, node_id: int, j: int) -> Node:
        """The node of ``node_id``'s path (its own, or an ancestor) that owns x_j."""
        return next(node for node in self.path(node_id) if node.owns(j))

    def owners(self, j: int) -> list[Node]:
        """The nodes that own x_j: the rows of step j's forward."""
        return [node for node in self.nodes if node.owns(j)]

    def edges(self) -> list[tuple[int, int]]:
        """Every transition once, as (node id, step i): x_i -> x_{i+1} of that node."""
        return [(node.id, i) for node in self.nodes for i in range(node.start_step, node.end_step)]

    def transformer_rows(self, branches: int = 1) -> int:
        """Transformer rows of the whole rollout: one per owner of x_i, per step, per CFG branch."""
        return branches * sum(len(self.owners(i)) for i in range(self.num_steps))

    def flat_rows(self, branches: int = 1) -> int:
        """Transformer rows of a flat rollout of as many samples as the tree has leaves."""
        return branches * self.num_steps * len(self.leaves)


def widest(request) -> int:
    """The most rows a RolloutRequest's rollout holds at once: its leaves (a flat one's samples)."""
    return Tree.size(len(request.seeds), [branch.factor for branch in request.branches])[1]
