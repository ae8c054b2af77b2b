"""Requests and media: request builders, conditioning images, and a rollout stream split by event type."""

import io
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import PIL.Image

from rollout.v1 import rollout_pb2
from rollout_client import Collector, Finished, Image, RolloutClient, Started, Step, Trajectory, collect

SAMPLERS = {
    "FLOW_SDE": rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
    "DANCE": rollout_pb2.SAMPLER_TYPE_DANCE,
    "CPS": rollout_pb2.SAMPLER_TYPE_CPS,
    "ODE": rollout_pb2.SAMPLER_TYPE_ODE,
}
LATENT_DTYPES = {"float32": rollout_pb2.TENSOR_DTYPE_FLOAT32, "bfloat16": rollout_pb2.TENSOR_DTYPE_BFLOAT16}
# A client's fixed 64 KiB stream window (no BDP growth): the server can only run a few messages ahead
# of a reader that stops, then its rollout parks.
HOLDING_OPTIONS = [("grpc.http2.bdp_probe", 0)]


def make_request(*fields: dict, **more) -> rollout_pb2.RolloutRequest:
    """A RolloutRequest from dicts of fields merged left to right, then ``more``; None leaves a field
    unset."""
    merged = {}
    for part in (*fields, more):
        merged.update(part)
    return rollout_pb2.RolloutRequest(**{name: value for name, value in merged.items() if value is not None})


@dataclass
class Rollout:
    """A decoded rollout stream, split by event type."""

    events: list
    started: Started
    steps: list[Step]
    images: list[Image]
    finished: Finished

    def trajectories(self) -> list[Trajectory]:
        return collect(self.events)


def split_events(events: Iterable) -> Rollout:
    """Split a stream into its started event, steps, images and finished event, checking its shape."""
    events = list(events)
    kinds = [type(event).__name__ for event in events]
    started, *middle, finished = events
    assert isinstance(started, Started) and isinstance(finished, Finished), kinds
    steps = [event for event in middle if isinstance(event, Step)]
    images = [event for event in middle if isinstance(event, Image)]
    assert [type(event) for event in middle] == [Step] * len(steps) + [Image] * len(images), kinds
    return Rollout(events, started, steps, images, finished)


def collected(events: Iterable) -> Collector:
    """A Collector fed ``events``: its tree, previews and log-prob tables, not only its trajectories."""
    collector = Collector()
    for event in events:
        collector.add(event)
    return collector


def stream_events(client: RolloutClient, *fields: dict, **more) -> Rollout:
    """Stream the request ``make_request(*fields, **more)`` and split its events."""
    return split_events(client.stream(make_request(*fields, **more)))


def condition_png(index: int, width: int = 64, height: int = 64) -> bytes:
    """A conditioning image, different for each ``index``: a colour gradient with a square on it."""
    rng = np.random.default_rng(index)
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, np.full_like(xs, 40 * index % 256)], axis=-1)
    top, left = rng.integers(0, height // 2), rng.integers(0, width // 2)
    pixels[top : top + height // 3, left : left + width // 3] = rng.integers(0, 256, 3)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def condition_image(index: int) -> PIL.Image.Image:
    """The image ``family_request`` sends for prompt ``index``, as the server reads it (64 x 64 RGB)."""
    return PIL.Image.open(io.BytesIO(condition_png(index))).convert("RGB")
