"""GenEval-style evaluation of a served policy on the shapes task.

Each eval prompt (``rollout_core.scenes.eval_prompts()``) is sampled ``samples`` times with the
deterministic ODE sampler from fixed seeds (``seed`` + k for the k-th image), at the policy the server
serves now, and every image is scored strictly: the right objects, counts, colours and relation, and
nothing extra. The same call before and after training compares the same noise.

The standard errors count a prompt's images as one cluster (its images share the prompt, and a policy
that draws a scene right tends to draw it right from every seed): the std of the per-prompt means
over the root of the prompt count. ``paired_difference`` is the same on the per-image differences of
two evals from the same seeds, which removes the variation between prompts that both share.

Every accuracy is measured twice: at the settings asked for (a training's steps and CFG) and at the
server's defaults (``at_server_defaults``: its ``GetServerInfo.defaults`` steps and its CFG), which is
how a user samples the model. ``evaluate_search`` evaluates with step-wise search
(``rollout_client.search``) and counts its forwards beside plain sampling's; ``evaluate_best_of``
keeps the best of N plain samples by the same reward.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_client.rewards import shapes
from rollout_client.search import step_search
from rollout_core import noise, scenes
from rollout_core.tree import Tree

if TYPE_CHECKING:
    from PIL import Image

    from rollout_client.client import RolloutClient
    from rollout_client.rewards import Reward


@dataclass(frozen=True)
class ShapesEval:
    """A policy's eval: the table per task type (``rewards.shapes.accuracy_table``) and its images."""

    table: dict[str, tuple[int, int]]
    prompts: list[str]
    images: "list[Image.Image]"
    correct: list[bool]
    # A search's or a best-of-N's transformer rows, and plain sampling's of the same images (None: plain).
    forwards: int | None = None
    plain_forwards: int | None = None

    @property
    def accuracy(self) -> float:
        correct, total = self.table["overall"]
        return correct / total

    @property
    def standard_error(self) -> float:
        return clustered_standard_error([float(c) for c in self.correct], self.prompts)

    def summary(self) -> dict:
        """The table as JSON: each task's correct and total, and the accuracy's mean and se."""
        counts = {task: {"correct": correct, "total": total} for task, (correct, total) in self.table.items()}
        forwards = (
            {}
            if self.forwards is None
            else {"forwards": self.forwards, "plain_forwards": self.plain_forwards}
        )
        return counts | {"accuracy": {"mean": self.accuracy, "se": self.standard_error}} | forwards


def clustered_standard_error(values: Sequence[float], prompts: Sequence[str]) -> float:
    """The standard error of the mean of ``values`` (one per image, the same count per prompt), with a
    prompt's images one cluster; NaN below two prompts."""
    per_prompt: dict[str, list[float]] = {}
    for value, prompt in zip(values, prompts, strict=True):
        per_prompt.setdefault(prompt, []).append(value)
    if len(per_prompt) < 2:
        return math.nan
    means = torch.tensor([sum(v) / len(v) for v in per_prompt.values()], dtype=torch.float64)
    return (means.std(correction=1) / math.sqrt(len(means))).item()


def paired_difference(
    before: Sequence[bool], after: Sequence[bool], prompts: Sequence[str], before_prompts: Sequence[str]
) -> dict:
    """The after - before accuracy of two evals of the same images (prompts and seeds), +- its
    clustered standard error."""
    if list(prompts) != list(before_prompts):
        raise ValueError("the two evals are not of the same prompts in the same order: they do not pair")
    differences = [float(a) - float(b) for a, b in zip(after, before, strict=True)]
    return {
        "before": sum(map(float, before)) / len(before),
        "after": sum(map(float, after)) / len(after),
        "difference": sum(differences) / len(differences),
        "se": clustered_standard_error(differences, prompts),
        "images": len(differences),
        "prompts": len(set(prompts)),
    }


def eval_request(
    *,
    samples: int = 1,
    steps: int = 20,
    size: int = 64,
    seed: int = 0,
    true_cfg_scale: float | None = None,
    prompts: int = 0,
) -> rollout_pb2.RolloutRequest:
    """The eval rollout: every eval prompt (the first ``prompts`` only, unless 0), ``samples`` ODE
    images each, without latents. CFG is the server's default unless ``true_cfg_scale`` is given (the
    shapes preset's: 3, against the empty prompt)."""
    if prompts < 0:
        raise ValueError(f"prompts must be 0 (every eval prompt) or more, not {prompts}")
    every = scenes.eval_prompts()
    return rollout_pb2.RolloutRequest(
        request_id="eval-shapes",
        prompts=every[:prompts] if prompts else every,
        samples_per_prompt=samples,
        base_seed=seed,
        num_steps=steps,
        height=size,
        width=size,
        sampler=rollout_pb2.SAMPLER_TYPE_ODE,
        latents=rollout_pb2.LATENT_SELECTION_NONE,
        true_cfg_scale=true_cfg_scale,
    )


def at_server_defaults(request: rollout_pb2.RolloutRequest) -> rollout_pb2.RolloutRequest:
    """``request`` with its steps and CFG left to the server (``GetServerInfo.defaults``), as a user
    samples the model: the same prompts, seeds and size."""
    defaults = rollout_pb2.RolloutRequest()
    defaults.CopyFrom(request)
    defaults.ClearField("num_steps")
    defaults.ClearField("true_cfg_scale")
    defaults.request_id = f"{request.request_id}-defaults"
    return defaults


def _parts(request: rollout_pb2.RolloutRequest, per_request: int) -> list[rollout_pb2.RolloutRequest]:
    """``request`` as requests of at most ``per_request`` whole prompts, each with its share of the
    request's own seeds (``splitmix64(base_seed + k)``, prompt-major): the same images as one request."""
    prompts, samples = list(request.prompts), request.samples_per_prompt or 1
    seeds = list(request.seeds) or noise.derive_seeds(request.base_seed, len(prompts) * samples)
    parts = []
    for start in range(0, len(prompts), per_request):
        part = rollout_pb2.RolloutRequest()
        part.CopyFrom(request)
        part.ClearField("base_seed")
        part.prompts[:] = prompts[start : start + per_request]
        part.seeds[:] = seeds[start * samples : (start + per_request) * samples]
        parts.append(part)
    return parts


def _scored(images: list, prompts: list[str], **forwards) -> ShapesEval:
    correct = shapes.strict_accuracy(images, prompts).bool().tolist()
    return ShapesEval(shapes.accuracy_table(prompts, correct), prompts, images, correct, **forwards)


def evaluate_policy(client: "RolloutClient", request: rollout_pb2.RolloutRequest | None = None) -> ShapesEval:
    """Roll out ``request`` (default: ``eval_request()``) and score every image strictly. An eval above
    the server's ``max_samples`` goes as several requests of whole prompts (``_parts``)."""
    request = request if request is not None else eval_request()
    per_request = max(client.server_info().limits.max_samples // (request.samples_per_prompt or 1), 1)
    trajectories = []
    for part in _parts(request, per_request):
        trajectories += client.rollout(part)
    return _scored([t.image() for t in trajectories], [t.prompt for t in trajectories])


def search_capacity(k: int, searched_steps: int, limits: rollout_pb2.Limits) -> int:
    """The most samples one search request of ``k`` children at ``searched_steps`` steps may hold within
    the server's limits (the tree is admitted at its full width); ValueError when not even one fits."""
    samples = 0
    while True:
        nodes, leaves = Tree.size(samples + 1, [k] * searched_steps)
        if (
            leaves > limits.max_running_samples
            or nodes > limits.max_tree_nodes
            or samples + 1 > limits.max_samples
        ):
            break
        samples += 1
    if not samples:
        raise ValueError(
            f"a search of {k} at {searched_steps} steps does not fit the server's limits "
            f"({limits.max_running_samples} samples at once, {limits.max_tree_nodes} tree nodes)"
        )
    return samples


def evaluate_search(
    client: "RolloutClient",
    request: rollout_pb2.RolloutRequest,
    reward: "Reward",
    k: int,
    steps: Sequence[int],
) -> ShapesEval:
    """``request``'s images sampled with step-wise search (``search.step_search``): at each of ``steps``
    the best of ``k`` children by ``reward`` on their previews goes on. The request's sampler becomes
    FLOW_SDE, stochastic at ``steps`` alone (a branch draws its children's noise there; every other step
    stays deterministic, as the ODE eval's). Its ``forwards`` are the search's transformer rows and
    ``plain_forwards`` plain sampling's of the same images; the kept images are in the request's order
    and seeds, so the eval pairs with a plain one image by image."""
    searched = rollout_pb2.RolloutRequest()
    searched.CopyFrom(request)
    searched.sampler = rollout_pb2.SAMPLER_TYPE_FLOW_SDE
    searched.stochastic_steps[:] = steps
    capacity = search_capacity(k, len(steps), client.server_info().limits)
    per_request = max(capacity // (request.samples_per_prompt or 1), 1)
    images, prompts, forwards, plain_forwards = [], [], 0, 0
    for part in _parts(searched, per_request):
        result = step_search(client, part, reward, k, steps)
        images += [t.image() for t in result.trajectories]
        prompts += [t.prompt for t in result.trajectories]
        forwards, plain_forwards = forwards + result.forwards, plain_forwards + result.plain_forwards
    return _scored(images, prompts, forwards=forwards, plain_forwards=plain_forwards)


def evaluate_best_of(
    client: "RolloutClient",
    request: rollout_pb2.RolloutRequest,
    reward: "Reward",
    n: int,
    plain_forwards: int,
) -> ShapesEval:
    """Best-of-``n``: each image of ``request`` sampled from ``n`` seeds, its own first (so best-of-1 is
    ``evaluate_policy``) and n - 1 more drawn past every seed of the request, and the one ``reward``
    scores highest kept (ties: the earliest). ``plain_forwards`` is plain sampling's count of the
    request, so its forwards are n times that."""
    images_count = len(request.prompts) * (request.samples_per_prompt or 1)
    candidates = []
    for j in range(n):
        draw = rollout_pb2.RolloutRequest()
        draw.CopyFrom(request)
        if j:
            draw.ClearField("base_seed")
            draw.seeds[:] = noise.derive_seeds(request.base_seed + j * images_count, images_count)
        candidates.append(evaluate_policy(client, draw))
    prompts = candidates[0].prompts
    scores = [torch.as_tensor(reward(c.images, prompts), dtype=torch.float64) for c in candidates]
    best = torch.stack(scores).argmax(dim=0).tolist()  # the first of the highest
    images = [candidates[j].images[i] for i, j in enumerate(best)]
    return _scored(images, prompts, forwards=n * plain_forwards, plain_forwards=plain_forwards)
