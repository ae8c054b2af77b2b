"""``RolloutClient``: call a rollout server and get typed events or whole trajectories."""

from collections.abc import Iterator

import grpc

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client.events import Event, decode_stream
from rollout_client.trajectory import Trajectory, collect

# Large enough for any message a server sends (its limit is reported by GetServerInfo).
MAX_RECEIVE_BYTES = 64 * 1024 * 1024


class RolloutClient:
    """A connection to a rollout server.

    >>> with RolloutClient("127.0.0.1:50051") as client:
    ...     trajectories = client.rollout(prompts=["a red fox"], samples_per_prompt=4, base_seed=7)
    """

    def __init__(self, address: str, timeout: float | None = None):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
        )
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    def server_info(self) -> rollout_pb2.GetServerInfoResponse:
        return self.stub.GetServerInfo(rollout_pb2.GetServerInfoRequest(), timeout=self.timeout)

    def stream(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> Iterator[Event]:
        """Typed events of one rollout as they arrive; closing the iterator cancels the rollout."""
        if request is not None and fields:
            raise TypeError("pass either a RolloutRequest or its fields, not both")
        request = request or rollout_pb2.RolloutRequest(**fields)
        call = self.stub.Rollout(request, timeout=self.timeout)
        try:
            yield from decode_stream(call)
        finally:
            call.cancel()

    def rollout(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> list[Trajectory]:
        """Run a rollout to the end and return one Trajectory per sample."""
        return collect(self.stream(request, **fields))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
