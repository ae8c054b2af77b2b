"""``RolloutClient``: call a rollout server, get typed events or whole trajectories, prune trees,
push weights."""

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import torch
from tqdm import tqdm

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client.channel import DEFAULT_RETRY, RetryPolicy, base_options, previous_attempts
from rollout_client.credentials import TLS, bearer_metadata
from rollout_client.events import Event, Started, decode_stream
from rollout_client.source import as_request
from rollout_client.trajectory import Trajectory, collect
from rollout_core import codec

if TYPE_CHECKING:
    from rollout_client.weight_sync import WeightSyncGroup

# Weight update pieces: well below the server's 4 MiB receive limit, and in the 1-4 MiB range where
# Python gRPC moves bytes fastest.
UPDATE_CHUNK_BYTES = 1024 * 1024
# Updates at least this large get a progress bar (when asked for).
PROGRESS_MIN_BYTES = 32 * 1024 * 1024
WEIGHTS_KINDS = {
    "full": rollout_pb2.WEIGHTS_KIND_FULL,
    "subset": rollout_pb2.WEIGHTS_KIND_SUBSET,
    "lora": rollout_pb2.WEIGHTS_KIND_LORA,
}


def lora_config_json(config: Any) -> str:
    """A peft ``LoraConfig`` (or its dict) as the JSON an update's header carries (sets as lists)."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)

    def listed(value: Any) -> list:
        if isinstance(value, set | frozenset):
            return sorted(value)
        raise TypeError(f"{type(value).__name__} in a LoraConfig is not JSON serialisable")

    return json.dumps(values, default=listed)


def resolve_kind(kind: str | None, lora_config: Any) -> str:
    """An update's kind ("full", "subset" or "lora"): as given, else "lora" with a LoRA config and
    "full" without."""
    return kind or ("lora" if lora_config is not None else "full")


def update_header(
    version: int, kind: str | None, lora_config: Any, adapter_name: str, target: str
) -> rollout_pb2.WeightsUpdateHeader:
    """The header of an update (UpdateWeights, or a group update's manifest)."""
    return rollout_pb2.WeightsUpdateHeader(
        policy_version=version,
        kind=WEIGHTS_KINDS[resolve_kind(kind, lora_config)],
        lora_config_json=lora_config_json(lora_config) if lora_config is not None else "",
        adapter_name=adapter_name,
        target=target,
    )


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
        # UpdateWeights with messages the client frames itself (see update_frame).
        self._update_weights = self.channel.stream_unary(
            UPDATE_WEIGHTS_METHOD, response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString
        )

    def server_info(self) -> rollout_pb2.GetServerInfoResponse:
        return self.stub.GetServerInfo(
            rollout_pb2.GetServerInfoRequest(), timeout=self.timeout, metadata=self.metadata
        )

    def stream(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> Iterator[Event]:
        """Typed events of one rollout as they arrive; closing the iterator cancels the rollout."""
        call = self.stub.Rollout(as_request(request, fields), timeout=self.timeout, metadata=self.metadata)
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
        return self.stub.PruneRollout(request, timeout=self.timeout, metadata=self.metadata)

    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        version: int,
        kind: str | None = None,
        lora_config: Any = None,
        adapter_name: str = "",
        progress: bool = True,
        target: str = "",
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Stream new policy weights to the server; returns once they are applied.

        ``weights`` is the transformer's state dict (kind "full"), some of its tensors ("subset"), or
        a PEFT LoRA adapter, ``peft.get_peft_model_state_dict(transformer)``, with its ``lora_config``
        (kind "lora", the default when a config is given). Tensors must have the server model's
        dtypes. ``version`` must be above the server's policy version: rollouts that start after
        this call returns report it. A progress bar counts the bytes sent of a large update.
        ``target`` names the transformer it changes when the model has several (Wan 2.2:
        "transformer_2" for the low-noise expert; GetServerInfo lists them).
        """
        header = update_header(version, kind, lora_config, adapter_name, target)

        def frame(index: int, length: int) -> bytes:
            bar.update(length)  # called once per piece, as it is sent
            return update_frame(header, index, length)

        header.total_bytes, messages = codec.encode_in_pieces(weights, UPDATE_CHUNK_BYTES, frame)
        quiet = not progress or header.total_bytes < PROGRESS_MIN_BYTES
        with tqdm(
            total=header.total_bytes, unit="B", unit_scale=True, desc=f"policy v{version}", disable=quiet
        ) as bar:
            return self._update_weights(messages, timeout=self.timeout, metadata=self.metadata)

    def init_weight_sync(self, **options) -> "WeightSyncGroup":
        """Join this server to a new weight-sync group with this process as the trainer's rank 0
        (``rollout_client.weight_sync.WeightSyncGroup`` takes the options); ``update_weights`` of
        the group then broadcasts to every rank of the server."""
        from rollout_client.weight_sync import WeightSyncGroup

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
        return self.stub.LoadWeights(request, timeout=self.timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
