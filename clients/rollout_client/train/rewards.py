"""The trainer's reward: one ``module:callable`` reward, or a weighted sum of several.

``--reward`` takes ``spec[*weight]`` terms separated by commas, e.g.
``rollout_client.rewards.shapes:geneval_reward,rollout_client.rewards:jpeg_compressibility*0.1``.
Each term is a ``rollout_client.rewards.Reward``: ``reward(images, prompts) -> float32 [N]``; one
whose signature has a ``metadata`` parameter also gets each sample's ``SampleInfo`` (its prompt
index, sample index, seed, the policy version that sampled it; None when the trainer scores a tree
node before its leaves exist, as --prune-at does). With several terms, each term's mean
is logged in metrics.csv as ``reward_mean/<spec>`` beside the total's ``reward_mean``.
"""

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleInfo:
    """What a reward may know of a sample beyond its image and prompt."""

    prompt_index: int
    sample_index: int
    seed: int
    policy_version: int


def reward_terms(text: str) -> list[tuple[str, float]]:
    """``--reward``'s (spec, weight) terms; ValueError naming a term that is not ``module:name[*w]``,
    or whose weight is not finite."""
    terms = []
    for item in text.split(","):
        spec, _, weight = item.strip().partition("*")
        module, _, name = spec.partition(":")
        try:
            if not module or not name.isidentifier():
                raise ValueError(item)
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"not module:callable[*weight]: {item!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"the weight of {spec} must be finite, got {weight}")
        terms.append((spec, value))
    return terms


@dataclass(frozen=True)
class Term:
    spec: str
    function: Callable
    weight: float
    takes_metadata: bool


class Rewards:
    """The weighted sum of ``--reward``'s terms, callable as one reward; ``last`` holds each term's
    values of the latest call."""

    def __init__(self, text: str):
        self.terms = []
        for spec, weight in reward_terms(text):
            module, _, name = spec.partition(":")
            function = getattr(importlib.import_module(module), name)
            takes_metadata = "metadata" in inspect.signature(function).parameters
            self.terms.append(Term(spec, function, weight, takes_metadata))
        self.last: dict[str, torch.Tensor] = {}

    def __call__(
        self, images, prompts: Sequence[str], metadata: Sequence[SampleInfo] | None = None
    ) -> torch.Tensor:
        self.last = {}
        for term in self.terms:
            extra = {"metadata": metadata} if term.takes_metadata else {}
            self.last[term.spec] = torch.as_tensor(
                term.function(images, prompts, **extra), dtype=torch.float32
            )
        return sum(term.weight * self.last[term.spec] for term in self.terms)

    def non_finite(self, rewards: torch.Tensor, metadata: Sequence[SampleInfo]) -> str | None:
        """Which of ``rewards`` (this call's) is NaN or infinite, and which term made it (their weighted
        sum where finite terms overflowed), or None when all are finite."""
        bad = (~rewards.isfinite()).nonzero()
        if not len(bad):
            return None
        k = int(bad[0])
        term = next((spec for spec, values in self.last.items() if not values[k].isfinite()), None)
        sample = metadata[k]
        return (
            f"the reward of prompt {sample.prompt_index}'s sample {sample.sample_index} is "
            f"{rewards[k].item()} ({term or 'the weighted sum of finite terms overflowed'})"
        )

    def columns(self) -> list[str]:
        """The metrics columns of the terms (none for a single reward: ``reward_mean`` is it)."""
        return [f"reward_mean/{term.spec}" for term in self.terms] if len(self.terms) > 1 else []
