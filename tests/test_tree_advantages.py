"""Tree advantages (BranchGRPO's fused, depth-normalised rewards; TreeGRPO's backed-up leaf advantages)
checked against an independent float64 NumPy reference that works on a bare parent list, on grown
trees with pruned leaves, and against hand-computed small trees."""

import math

import numpy as np
import pytest
import torch

from rollout_client.grpo import backed_up_advantages, branch_advantages
from rollout_core.tree import Tree

EPS = 1e-4
BRANCHES = [(0, 2), (3, 2), (5, 3)]


# ---- the reference: a parent list and plain recursion, no Tree helpers --------------------------


def _parents(tree: Tree) -> list[int]:
    return [node.parent for node in tree.nodes]


def _kids(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def _depth(parents: list[int], i: int) -> int:
    return 0 if parents[i] < 0 else 1 + _depth(parents, parents[i])


def _top(parents: list[int], i: int) -> int:
    return i if parents[i] < 0 else _top(parents, parents[i])


def _rewarded_below(kids, rewards: dict[int, float], i: int) -> list[int]:
    if not kids[i]:
        return [i] if i in rewards else []
    return [leaf for k in kids[i] for leaf in _rewarded_below(kids, rewards, k)]


def _normalise(values: np.ndarray, keys: list) -> np.ndarray:
    out = np.full(len(values), np.nan)
    for key in set(keys):
        idx = np.array([i for i, k in enumerate(keys) if k == key and not np.isnan(values[i])], dtype=int)
        if idx.size:
            out[idx] = (values[idx] - values[idx].mean()) / (values[idx].std() + EPS)
    return out


def _prompt_of(tree: Tree, parents: list[int]) -> list[int]:
    # a root's prompt is given; every other node inherits its root's
    return [tree.nodes[_top(parents, i)].prompt_index for i in range(len(parents))]


def reference_branch(tree: Tree, rewards: dict[int, float], log_probs=None) -> np.ndarray:
    parents = _parents(tree)
    kids = _kids(parents)
    fused = np.full(len(parents), np.nan)
    for n in range(len(parents)):
        leaves = _rewarded_below(kids, rewards, n)
        if not leaves:
            continue
        r = np.array([rewards[leaf] for leaf in leaves])
        if log_probs is None:
            fused[n] = r.mean()
            continue
        scores = []
        for leaf in leaves:
            total, m = 0.0, leaf
            while m != n:  # the nodes strictly below n on the way up from the leaf
                total += log_probs[m]
                m = parents[m]
            scores.append(total)
        scores = np.array(scores)
        w = np.exp(scores - scores.max())
        fused[n] = (w / w.sum() * r).sum()
    prompts = _prompt_of(tree, parents)
    keys = [(prompts[i], _depth(parents, i)) for i in range(len(parents))]
    return _normalise(fused, keys)


def reference_backed_up(tree: Tree, rewards: dict[int, float]) -> np.ndarray:
    parents = _parents(tree)
    kids = _kids(parents)
    prompts = _prompt_of(tree, parents)
    leaf_values = np.array([rewards.get(i, np.nan) if not kids[i] else np.nan for i in range(len(parents))])
    leaf_adv = _normalise(leaf_values, prompts)

    def adv(i: int) -> float:
        if not kids[i]:
            return leaf_adv[i]
        below = [a for a in (adv(k) for k in kids[i]) if not math.isnan(a)]
        return float(np.mean(below)) if below else math.nan

    return np.array([adv(i) for i in range(len(parents))])


# ---- fixtures --------------------------------------------------------------------------------------


def grown(seed: int):
    """Five roots over two prompts, 95 nodes, 60 leaves; about a third of the leaves pruned at random,
    and every leaf of root 1 pruned (so its whole subtree has no reward)."""
    tree = Tree.grow([11, 12, 13, 14, 15], [0, 0, 1, 1, 1], BRANCHES, 8)
    rng = np.random.default_rng(seed)
    leaves = [node.id for node in tree.nodes if not node.children]
    kept = [leaf for leaf in leaves if rng.random() > 0.35 and tree.nodes[leaf].root != 1]
    rewards = {leaf: float(rng.normal(0.5, 0.3)) for leaf in kept}
    log_probs = {i: float(rng.normal(-3.0, 2.0)) for i in range(len(tree))}
    return tree, rewards, log_probs


def check(actual: torch.Tensor, expected: np.ndarray):
    assert actual.dtype == torch.float32 and actual.shape == (len(expected),)
    np.testing.assert_array_equal(np.isnan(actual.numpy()), np.isnan(expected))
    np.testing.assert_allclose(
        actual.numpy().astype(np.float64), expected, rtol=1e-5, atol=1e-5, equal_nan=True
    )


# ---- against the reference -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_branch_mean_matches_the_reference(seed):
    tree, rewards, _ = grown(seed)
    assert len(tree) == 95 and len(tree.leaves) == 60
    expected = reference_branch(tree, rewards)
    check(branch_advantages(tree, rewards), expected)
    # root 1 and everything under it has no rewarded leaf (NaN); other subtrees may lose theirs too
    dead = {node.id for node in tree.nodes if node.root == 1}
    assert set(np.flatnonzero(np.isnan(expected))) >= dead


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_branch_log_prob_matches_the_reference(seed):
    tree, rewards, log_probs = grown(seed)
    expected = reference_branch(tree, rewards, log_probs)
    check(branch_advantages(tree, rewards, fusion="log_prob", node_log_probs=log_probs), expected)
    # a tensor by node id works the same
    as_tensor = torch.tensor([log_probs[i] for i in range(len(tree))])
    check(branch_advantages(tree, rewards, fusion="log_prob", node_log_probs=as_tensor), expected)
    # the fusion matters here: it is not the mean's answer
    assert not np.allclose(expected, reference_branch(tree, rewards), equal_nan=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backed_up_matches_the_reference(seed):
    tree, rewards, _ = grown(seed)
    expected = reference_backed_up(tree, rewards)
    check(backed_up_advantages(tree, rewards), expected)
    # each prompt's rewarded leaves are standardised: mean 0 within the prompt
    for prompt in (0, 1):
        leaves = [leaf for leaf in rewards if tree.nodes[leaf].prompt_index == prompt]
        assert abs(expected[leaves].mean()) < 1e-9


def test_no_rewarded_leaf_at_all_is_all_nan():
    tree, _, _ = grown(0)
    assert torch.isnan(branch_advantages(tree, {})).all()
    assert torch.isnan(backed_up_advantages(tree, {})).all()


# ---- hand-computed trees ---------------------------------------------------------------------------


def test_root_with_two_leaves():
    tree = Tree.grow([3], [0], [(4, 2)], 8)  # root 0, leaves 1 and 2
    rewards = {1: 1.0, 2: 0.0}
    half = 0.5 / (0.5 + EPS)
    # root: fused reward 0.5, alone at depth 0 -> 0; leaves: mean 0.5, std 0.5
    for adv in (branch_advantages(tree, rewards), backed_up_advantages(tree, rewards)):
        torch.testing.assert_close(adv, torch.tensor([0.0, half, -half]))


def test_two_levels_with_a_pruned_leaf():
    tree = Tree.grow([3], [0], [(2, 2), (4, 2)], 8)  # 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6
    assert [node.parent for node in tree.nodes] == [-1, 0, 0, 1, 1, 2, 2]
    rewards = {3: 1.0, 4: 0.0, 5: 1.0}  # leaf 6 pruned
    s = math.sqrt(2.0 / 9.0) + EPS  # the leaves' population std: rewards 1, 0, 1
    # BranchGRPO: R = [2/3, 0.5, 1, 1, 0, 1, -]; depth 1: mean 0.75, std 0.25
    q = 0.25 / (0.25 + EPS)
    expected = [0.0, -q, q, (1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, math.nan]
    torch.testing.assert_close(branch_advantages(tree, rewards), torch.tensor(expected), equal_nan=True)
    # TreeGRPO: node 1 = mean(A3, A4) = (-1/6)/s, node 2 = A5 (6 has none), root = mean(A1, A2) = (1/12)/s,
    # not the mean over the leaves (0)
    expected = [(1 / 12) / s, (-1 / 6) / s, (1 / 3) / s, (1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, math.nan]
    torch.testing.assert_close(backed_up_advantages(tree, rewards), torch.tensor(expected), equal_nan=True)


def test_depth_groups_are_per_prompt():
    # two roots of different prompts: each root alone in its (prompt, depth) group -> 0, leaves per prompt
    tree = Tree.grow([3, 4], [0, 1], [(4, 2)], 8)  # 0 -> 2, 3; 1 -> 4, 5
    rewards = {2: 1.0, 3: 0.0, 4: 10.0, 5: 6.0}
    adv = branch_advantages(tree, rewards)
    torch.testing.assert_close(adv[:2], torch.zeros(2))
    torch.testing.assert_close(
        adv[2:], torch.tensor([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 2 / (2 + EPS), -2 / (2 + EPS)])
    )


# ---- the softmax fusion's limits -------------------------------------------------------------------


def test_equal_path_log_probs_give_the_mean():
    tree, rewards, log_probs = grown(4)
    mean = branch_advantages(tree, rewards)
    # every node the same log-prob: all paths from a node to its leaves are equally long, equally likely
    same = {i: -7.5 for i in range(len(tree))}
    torch.testing.assert_close(branch_advantages(tree, rewards, "log_prob", same), mean, equal_nan=True)
    # roots' own log-probs lie on no path below any node: they change nothing
    roots_only = {i: (log_probs[i] if tree.nodes[i].parent < 0 else 0.0) for i in range(len(tree))}
    torch.testing.assert_close(branch_advantages(tree, rewards, "log_prob", roots_only), mean, equal_nan=True)


def test_one_dominant_path_gives_its_leaf_reward():
    tree = Tree.grow([3, 4], [0, 0], [(4, 2)], 8)  # 0 -> 2, 3; 1 -> 4, 5 (one prompt)
    rewards = {2: 1.0, 3: 0.0, 4: 0.2, 5: 0.6}
    log_probs = {0: 0.0, 1: 0.0, 2: 0.0, 3: -1e3, 4: -1e3, 5: 0.0}  # leaves 2 and 5 dominate
    adv = branch_advantages(tree, rewards, "log_prob", log_probs)
    # roots' fused rewards 1.0 and 0.6: mean 0.8, std 0.2 (the mean fusion: 0.5 and 0.4)
    r = 0.2 / (0.2 + EPS)
    torch.testing.assert_close(adv[:2], torch.tensor([r, -r]))
    m = 0.05 / (0.05 + EPS)
    torch.testing.assert_close(branch_advantages(tree, rewards)[:2], torch.tensor([m, -m]))
    # the leaves keep their own rewards either way
    torch.testing.assert_close(adv[2:], branch_advantages(tree, rewards)[2:])


# ---- errors ----------------------------------------------------------------------------------------


def test_bad_arguments_are_refused():
    tree = Tree.grow([3], [0], [(4, 2)], 8)
    with pytest.raises(ValueError, match="fusion"):
        branch_advantages(tree, {1: 1.0}, fusion="max")
    with pytest.raises(ValueError, match="node_log_probs"):
        branch_advantages(tree, {1: 1.0}, fusion="log_prob")
    for adv in (branch_advantages, backed_up_advantages):
        with pytest.raises(ValueError, match="not a leaf"):
            adv(tree, {0: 1.0})
        with pytest.raises(ValueError, match="not a leaf"):
            adv(tree, {7: 1.0})
        with pytest.raises(ValueError, match="pruned"):
            adv(tree, {1: float("nan")})
