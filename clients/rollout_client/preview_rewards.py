"""Rewards of intermediate states: a reward evaluated on the previews of a rollout.

A preview of step i (``RolloutRequest.preview_steps``) is the server's decode of a row's prediction of
the clean sample, x0_hat = x_i - sigma_i v_i, made by the model's own decoder like the final images.
Any ``rollout_client.rewards.Reward`` scores it as it would score a final image: the shapes task's
GenEval-style reward, the JPEG reward, or the trainer's weighted sum of ``spec*weight`` terms
(``rollout_client.train.rewards.Rewards``, which keeps each term's values of the call in ``last``).
The reward of x0_hat at step i is the intermediate reward of the node (or sample) whose state x_i is.
"""

import io
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from PIL import Image as PILImage

if TYPE_CHECKING:
    from rollout_client.rewards import Reward
    from rollout_client.trajectory import Collector


def score_previews(
    collector: "Collector", reward: "Reward", steps: Iterable[int] | None = None
) -> dict[int, dict[int, float]]:
    """Score the previews of ``steps`` (default: every step whose previews have all arrived and are not
    scored yet) with ``reward``, one call per step: each preview's first frame against its sample's
    prompt. Stores and returns ``collector.step_rewards``: step -> node (a flat rollout's sample) that
    took the step -> reward, the keys of ``collector.previews``.

    Each distinct x_i is scored once: at a tree's branch step the rows are the children, which share
    their parent's x_i and v_i and so its preview, and they share its reward. A step whose previews
    have not all arrived is a ValueError."""
    if steps is None:
        steps = sorted(collector.previewed - set(collector.step_rewards))
    message = collector.started.message
    tree = collector.tree
    for step in steps:
        if step not in collector.previewed:
            raise ValueError(f"the previews of step {step} have not all arrived")
        by_node = collector.previews[step]
        # The node whose x_step each row previews (its own, or at a branch step its parent's).
        owners = {node: tree.owner(node, step).id if tree else node for node in by_node}
        scored = list(dict.fromkeys(owners.values()))
        first_row = {owner: min(n for n, o in owners.items() if o == owner) for owner in scored}
        images = [PILImage.open(io.BytesIO(by_node[first_row[owner]][0])) for owner in scored]
        prompt_indices = [
            tree[owner].prompt_index if tree else message.prompt_indices[owner] for owner in scored
        ]
        prompts = [message.resolved.prompts[p] for p in prompt_indices]
        values = torch.as_tensor(reward(images, prompts), dtype=torch.float64).tolist()
        value_of = dict(zip(scored, values, strict=True))
        collector.step_rewards[step] = {node: value_of[owner] for node, owner in sorted(owners.items())}
    return collector.step_rewards
