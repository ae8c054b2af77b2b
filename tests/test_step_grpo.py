"""Step-GRPO's advantages and loss on hand-built trees, against an independent float64 NumPy reference
that works on a bare list of (parent, start, end) spans: each node rewarded on its own next state
(its own preview, its children's rows at a branch step, or its leaf reward), standardised among its
siblings (K = 2 and K = 3, a tied group among them), and FlowGRPO's clipped loss over the edges."""

import numpy as np
import pytest
import torch

from rollout_client.grpo import (
    clipped_policy_loss,
    edge_advantages,
    group_advantages,
    step_grpo_advantages,
    step_rewards,
)
from rollout_core.tree import Tree

EPS = 1e-4
UNIT_ROUNDOFF = 2.0**-24  # float32
STEPS = 6
# Two samples of one prompt; each root forks in 2 at step 1, each child in 3 at step 3: roots 0-1 span
# [0, 1), nodes 2-5 span [1, 3), leaves 6-17 span [3, 6).
BRANCHES = [(1, 2), (3, 3)]


def hand_tree() -> Tree:
    return Tree.grow(seeds=[5, 9], prompt_indices=[0, 0], branches=BRANCHES, num_steps=STEPS)


def spans(tree: Tree) -> list[tuple[int, int, int]]:
    """(parent, start, end) per node: all the reference reads of the tree."""
    return [(node.parent, node.start_step, node.end_step) for node in tree.nodes]


def reference_rewards(spans, prompts, previews: dict, leaves: dict) -> np.ndarray:
    """R(n): the first preview step p in (start, end] (its own row for p < end, else a child's), else
    its leaf reward; a node without transitions has none."""
    children = {i: [j for j, (parent, _, _) in enumerate(spans) if parent == i] for i in range(len(spans))}
    out = np.full(len(spans), np.nan)
    for n, (_, start, end) in enumerate(spans):
        if end == start:
            continue
        steps = [p for p in sorted(previews) if start < p <= end]
        if steps:
            rows = [n] if steps[0] < end else children[n]
            values = [previews[steps[0]][row] for row in rows if row in previews[steps[0]]]
            out[n] = values[0] if values else np.nan
        else:
            out[n] = leaves.get(n, np.nan)
    return out


def reference_advantages(spans, prompts, rewards: np.ndarray) -> np.ndarray:
    out = np.full(len(spans), np.nan)
    groups: dict = {}
    for n, (parent, _, _) in enumerate(spans):
        if not np.isnan(rewards[n]):
            groups.setdefault(("root", prompts[n]) if parent < 0 else parent, []).append(n)
    for members in groups.values():
        r = rewards[members]
        out[members] = (r - r.mean()) / (r.std() + EPS)
    return out


def random_rewards(tree: Tree, preview_steps: list[int], seed: int) -> tuple[dict, dict]:
    """Preview rewards per (step, row that took it) and leaf rewards, drawn from a seeded generator;
    children at a branch step carry their parent's (the server previews their shared x_i)."""
    generator = np.random.default_rng(seed)
    previews = {}
    for p in preview_steps:
        by_state = {}
        for node in tree.nodes:
            if node.start_step <= p < node.end_step:
                state = tree.owner(node.id, p).id
                by_state.setdefault(state, float(generator.normal()))
                previews.setdefault(p, {})[node.id] = by_state[state]
    leaves = {leaf.id: float(generator.normal()) for leaf in tree.leaves}
    return previews, leaves


def assert_close_to_float32(actual: torch.Tensor, expected: np.ndarray) -> None:
    """The float64 computation rounded once to float32: within one unit in its last place, NaN alike."""
    actual = actual.double().numpy()
    assert np.array_equal(np.isnan(actual), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=2 * UNIT_ROUNDOFF, atol=0)


@pytest.mark.parametrize("preview_steps", [[1, 3], [1, 2, 4], [2, 4]], ids=["at-branches", "own", "late"])
def test_step_advantages_match_the_reference(preview_steps):
    tree = hand_tree()
    previews, leaves = random_rewards(tree, preview_steps, seed=len(preview_steps))
    prompts = [node.prompt_index for node in tree.nodes]
    if preview_steps == [2, 4]:  # the roots' span (0, 1] has no preview: a configuration error
        with pytest.raises(ValueError, match=r"node 0 spans steps 0 to 1 with no preview step in \(0, 1\]"):
            step_rewards(tree, previews, leaves)
        return
    expected_rewards = reference_rewards(spans(tree), prompts, previews, leaves)
    np.testing.assert_array_equal(step_rewards(tree, previews, leaves).numpy(), expected_rewards)
    expected = reference_advantages(spans(tree), prompts, expected_rewards)
    assert_close_to_float32(step_grpo_advantages(tree, previews, leaves), expected)


def test_a_tied_sibling_group_has_zero_advantages_and_leaves_the_others_alone():
    tree = hand_tree()
    previews, leaves = random_rewards(tree, [1, 3], seed=3)
    tied = tree[2].children  # K = 3 leaves of node 2: rewarded by their leaf rewards
    for leaf in tied:
        leaves[leaf] = 0.25
    advantages = step_grpo_advantages(tree, previews, leaves)
    assert advantages[list(tied)].tolist() == [0.0, 0.0, 0.0]
    prompts = [node.prompt_index for node in tree.nodes]
    rewards = reference_rewards(spans(tree), prompts, previews, leaves)
    assert_close_to_float32(advantages, reference_advantages(spans(tree), prompts, rewards))
    # A pair (K = 2) tied too: the roots share their children's preview at step 1.
    for row in (*tree[0].children, *tree[1].children):
        previews[1][row] = -1.0
    assert step_grpo_advantages(tree, previews, leaves)[[0, 1]].tolist() == [0.0, 0.0]


def test_pruned_nodes_drop_out_of_their_siblings_statistics():
    tree = hand_tree()
    previews, leaves = random_rewards(tree, [1, 3], seed=4)
    pruned = tree[3].id  # pruned before step 3: no preview of its children's rows, no leaves below
    for child in tree[pruned].children:
        del previews[3][child]
        del leaves[child]
    prompts = [node.prompt_index for node in tree.nodes]
    rewards = reference_rewards(spans(tree), prompts, previews, leaves)
    assert np.isnan(rewards[pruned])
    advantages = step_grpo_advantages(tree, previews, leaves)
    assert_close_to_float32(advantages, reference_advantages(spans(tree), prompts, rewards))
    assert advantages[tree[2].id] == 0.0  # the only rewarded child of root 0 is its own group


def test_without_branches_it_is_the_group_advantage():
    tree = Tree.grow(seeds=[1, 2, 3, 4, 5], prompt_indices=[0, 0, 0, 1, 1], branches=[], num_steps=STEPS)
    rewards = torch.tensor([0.1, 0.7, 0.4, 1.0, 0.2], dtype=torch.float64)
    advantages = step_grpo_advantages(tree, {}, dict(enumerate(rewards.tolist())))
    assert torch.equal(advantages, group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1])))


def test_the_loss_over_the_edges_matches_the_reference():
    tree = hand_tree()
    previews, leaves = random_rewards(tree, [1, 3], seed=5)
    advantages = step_grpo_advantages(tree, previews, leaves)
    edges = tree.edges()
    assert len(edges) == 2 * 1 + 4 * 2 + 12 * 3
    generator = np.random.default_rng(6)
    old = generator.normal(size=len(edges))
    new = old + generator.normal(scale=2e-4, size=len(edges))  # some ratios outside 1 +- clip
    clip_range = 1e-4
    # The reference: each edge with its own node's advantage (clipped to +-5), in float64.
    prompts = [node.prompt_index for node in tree.nodes]
    node_a = reference_advantages(
        spans(tree), prompts, reference_rewards(spans(tree), prompts, previews, leaves)
    )
    a = np.clip(np.array([node_a[node] for node, _ in edges]), -5, 5)
    rho = np.exp(new - old)
    terms = np.maximum(-a * rho, -a * np.clip(rho, 1 - clip_range, 1 + clip_range))
    assert ((rho < 1 - clip_range) | (rho > 1 + clip_range)).any()
    loss = clipped_policy_loss(
        torch.tensor(new, dtype=torch.float32),
        torch.tensor(old, dtype=torch.float32),
        edge_advantages(tree, advantages),
        clip_range,
    )
    # float32, u each rounding: new - old errs by up to u (|new| + |old|) once both are rounded, and
    # exp carries that into rho as a relative error, plus its own u; the advantage comes rounded (2u),
    # the clip bound 1 +- c (u) and the product (u) add theirs; the mean of E terms errs by (E - 1) u of
    # the mean of their magnitudes.
    per_term = (np.abs(new) + np.abs(old)).max() + 5
    bound = (per_term + len(edges) - 1) * UNIT_ROUNDOFF * np.abs(terms).mean()
    assert abs(loss.item() - terms.mean()) <= bound
