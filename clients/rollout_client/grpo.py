r"""What a FlowGRPO-style trainer computes on streamed trajectories: log-probs with gradients, group
advantages, the clipped policy loss, the KL penalty and the Flow-GRPO-Fast step window.

* ``step_transitions(transformer, trajectories, i)``: step i of each trajectory recomputed under
  ``transformer``, differentiable: the transition mean [B, ...], its std [B] and the log-prob of the
  streamed x_{i+1} [B] (float32). The rows go through one forward per CFG branch (env stacked by the
  stream's batching rule), guidance and the step math run in float32, and the streamed x_{i+1} is
  scored exactly as the server scored it: at the policy the rollout ran on, the log-prob equals the
  streamed one up to the model's float rounding. ``step_log_probs`` is its log-prob alone.
* ``tree_edges(trajectories)``: the leaves of tree rollouts -> every stochastic transition once,
  as (request id, node, step, row): ``step_transitions`` on ``trajectories[row]`` at ``step`` scores
  the node's edge x_step -> x_{step+1}, which all leaves below the node share.
* ``micro_batches(trajectories, steps, size)``: the (step, rows) pieces to score, at most ``size``
  rows each: memory is bounded by what one piece's forward and backward hold (``row_batches``: the
  pieces of rows alone).
* ``group_advantages(rewards, groups)``: per prompt group,
  ``A = (r - mean_group(r)) / (std_group(r) + eps)``, the population std, eps = 1e-4 (FlowGRPO's
  per-prompt stat tracking).
* ``branch_advantages(tree, leaf_rewards, fusion, node_log_probs)``: BranchGRPO's (arXiv 2509.06040)
  advantages per node of a ``rollout_core.tree.Tree``. A node's reward fuses the rewards r_l of the
  rewarded leaves L(n) below it (a leaf's is its own): their mean (``fusion="mean"``), or
  (``fusion="log_prob"``) weighted by the probability of the path from n down to each leaf, with
  ``lp(m)`` the summed log-prob of node m's own steps::

      R(n) = sum_{l in L(n)} w_l r_l,   w_l = 1 / |L(n)|   or   w_l = softmax_{l in L(n)}(s_l),
      s_l = sum of lp(m) over the nodes m of the path n -> l strictly below n

  then standardised among the nodes of the same depth and prompt (normalised per depth within a
  tree), the population std::

      A(n) = (R(n) - mean_{depth, prompt}(R)) / (std_{depth, prompt}(R) + eps)

* ``backed_up_advantages(tree, leaf_rewards)``: TreeGRPO's (arXiv 2512.08153): the leaf rewards
  standardised within the prompt group (the rewarded leaves of that prompt, the population std),
  then backed up from the leaves to the roots, each node taking the mean of its children's::

      A(l) = (r_l - mean_prompt(r)) / (std_prompt(r) + eps),   A(n) = mean_{c in C(n)} A(c)

  with C(n) the children of n that have a rewarded leaf below them.

  Both take ``leaf_rewards`` as a mapping leaf id -> reward (a leaf left out is pruned), compute in
  float64 and return float32 [len(tree)] by node id, NaN at the nodes with no rewarded leaf below.
  (Checked against the papers' abstracts only, not their method sections: those are the rules above.)
* ``step_grpo_advantages(tree, preview_rewards, leaf_rewards)``: Step-GRPO's (DRM, arXiv 2605.25661)
  advantages per node. A node n spans the transitions ``start(n) <= i < end(n)``: a child starts at
  its parent's branch step, where it draws its own eps, and ends at its own next branch step (a leaf
  at T), so its first state of its own is x_{start(n)+1}. With ``preview_rewards[p][row]`` the reward
  of the preview (decoded x0_hat) of step p of the row that took it
  (``rollout_client.preview_rewards.score_previews``) and ``leaf_rewards`` the final images'::

      R(n) = the preview reward at the first preview step p with start(n) < p <= end(n)
             (p < end(n): n's own row; p = end(n), a branch step: its children's rows, which carry
             n's x_p and v_p), or, with none there, n's leaf reward (``step_rewards``)
      A(n) = (R(n) - mean_{S(n)}(R)) / (std_{S(n)}(R) + eps)         (``sibling_advantages``)

  with S(n) n and its siblings: the children of its parent, or for a root the roots of its prompt
  (a flat rollout's group), the population std over those with a reward. A tied group (std 0) gives
  each member 0, and a tree without branches gives ``group_advantages`` of the leaf rewards. Each
  edge (n, i) trains with A(n) (``edge_advantages``); the loss is ``clipped_policy_loss`` over the
  edges, which ``PolicyUpdate.finish_tree`` of the trainer computes edge by edge::

      loss = mean_{(n, i)} max(-A(n) rho_{n,i}, -A(n) clip(rho_{n,i}, 1 - clip_range, 1 + clip_range))

  Float64 inside, float32 [len(tree)] by node id out; NaN at a node with no transition of its own (a
  root of a tree that forks at step 0) or no reward (pruned before its state was scored).
* ``clipped_policy_loss(log_probs, old_log_probs, advantages, clip_range)``: PPO's clipped surrogate
  as FlowGRPO writes it, with ``rho = exp(log_probs - old_log_probs)`` and ``A`` clipped to
  [-adv_clip_max, adv_clip_max] (FlowGRPO: 5)::

      loss = mean(max(-A * rho, -A * clip(rho, 1 - clip_range, 1 + clip_range)))

  FlowGRPO's clip ranges are small: 1e-4 (1e-5 with Flow-GRPO-Fast and CPS).
* ``guarded_policy_loss(log_probs, old_log_probs, means, old_means, stds, dts, advantages,
  clip_range)``: GRPO-Guard's (arXiv 2510.22319) ratio normalisation. The log-ratio of a Gaussian
  step with std ``s = sigma_t sqrt(dt)``, at x_{i+1} = mean_old + s eps, is
  ``eps . (mean - mean_old) / s - |mean - mean_old|^2 / (2 s^2)`` (means over latent elements):
  its mean over eps is negative (the ratio is biased below 1 once the policy moves) and its spread
  grows as 1 / s, so the last, least noisy steps dominate the clip and the gradient. GRPO-Guard adds
  the bias back and rescales by s, which leaves ``mean(eps * (mean - mean_old))`` whatever the step,
  and divides each step's surrogate by dt so every step's velocity gradient weighs alike::

      bias = mean((mean - mean_old)^2) / (2 s^2)
      rho = exp((log_probs - old_log_probs + bias) * s)
      loss = mean(max(-A * rho, -A * clip(rho, 1 - clip_range, 1 + clip_range)) / dt)

  The log-probs must be the Gaussian log-density (the server's log-prob constants on).
* ``kl_to_reference(means, reference_means, stds)``: per sample, the KL divergence between the
  step's Gaussian under the policy and under the reference policy (the base model, e.g. with the
  LoRA disabled), which share the std, as a mean over latent elements like the log-prob::

      KL = mean((mean - reference_mean)^2) / (2 sd^2)

  FlowGRPO adds ``beta * mean(KL)`` to the loss (beta = 0.04 for most of its rewards, 0 by default).
* ``sde_window(num_steps, size, generator)``: Flow-GRPO-Fast's window: ``size`` consecutive
  stochastic steps starting at a random step in [0, num_steps // 2) (clipped to fit), the rest ODE;
  only the window is trained on. Send it as the request's ``stochastic_steps``.
"""

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from rollout_core import dtypes, steps
from rollout_core.transformer_call import apply_guidance, call_transformer, stack_envs

if TYPE_CHECKING:
    from rollout_client.trajectory import Trajectory
    from rollout_core.tree import Node, Tree


def _on(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _call_key(trajectory: "Trajectory") -> tuple:
    """Trajectories with equal keys can share one batched forward: same transformer call and expert
    per step, same latent shape, same env tensor shapes per branch."""
    shapes = sorted(
        (branch, key, tuple(value.shape))
        for branch, env in trajectory.env.items()
        for key, value in env.items()
        if isinstance(value, torch.Tensor)
    )
    return (
        trajectory.transformer_call,
        tuple(trajectory.step_transformers),
        tuple(trajectory.latents.shape[1:]),
        tuple(shapes),
    )


class Transition(NamedTuple):
    """Step i of B trajectories recomputed under a transformer (float32)."""

    log_probs: torch.Tensor  # [B]: the streamed x_{i+1} scored under N(means, stds^2)
    means: torch.Tensor  # [B, ...]
    stds: torch.Tensor  # [B]
    # Several latent streams (LTX-2): each stream's own log-prob [B], whose element-weighted mean
    # ``log_probs`` is; empty for one stream.
    stream_log_probs: dict[str, torch.Tensor]


Transformer = torch.nn.Module | Mapping[str, torch.nn.Module]


def expert(transformer: Transformer, trajectory: "Trajectory", i: int) -> torch.nn.Module:
    """The module that replays step ``i``: ``transformer`` itself, or, given the pipeline's experts
    by component name (Wan 2.2: ``{"transformer": ..., "transformer_2": ...}``), the one that ran it."""
    if not isinstance(transformer, Mapping):
        return transformer
    name = trajectory.step_transformers[i] if trajectory.step_transformers else "transformer"
    return transformer[name]


def step_transitions(
    transformer: Transformer,
    trajectories: Sequence["Trajectory"],
    i: int,
    device: str | torch.device = "cpu",
) -> Transition:
    """Step ``i`` of each trajectory recomputed with ``transformer`` (gradients flow unless the caller
    disables them), or with the expert that ran it when given the experts by name. Step i must be
    stochastic in each, with x_i and x_{i+1} streamed; all must share one transformer-call rule, env
    shapes and expert at step i (e.g. the samples of one request: split other mixes by request, as
    ``micro_batches`` does)."""
    device = torch.device(device)
    first = trajectories[0]
    call = first.transformer_call
    model, first_key = expert(transformer, first, i), _call_key(first)
    for trajectory in trajectories:
        if not (trajectory.stochastic[i] and trajectory.latent_mask[i] and trajectory.latent_mask[i + 1]):
            raise ValueError(
                f"step {i} of sample {trajectory.sample_index} is not stochastic, or x_{i} or x_{i + 1} "
                "was not streamed"
            )
        if _call_key(trajectory) != first_key or expert(transformer, trajectory, i) is not model:
            raise ValueError(
                "the trajectories differ in transformer call, env shapes or expert: pass them apart"
            )
    x = torch.stack([t.latents[i] for t in trajectories]).to(device)
    v = guided_velocity(model, trajectories, i, x, device)
    means, stds, log_probs, per_stream = [], [], [], []
    for row, trajectory in enumerate(trajectories):
        kind, sigmas, level = trajectory.sampler_type, trajectory.sigmas, trajectory.noise_level_at(i)
        mean = steps.transition_mean(kind, x[row : row + 1], v[row : row + 1], sigmas, i, level)
        sd = steps.noise_std(kind, sigmas, i, level).to(device)
        x_next = trajectory.latents[i + 1].unsqueeze(0).to(device)
        means.append(mean)
        stds.append(sd.reshape(1))
        log_probs.append(steps.log_prob(x_next - mean, sd, trajectory.log_prob_constants))
        if call.form.streams:
            per_stream.append(
                steps.stream_log_probs(x_next - mean, sd, trajectory.log_prob_constants, call.form.streams)
            )
    stream_log_probs = {
        stream.name: torch.cat([row[stream.name] for row in per_stream]) for stream in call.form.streams
    }
    return Transition(torch.cat(log_probs), torch.cat(means), torch.cat(stds), stream_log_probs)


def guided_velocity(
    model: torch.nn.Module, trajectories: Sequence["Trajectory"], i: int, x: torch.Tensor, device
) -> torch.Tensor:
    """v_i after guidance [B, ...] of ``x`` [B, ...] (the trajectories' x_i, on ``device``) with
    ``model``, by the trajectories' shared transformer-call rule: each CFG branch's rows in one call."""
    call = trajectories[0].transformer_call
    model_dtype = dtypes.BY_NAME[call.model_dtype]
    timesteps = torch.stack([t.timesteps[i] for t in trajectories])
    velocities = {}
    for branch in trajectories[0].env:
        env = stack_envs([t.env[branch] for t in trajectories], call.batched_env_keys)
        env = {key: _on(value, device) for key, value in env.items()}
        velocities[branch] = call_transformer(
            model,
            x,
            timesteps,
            env,
            model_dtype,
            call.timestep_divisor,
            call.conditioning,
            call.form,
            call.batched_env_keys,
        )
    return apply_guidance(call.guidance_rule, call.guidance_scale_at(i), velocities)


def step_log_probs(
    transformer: Transformer,
    trajectories: Sequence["Trajectory"],
    i: int,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """float32 [B]: the log-prob of step ``i`` of each trajectory under ``transformer``."""
    return step_transitions(transformer, trajectories, i, device).log_probs


class Edge(NamedTuple):
    """One transition of a tree rollout: node ``node`` of request ``request_id`` at step ``step``,
    held by ``trajectories[row]``, a leaf below the node."""

    request_id: str
    node: int
    step: int
    row: int


def tree_edges(trajectories: Sequence["Trajectory"]) -> list[Edge]:
    """Every stochastic transition of the trees the leaves ``trajectories`` come from, once, in each
    tree's node order (pruned nodes, which no leaf passes through, have none)."""
    rows: dict[tuple[str, int], int] = {}
    trees = {}
    for row, trajectory in enumerate(trajectories):
        if trajectory.tree is None:
            raise ValueError(f"sample {trajectory.sample_index} is not a tree leaf")
        trees.setdefault(trajectory.request_id, trajectory.tree)
        for node in trajectory.node_path:
            rows.setdefault((trajectory.request_id, node), row)
    return [
        Edge(request_id, node, i, rows[request_id, node])
        for request_id, tree in trees.items()
        for node, i in tree.edges()
        if (request_id, node) in rows and trajectories[rows[request_id, node]].stochastic[i]
    ]


def row_batches(trajectories: Sequence["Trajectory"], size: int) -> list[list[int]]:
    """Row indices into ``trajectories`` in pieces of at most ``size``, each of one transformer call
    and env shapes (one batched forward each), covering every row once."""
    if size < 1:
        raise ValueError("a micro-batch holds at least one row")
    kinds: dict[tuple, list[int]] = {}
    for row, trajectory in enumerate(trajectories):
        kinds.setdefault(_call_key(trajectory), []).append(row)
    return [rows[start : start + size] for rows in kinds.values() for start in range(0, len(rows), size)]


def micro_batches(
    trajectories: Sequence["Trajectory"], step_indices: Iterable[int], size: int
) -> Iterator[tuple[int, list[int]]]:
    """(step, row indices into ``trajectories``) pieces covering every trajectory at every given step,
    at most ``size`` rows each: ``row_batches`` at each step, so each piece can go to
    ``step_transitions`` as one batch."""
    pieces = row_batches(trajectories, size)
    for i in step_indices:
        for rows in pieces:
            yield i, rows


def sde_window(
    num_steps: int, size: int, generator: torch.Generator | None = None, last_start: int | None = None
) -> list[int]:
    """Flow-GRPO-Fast's stochastic window: ``size`` consecutive steps from a start drawn uniformly in
    [0, last_start] (default ``num_steps // 2 - 1``), shifted so the window fits."""
    if not 1 <= size <= num_steps:
        raise ValueError(f"a window of {size} steps does not fit {num_steps} steps")
    last_start = max(num_steps // 2 - 1, 0) if last_start is None else last_start
    start = int(torch.randint(0, last_start + 1, (), generator=generator))
    start = min(start, num_steps - size)
    return list(range(start, start + size))


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Per-sample advantages [N]: each reward standardised within its group (the samples sharing a
    value of ``groups``, e.g. a prompt), with the population std."""
    return _standardised_by(rewards.double(), groups.tolist(), eps).float()


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float = 5.0,
) -> torch.Tensor:
    """PPO's clipped surrogate (scalar; see the module docstring)."""
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean()


def guarded_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    means: torch.Tensor,
    old_means: torch.Tensor,
    stds: torch.Tensor,
    dts: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float = 5.0,
) -> torch.Tensor:
    """GRPO-Guard's clipped surrogate (scalar; see the module docstring): ``means`` [B, ...] and
    ``old_means`` the step's transition means under the policy and the rollout's policy, ``stds``
    [B] the step's noise stds sigma_t sqrt(dt), ``dts`` [B] its sigma_i - sigma_{i+1}."""
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    squared = (means - old_means) ** 2
    bias = squared.mean(dim=tuple(range(1, squared.ndim))) / (2 * stds**2)
    ratio = torch.exp((log_probs - old_log_probs + bias) * stds)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return (torch.maximum(unclipped, clipped) / dts).mean()


def kl_to_reference(means: torch.Tensor, reference_means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """[B]: KL(policy step || reference step) per sample, a mean over latent elements (see the module
    docstring); ``stds`` are the step's noise stds, shared by both Gaussians."""
    squared = (means.float() - reference_means.float()) ** 2
    per_sample = squared.mean(dim=tuple(range(1, squared.ndim)))
    return per_sample / (2 * stds.float() ** 2)


def _leaf_reward_vector(tree: "Tree", leaf_rewards: Mapping[int, float]) -> torch.Tensor:
    """float64 [len(tree)]: each rewarded leaf's reward at its id, NaN elsewhere."""
    rewards = torch.full((len(tree),), float("nan"), dtype=torch.float64)
    for node_id, reward in leaf_rewards.items():
        node_id = int(node_id)
        if not (0 <= node_id < len(tree) and tree[node_id].is_leaf):
            raise ValueError(f"node {node_id} is not a leaf of the tree: only leaves carry rewards")
        value = torch.tensor(float(reward), dtype=torch.float64)
        if not torch.isfinite(value):
            raise ValueError(f"leaf {node_id}'s reward is {float(reward)}: leave a pruned leaf out instead")
        rewards[node_id] = value
    return rewards


def _standardised_by(values: torch.Tensor, keys: Sequence[object], eps: float) -> torch.Tensor:
    """float64: each non-NaN value standardised among the non-NaN values sharing its key, with the
    population std; NaN stays NaN."""
    out = torch.full_like(values, float("nan"))
    groups: dict[object, list[int]] = {}
    for index, key in enumerate(keys):
        if not torch.isnan(values[index]):
            groups.setdefault(key, []).append(index)
    for members in groups.values():
        group = values[members]
        out[members] = (group - group.mean()) / (group.std(correction=0) + eps)
    return out


def _rewarded_leaves_below(tree: "Tree", rewards: torch.Tensor) -> list[list[int]]:
    """Per node id, the ids of the rewarded leaves below it (a rewarded leaf: itself), leaves in id
    order. Children are numbered after their parents, so one pass from the last id up suffices."""
    below: list[list[int]] = [[] for _ in range(len(tree))]
    for node in reversed(tree.nodes):
        if node.is_leaf:
            below[node.id] = [] if torch.isnan(rewards[node.id]) else [node.id]
        else:
            below[node.id] = sorted(leaf for child in node.children for leaf in below[child])
    return below


def branch_advantages(
    tree: "Tree",
    leaf_rewards: Mapping[int, float],
    fusion: str = "mean",
    node_log_probs: Mapping[int, float] | torch.Tensor | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """BranchGRPO's per-node advantages, float32 [len(tree)] by node id (see the module docstring):
    each node's reward fused from its rewarded leaves (``fusion`` "mean" or "log_prob"), then
    standardised among the nodes of its depth and prompt. ``leaf_rewards`` maps leaf id -> reward
    (a leaf left out is pruned); ``node_log_probs`` (for "log_prob": node id -> the summed log-prob
    of that node's own steps, a mapping or a [len(tree)] tensor) is read at every node below a node
    on the way to its rewarded leaves, so roots' entries are never needed. A node with no rewarded
    leaf below it gets NaN."""
    if fusion not in ("mean", "log_prob"):
        raise ValueError(f"unknown fusion {fusion!r}: use 'mean' or 'log_prob'")
    if fusion == "log_prob" and node_log_probs is None:
        raise ValueError("fusion='log_prob' needs node_log_probs (node id -> summed log-prob)")
    rewards = _leaf_reward_vector(tree, leaf_rewards)
    below = _rewarded_leaves_below(tree, rewards)
    # The log-prob of the path root -> n, own steps of the root included: the path from n down to a
    # leaf l, strictly below n, has log-prob prefix[l] - prefix[n].
    prefix = torch.zeros(len(tree), dtype=torch.float64)
    if fusion == "log_prob":
        needed = {node.id for node in tree.nodes if below[node.id] and node.depth > 0}
        for node in tree.nodes:  # parents before children
            own = float(node_log_probs[node.id]) if node.id in needed else 0.0
            prefix[node.id] = own + (prefix[node.parent] if node.depth > 0 else 0.0)
    fused = torch.full((len(tree),), float("nan"), dtype=torch.float64)
    for node in tree.nodes:
        leaves = below[node.id]
        if not leaves:
            continue
        if fusion == "mean":
            fused[node.id] = rewards[leaves].mean()
        else:
            weights = torch.softmax(prefix[leaves] - prefix[node.id], dim=0)
            fused[node.id] = (weights * rewards[leaves]).sum()
    keys = [(node.prompt_index, node.depth) for node in tree.nodes]
    return _standardised_by(fused, keys, eps).float()


def backed_up_advantages(tree: "Tree", leaf_rewards: Mapping[int, float], eps: float = 1e-4) -> torch.Tensor:
    """TreeGRPO's per-node advantages, float32 [len(tree)] by node id (see the module docstring): the
    leaf rewards standardised within their prompt group, each internal node taking the mean of its
    children's advantages (children with no rewarded leaf below left out). ``leaf_rewards`` maps
    leaf id -> reward (a leaf left out is pruned); a node with no rewarded leaf below it gets NaN."""
    rewards = _leaf_reward_vector(tree, leaf_rewards)
    advantages = _standardised_by(rewards, [node.prompt_index for node in tree.nodes], eps)
    for node in reversed(tree.nodes):  # children before parents
        if node.is_leaf:
            continue
        children = advantages[list(node.children)]
        children = children[~torch.isnan(children)]
        if len(children):
            advantages[node.id] = children.mean()
    return advantages.float()


NO_REWARD = float("nan")


def _reward_of(node: "Node", preview_rewards: Mapping[int, Mapping[int, float]], leaf: float) -> float:
    """R(node) by the module docstring's rule; NaN when its state has no reward (pruned before it)."""
    previewed = sorted(p for p in preview_rewards if node.start_step < p <= node.end_step)
    if not previewed:
        if not node.is_leaf:
            raise ValueError(
                f"node {node.id} spans steps {node.start_step} to {node.end_step} with no preview step in "
                f"({node.start_step}, {node.end_step}]: ask for one there (preview_steps)"
            )
        return leaf
    p = previewed[0]
    rows = [node.id] if p < node.end_step else list(node.children)
    return next((float(preview_rewards[p][row]) for row in rows if row in preview_rewards[p]), NO_REWARD)


def step_rewards(
    tree: "Tree", preview_rewards: Mapping[int, Mapping[int, float]], leaf_rewards: Mapping[int, float]
) -> torch.Tensor:
    """float64 [len(tree)]: each node's step reward R(n) (see the module docstring), NaN at a node with no
    transition of its own (a root whose tree forks at step 0) or whose state was not rewarded (a pruned
    node, whose preview or leaf reward is left out). ValueError when a node that has transitions and
    is not a leaf has no preview step in its span."""
    leaves = _leaf_reward_vector(tree, leaf_rewards)
    rewards = torch.full((len(tree),), NO_REWARD, dtype=torch.float64)
    for node in tree.nodes:
        if node.end_step > node.start_step:
            rewards[node.id] = _reward_of(node, preview_rewards, float(leaves[node.id]))
    return rewards


def sibling_advantages(tree: "Tree", rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """float32 [len(tree)]: each node's reward (float64 [len(tree)], NaN: none) standardised among its
    siblings (the children of its parent; roots: the roots of its prompt), population std; NaN stays
    NaN."""
    keys = [
        ("prompt", node.prompt_index) if node.depth == 0 else ("parent", node.parent) for node in tree.nodes
    ]
    return _standardised_by(rewards.double(), keys, eps).float()


def step_grpo_advantages(
    tree: "Tree",
    preview_rewards: Mapping[int, Mapping[int, float]],
    leaf_rewards: Mapping[int, float],
    eps: float = 1e-4,
) -> torch.Tensor:
    """Step-GRPO's advantage A(n) of every node, float32 [len(tree)] by node id (see the module docstring):
    ``sibling_advantages`` of ``step_rewards``."""
    return sibling_advantages(tree, step_rewards(tree, preview_rewards, leaf_rewards), eps)


def edge_advantages(tree: "Tree", node_advantages: torch.Tensor) -> torch.Tensor:
    """[len(tree.edges())]: the advantage each edge (node, step) of ``tree.edges()`` trains with, its
    node's."""
    return node_advantages[[node for node, _ in tree.edges()]]
