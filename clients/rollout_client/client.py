"""``RolloutClient``: call a rollout server, get typed events or whole trajectories, prune trees,
push weights, release and resume the weights' memory. The client owns the transport: every call of
the package to a server goes through its ``call`` (its timeout and token), and its health through
``health``."""

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tqdm import tqdm

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client.channel import DEFAULT_RETRY, RetryPolicy, base_options, previous_attempts
from rollout_client.credentials import TLS, bearer_metadata
from rollout_client.events import Event, Started, decode_stream
from rollout_client.source import as_request
from rollout_client.trajectory import Trajectory, collect
from rollout_client.updates import WEIGHTS_KINDS, WeightsUpdate, from_weights
from rollout_client.weight_sync import WeightSyncGroup
from rollout_core import codec

# Weight update pieces: well below the server's 4 MiB receive limit, and in the 1-4 MiB range where
# Python gRPC moves bytes fastest.
UPDATE_CHUNK_BYTES = 1024 * 1024
# Updates at least this large get a progress bar (when asked for).
PROGRESS_MIN_BYTES = 32 * 1024 * 1024
UPDATE_WEIGHTS_METHOD = (
    f"/{rollout_pb2.DESCRIPTOR.services_by_name['RolloutService'].full_name}/UpdateWeights"
)
# UpdateWeightsRequest.data is field 2, length-delimited: its tag byte.
DATA_FIELD_TAG = b"\x12"


def varint(value: int) -> bytes:
    """``value`` as a protobuf base-128 varint."""
    encoded = bytearray()
    while value > 0x7F:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def update_frame(header: rollout_pb2.WeightsUpdateHeader, index: int, length: int) -> bytes:
    """The bytes that make piece ``index`` of an update (``length`` bytes, which follow) a serialised
    UpdateWeightsRequest: the data field's tag and length, after the header field on the first piece.
    (Serialised protobuf fields concatenate; building the message would copy every piece twice.)"""
    head = rollout_pb2.UpdateWeightsRequest(header=header).SerializeToString() if index == 0 else b""
    return head + DATA_FIELD_TAG + varint(length)


@dataclass
class RolloutStats:
    """A client's Rollout calls: how many it made, and ``retries``, the attempts gRPC made again
    after a server refused one before its first message (as the servers reported them)."""

    calls: int = 0
    retries: int = 0


class RolloutClient:
    """A connection to a rollout server.

    >>> with RolloutClient("127.0.0.1:50051") as client:
    ...     trajectories = client.rollout(prompts=["a red fox"], samples_per_prompt=4, base_seed=7)

    ``tls``: connect over TLS (``TLS(ca=..., cert=..., key=...)``; None: plaintext). ``token``: sent
    as ``authorization: Bearer <token>`` on every call, for a server started with token files.
    ``channel_options``: more gRPC channel arguments. ``retry``: how gRPC retries a rollout that a
    full (RESOURCE_EXHAUSTED) or departing (UNAVAILABLE) server refused before its first message
    (``rollout_client.channel.RetryPolicy``; None: the refusal is raised at once); ``stats`` counts
    the retries.
    """

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        tls: TLS | None = None,
        token: str | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        retry: RetryPolicy | None = DEFAULT_RETRY,
    ):
        self.address = address
        self.timeout = timeout
        self.metadata = bearer_metadata(token)
        self.stats = RolloutStats()
        self._stats_lock = threading.Lock()  # streams may run on several threads
        options = [*base_options(retry), *channel_options]
        if tls is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        # UpdateWeights with messages the client frames itself (see update_frame).
        self._update_weights = self.channel.stream_unary(
            UPDATE_WEIGHTS_METHOD, response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString
        )

    def call(self, method: str, request: Any, **options: Any) -> Any:
        """The RolloutService method named ``method`` on ``request`` (a message, or an iterator of them
        for a client-streaming method), with the client's timeout and token unless ``options`` give
        their own (``timeout=None``: no deadline). Answers as the stub does: a message, or an iterator
        of them for a server-streaming method."""
        return getattr(self.stub, method)(request, **self._options(options))

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"timeout": self.timeout, "metadata": self.metadata, **options}

    def health(self, **options: Any) -> int:
        """The server's gRPC health (``grpc.health.v1``): ``HealthCheckResponse.SERVING``, or
        NOT_SERVING once it drains or a rank failed; ``options`` as ``call``'s."""
        return self._health.Check(health_pb2.HealthCheckRequest(), **self._options(options)).status

    def server_info(self) -> rollout_pb2.GetServerInfoResponse:
        return self.call("GetServerInfo", rollout_pb2.GetServerInfoRequest())

    def stream(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> Iterator[Event]:
        """Typed events of one rollout as they arrive; closing the iterator cancels the rollout."""
        call = self.call("Rollout", as_request(request, fields))
        try:
            yield from decode_stream(call)
        finally:
            call.cancel()
            retries = previous_attempts(call.trailing_metadata())
            with self._stats_lock:
                self.stats.calls += 1
                self.stats.retries += retries

    def rollout(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> list[Trajectory]:
        """Run a rollout to the end and return one Trajectory per sample."""
        request = as_request(request, fields)
        return collect(self.stream(request), [image.data for image in request.condition_images])

    def prune(self, started: Started, nodes: Sequence[int] = ()) -> rollout_pb2.PruneRolloutResponse:
        """Stop ``nodes`` of the tree rollout that ``started`` began, and every node below them, at
        its next step. The started event carries the rollout's control token, which the server asks
        for: only the rollout's caller has it. The answer is what the server stopped: every node
        pruned so far, and ``step``, the first step they do not take. No nodes is an explicit "no
        prune", which lets a rollout held at one of its ``prune_points`` go on. A rollout that has
        taken its last step stops nothing: grpc.RpcError FAILED_PRECONDITION."""
        request = rollout_pb2.PruneRolloutRequest(
            request_id=started.request_id, nodes=nodes, control_token=started.message.control_token
        )
        return self.call("PruneRollout", request)

    def push(self, update: WeightsUpdate, progress: bool = True) -> rollout_pb2.UpdateWeightsResponse:
        """Stream ``update`` to the server (UpdateWeights); returns once it is applied, and rollouts
        that start after it run on its version. A progress bar counts the bytes sent of a large
        update, unless ``progress`` is False."""
        header = update.header()

        def frame(index: int, length: int) -> bytes:
            bar.update(length)  # called once per piece, as it is sent
            return update_frame(header, index, length)

        header.total_bytes, messages = codec.encode_in_pieces(update.weights, UPDATE_CHUNK_BYTES, frame)
        quiet = not progress or header.total_bytes < PROGRESS_MIN_BYTES
        with tqdm(
            total=header.total_bytes,
            unit="B",
            unit_scale=True,
            desc=f"policy v{update.version}",
            disable=quiet,
        ) as bar:
            return self._update_weights(messages, **self._options({}))

    update_weights = from_weights(push)

    def init_weight_sync(self, **options) -> WeightSyncGroup:
        """Join this server to a new weight-sync group with this process as the trainer's rank 0
        (``rollout_client.weight_sync.WeightSyncGroup`` takes the options); ``update_weights`` of
        the group then broadcasts to every rank of the server."""
        return WeightSyncGroup([self], **options)

    def load_weights(
        self, path: str, version: int, kind: str | None = None, adapter_name: str = "", target: str = ""
    ) -> rollout_pb2.LoadWeightsResponse:
        """Have the server load policy weights from ``path`` under its ``--weights-root``: a
        .safetensors file, a diffusers model or pipeline folder, or a PEFT adapter folder (the kind is
        inferred unless given; "subset" must be said)."""
        request = rollout_pb2.LoadWeightsRequest(
            policy_version=version,
            path=str(path),
            kind=WEIGHTS_KINDS[kind] if kind else rollout_pb2.WEIGHTS_KIND_UNSPECIFIED,
            adapter_name=adapter_name,
            target=target,
        )
        return self.call("LoadWeights", request)

    def release_memory(self) -> rollout_pb2.MemoryResidency:
        """Have the server release its weights' memory (ReleaseMemory) for a trainer on the same
        devices: it answers once the rollouts admitted before have finished and the memory is free,
        and refuses rollouts (UNAVAILABLE) until ``resume_memory``. A no-op when released already."""
        return self.call("ReleaseMemory", rollout_pb2.ReleaseMemoryRequest()).residency

    def resume_memory(self) -> rollout_pb2.MemoryResidency:
        """Have the server put its released weights back (ResumeMemory): the same bytes and policy
        version; rollouts are admitted again. A no-op when nothing is released."""
        return self.call("ResumeMemory", rollout_pb2.ResumeMemoryRequest()).residency

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
