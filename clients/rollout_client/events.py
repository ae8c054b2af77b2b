"""Typed rollout events with decoded torch tensors, reassembled from the raw message stream."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.v1 import rollout_pb2
from rollout_core import codec, wire


@dataclass
class Started:
    """Resolved parameters, seeds, schedule, env and (when selected) x_0."""

    request_id: str
    message: rollout_pb2.RolloutStarted  # tensor bytes stripped
    # env[branch][prompt_index] -> {kwarg: tensor or JSON value}, exactly as the transformer got it.
    env: dict[str, list[dict[str, Any]]]
    x0: torch.Tensor | None


@dataclass
class Step:
    """One denoising step x_i -> x_{i+1}."""

    request_id: str
    message: rollout_pb2.RolloutStep  # tensor bytes stripped
    index: int
    stochastic: bool
    log_probs: torch.Tensor | None  # float32 [B] when stochastic
    x_next: torch.Tensor | None
    debug: dict[str, torch.Tensor] = field(default_factory=dict)
    nodes: list[int] = field(default_factory=list)  # a tree rollout's: the node of each row
    # Several latent streams (LTX-2): each stream's own log-probs, float32 [B], when stochastic.
    stream_log_probs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Pruned:
    """A tree rollout's nodes stopped by PruneRollout: they take no step from ``step`` on."""

    request_id: str
    nodes: list[int]
    step: int


@dataclass
class Image:
    """A decoded PNG image of one sample: frame ``frame_index`` of a video sample, or the image."""

    request_id: str
    sample_index: int
    png: bytes
    frame_index: int = 0


@dataclass
class Audio:
    """The decoded sound of one sample, a WAV file (families that generate audio: LTX-2)."""

    request_id: str
    sample_index: int
    wav: bytes
    sample_rate: int
    channels: int


@dataclass
class Preview:
    """A decoded prediction of the clean sample at step ``step`` (``RolloutRequest.preview_steps``):
    x0_hat = x_i - sigma_i v_i of one row, decoded as the final images are. ``media`` is one of its
    frames (an Image) or its sound (an Audio); its ``sample_index`` is the sample, or the tree node
    that took the step. ``last``: the step's previews have all arrived."""

    request_id: str
    step: int
    media: Image | Audio
    last: bool

    @property
    def sample_index(self) -> int:
        return self.media.sample_index


@dataclass
class Finished:
    """Timings and memory."""

    request_id: str
    message: rollout_pb2.RolloutFinished


Event = Started | Step | Pruned | Image | Audio | Preview | Finished


def _read_payload(first: bytes, following: int, responses: Iterator[rollout_pb2.RolloutResponse]) -> bytes:
    pieces = [first]
    for expected in range(1, following + 1):
        response = next(responses, None)
        if response is None:
            raise ValueError(f"stream ended inside a payload: {following - expected + 1} chunks missing")
        if response.WhichOneof("event") != "chunk" or response.chunk.index != expected:
            raise ValueError(f"stream out of order: expected payload chunk {expected}, got {response}")
        pieces.append(response.chunk.data)
    return b"".join(pieces)


def _tensors(message_tensors: rollout_pb2.Tensors, responses) -> dict[str, torch.Tensor]:
    data = message_tensors.data
    buffer = _read_payload(data, message_tensors.following_chunks, responses)
    message_tensors.ClearField("data")
    return codec.decode(buffer)


def _env(tensors: dict[str, torch.Tensor], env_json: str) -> dict[str, list[dict[str, Any]]]:
    """env[branch][prompt] from the started event's tensors and JSON values."""
    envs = wire.decode_env(tensors, env_json)
    return {branch: [per_prompt[p] for p in sorted(per_prompt)] for branch, per_prompt in envs.items()}


def _image(rid: str, image: rollout_pb2.RolloutImage, responses) -> Image:
    png = _read_payload(image.png, image.following_chunks, responses)
    return Image(rid, image.sample_index, png, image.frame_index)


def _audio(rid: str, audio: rollout_pb2.RolloutAudio, responses) -> Audio:
    wav = _read_payload(audio.wav, audio.following_chunks, responses)
    return Audio(rid, audio.sample_index, wav, audio.sample_rate, audio.channels)


def decode_stream(responses: Iterable[rollout_pb2.RolloutResponse]) -> Iterator[Event]:
    """Turn raw RolloutResponse messages into typed events, reassembling split payloads.

    Forward compatible: an event of a later server (a oneof field this client does not know, so
    ``WhichOneof`` finds none and its bytes stay unknown fields) is skipped, with the payload chunks
    that follow it; protobuf ignores unknown fields inside known events. A chunk that follows no
    payload, or a payload cut short, is a protocol error (ValueError).
    """
    responses = iter(responses)
    skipping = False  # inside the payload chunks of an event this client does not know
    for response in responses:
        kind = response.WhichOneof("event")
        if kind is None or (skipping and kind == "chunk"):
            skipping = True
            continue
        skipping = False
        rid = response.request_id
        if kind == "started":
            tensors = _tensors(response.started.tensors, responses)
            env = _env(tensors, response.started.env_json)
            yield Started(rid, response.started, env, tensors.get(wire.X_0))
        elif kind == "step":
            step = response.step
            tensors = _tensors(step.tensors, responses)
            log_probs = torch.tensor(list(step.log_probs), dtype=torch.float32) if step.stochastic else None
            x_next = tensors.pop(wire.X_NEXT, None)
            per_stream = {
                entry.stream: torch.tensor(list(entry.log_probs), dtype=torch.float32)
                for entry in step.stream_log_probs
            }
            nodes = list(step.nodes)
            yield Step(rid, step, step.index, step.stochastic, log_probs, x_next, tensors, nodes, per_stream)
        elif kind == "pruned":
            yield Pruned(rid, list(response.pruned.nodes), response.pruned.step)
        elif kind == "image":
            yield _image(rid, response.image, responses)
        elif kind == "audio":
            yield _audio(rid, response.audio, responses)
        elif kind == "preview":
            preview = response.preview
            media = preview.WhichOneof("media")
            if media is None:  # a later server's media: skipped, with its chunks
                skipping = True
                continue
            read = _image if media == "image" else _audio
            yield Preview(rid, preview.step, read(rid, getattr(preview, media), responses), preview.last)
        elif kind == "finished":
            yield Finished(rid, response.finished)
        else:
            raise ValueError(f"unexpected message {kind!r} outside a payload")
