"""What a trainer draws rollouts from and pushes weights to: one server (``RolloutClient``) or a pool of
replicas (``RolloutPool``), through the same surface, so trainer code takes either."""

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, Self

import torch

from rollout.v1 import rollout_pb2
from rollout_client.events import Event
from rollout_client.trajectory import Trajectory


class RolloutSource(Protocol):
    def server_info(self) -> rollout_pb2.GetServerInfoResponse:
        """The server's (a replica's) model, defaults, limits and policy version."""

    def stream(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> Iterator[Event]:
        """Typed events of one rollout as they arrive."""

    def rollout(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> list[Trajectory]:
        """One Trajectory per sample, prompt-major."""

    def update_weights(
        self, weights: Mapping[str, torch.Tensor], version: int, *fields: Any, **options: Any
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Push ``WeightsUpdate(weights, version, *fields)`` as policy ``version`` (the keywords of
        ``rollout_client.updates.WeightsUpdate`` build it, ``progress=`` shows a bar); returns once
        it serves."""

    def load_weights(
        self, path: str, version: int, kind: str | None = None, adapter_name: str = "", target: str = ""
    ) -> rollout_pb2.LoadWeightsResponse:
        """Have the server load policy weights from under its ``--weights-root``."""

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc) -> None: ...


def as_request(request: rollout_pb2.RolloutRequest | None, fields: dict) -> rollout_pb2.RolloutRequest:
    """``request``, or one built from its ``fields``: ``stream`` and ``rollout`` take either."""
    if request is not None and fields:
        raise TypeError("pass either a RolloutRequest or its fields, not both")
    return request or rollout_pb2.RolloutRequest(**fields)
