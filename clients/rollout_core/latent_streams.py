r"""Samples that carry several latent tensors: LTX-2 denoises a video and an audio latent together.

Such a sample's latent, everywhere the sampler, the wire and the trainer see it, is one *joint* vector:
the streams' elements flattened in stream order and concatenated, ``x = [vec(x^1), vec(x^2), ...]``
of shape ``[N]`` with ``N = sum_k numel(x^k)``. The step math of ``rollout_core.steps`` is elementwise,
so every stream takes the same transition (the same sigmas, sampler and noise level); the transformer
call cuts ``x`` back into the streams' shapes, hands stream k to the transformer under its keyword
argument, and joins the k-th output the same way (``rollout_core.transformer_call``).

The log-probability of a joint step is the mean over all N elements of both streams, the one
definition of ``steps.log_prob``::

    log p(x' | x) / N = (N_1 lp_1 + N_2 lp_2) / (N_1 + N_2)

where ``lp_k`` is stream k's own per-element mean (streamed beside it, ``stream_log_probs``). It is
the Gaussian log-density of the whole transition divided by its dimension, as for a single stream:
every element counts once, so FlowGRPO's clip ranges, set per element, keep their meaning, and a
stream's weight is its share of the sample. (A sum of per-stream means would weigh a few thousand
audio elements as much as a million video ones.)

Each stream draws its own noise from the sample's seed (``rollout_core.noise``): stream 0 exactly as a
single-stream family does, so families with one stream are unchanged, bitwise and on the wire.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.v1 import rollout_pb2


@dataclass(frozen=True)
class LatentStream:
    """One latent tensor of a sample (rollout.v1 LatentStream): its name, its shape as the transformer
    consumes it (without the batch dimension), and the transformer's keyword argument that takes it; its
    prediction is the transformer output's element at the stream's index."""

    name: str
    shape: tuple[int, ...]
    argument: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_proto(cls, message: rollout_pb2.LatentStream) -> "LatentStream":
        return cls(message.name, tuple(message.shape), message.argument)

    def to_proto(self) -> rollout_pb2.LatentStream:
        return rollout_pb2.LatentStream(name=self.name, shape=self.shape, argument=self.argument)


def joint_shape(streams: Sequence[LatentStream]) -> tuple[int]:
    """A sample's joint latent: every stream's elements in one vector."""
    return (sum(stream.size for stream in streams),)


def split(x: torch.Tensor, streams: Sequence[LatentStream]) -> list[torch.Tensor]:
    """The streams of joint latents ``x`` [B, N], each [B, *shape] (views where ``x`` is contiguous)."""
    parts = torch.split(x, [stream.size for stream in streams], dim=1)
    return [part.reshape(x.shape[0], *stream.shape) for part, stream in zip(parts, streams, strict=True)]


def join(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Joint latents [B, N] of the streams ``parts`` (each [B, ...], in stream order)."""
    return torch.cat([part.flatten(1) for part in parts], dim=1)
