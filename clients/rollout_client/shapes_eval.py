"""GenEval-style evaluation of a served policy on the shapes task.

Each eval prompt (``rollout_core.scenes.eval_prompts()``) is sampled ``samples`` times with the
deterministic ODE sampler from fixed seeds (``seed`` + k for the k-th image), at the policy the server
serves now, and every image is scored strictly: the right objects, counts, colours and relation, and
nothing extra. The same call before and after training compares the same noise.

The standard errors count a prompt's images as one cluster (its images share the prompt, and a policy
that draws a scene right tends to draw it right from every seed): the std of the per-prompt means
over the root of the prompt count. ``paired_difference`` is the same on the per-image differences of
two evals from the same seeds, which removes the variation between prompts that both share.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_client.rewards import shapes
from rollout_core import noise, scenes

if TYPE_CHECKING:
    from PIL import Image

    from rollout_client.client import RolloutClient


@dataclass(frozen=True)
class ShapesEval:
    """A policy's eval: the table per task type (``rewards.shapes.accuracy_table``) and its images."""

    table: dict[str, tuple[int, int]]
    prompts: list[str]
    images: "list[Image.Image]"
    correct: list[bool]

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
        return counts | {"accuracy": {"mean": self.accuracy, "se": self.standard_error}}


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
    *, samples: int = 1, steps: int = 20, size: int = 64, seed: int = 0, true_cfg_scale: float | None = None
) -> rollout_pb2.RolloutRequest:
    """The eval rollout: every eval prompt, ``samples`` ODE images each, without latents. CFG is the
    server's default unless ``true_cfg_scale`` is given (the shapes preset's: 3, against the empty
    prompt)."""
    return rollout_pb2.RolloutRequest(
        request_id="eval-shapes",
        prompts=scenes.eval_prompts(),
        samples_per_prompt=samples,
        base_seed=seed,
        num_steps=steps,
        height=size,
        width=size,
        sampler=rollout_pb2.SAMPLER_TYPE_ODE,
        latents=rollout_pb2.LATENT_SELECTION_NONE,
        true_cfg_scale=true_cfg_scale,
    )


def evaluate_policy(client: "RolloutClient", request: rollout_pb2.RolloutRequest | None = None) -> ShapesEval:
    """Roll out ``request`` (default: ``eval_request()``) and score every image strictly. An eval above
    the server's ``max_samples`` goes as several requests of whole prompts, each with its share of the
    request's own seeds (``splitmix64(base_seed + k)``, prompt-major): the same images as one request."""
    request = request if request is not None else eval_request()
    prompts, samples = list(request.prompts), request.samples_per_prompt or 1
    seeds = list(request.seeds) or noise.derive_seeds(request.base_seed, len(prompts) * samples)
    per_request = max(client.server_info().limits.max_samples // samples, 1)
    trajectories = []
    for start in range(0, len(prompts), per_request):
        part = rollout_pb2.RolloutRequest()
        part.CopyFrom(request)
        part.ClearField("base_seed")
        part.prompts[:] = prompts[start : start + per_request]
        part.seeds[:] = seeds[start * samples : (start + per_request) * samples]
        trajectories += client.rollout(part)
    images = [trajectory.image() for trajectory in trajectories]
    prompts = [trajectory.prompt for trajectory in trajectories]
    correct = shapes.strict_accuracy(images, prompts).bool().tolist()
    return ShapesEval(shapes.accuracy_table(prompts, correct), prompts, images, correct)
