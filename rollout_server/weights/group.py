"""UpdateWeightsFromGroup: a manifest checked whole before any byte moves, then the trainer's bucket
broadcasts received into fresh buffers on every rank.

The manifest (names, dtypes, shapes, buckets) becomes a ``WeightUpdate`` whose tensors live on the
meta device, so the same checks as for UpdateWeights run on it (``spec.check``) without a byte
received. Receiving allocates one uint8 buffer per bucket, uninitialised, and the tensors are views
of it in their own dtypes (``rollout_core.buckets`` aligns them): no copy, and the buffers become the
parameters' data when the update is applied.
"""

import dataclasses
import math
import re
import secrets
from dataclasses import dataclass

import torch

from rollout.v1 import rollout_pb2
from rollout_core import buckets, checksum
from rollout_core.dtypes import BY_SAFETENSORS
from rollout_server.errors import InvalidRequest
from rollout_server.parallel.sync_group import WeightSync, WeightSyncOptions
from rollout_server.validation import quoted
from rollout_server.weights.spec import check_finite
from rollout_server.weights.update import LORA, WeightUpdate, from_header, reject
from rollout_server.weights.upload import MAX_DIM, MAX_DIMS

FIELD = "manifest"
MAX_TENSORS = 2**17
MAX_NAME_CHARS = 1024
MAX_WORLD_SIZE = 4096
DEFAULT_TIMEOUT_SECONDS = 120.0
# A join needs every rank of the group at one rendezvous, and a bucket's broadcast a model's worth
# of bytes at network speed: seconds, or minutes for the largest models on gloo. Waiting for the
# trainer's start holds rollouts at the update's barrier, so the bound stays at minutes.
MAX_TIMEOUT_SECONDS = 300.0
BACKENDS = ("gloo", "nccl")
HOST_CHARACTERS = re.compile(r"[A-Za-z0-9.:\-]{1,253}")
GROUP_NAME = re.compile(r"[A-Za-z0-9._\-]{1,64}")


def parse_init(
    request: rollout_pb2.InitWeightSyncRequest, ranks: int, device: torch.device, max_timeout: float | None
) -> WeightSyncOptions:
    """The options of an InitWeightSync request for a server of ``ranks`` ranks on ``device``, with a
    fresh group id that every update over the group must name; InvalidRequest naming every bad field.
    ``max_timeout``: under sequence parallelism the group's collectives must end within the ranks' own
    collective timeout."""
    bad = []
    if not HOST_CHARACTERS.fullmatch(request.master_address):
        bad.append(("master_address", "must be a host name or IP address (letters, digits, '.', ':', '-')"))
    if not 1 <= request.master_port <= 65535:
        bad.append(("master_port", f"must be in [1, 65535], got {request.master_port}"))
    if not ranks < request.world_size <= MAX_WORLD_SIZE:
        bad.append(
            (
                "world_size",
                f"must be in [{ranks + 1}, {MAX_WORLD_SIZE}] (the trainer and this server's {ranks} ranks)",
            )
        )
    elif not 1 <= request.rank_offset <= request.world_size - ranks:
        bad.append(("rank_offset", f"must be in [1, {request.world_size - ranks}] for {ranks} ranks"))
    if not GROUP_NAME.fullmatch(request.group_name):
        bad.append(("group_name", "must be 1 to 64 letters, digits, '.', '_' or '-'"))
    backend = request.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in BACKENDS:
        bad.append(("backend", f"must be gloo or nccl, got {quoted(request.backend)}"))
    elif backend == "nccl" and device.type != "cuda":
        bad.append(("backend", f"nccl needs a CUDA server; this one runs on {device.type}"))
    timeout = request.timeout_seconds or DEFAULT_TIMEOUT_SECONDS
    limit = min(MAX_TIMEOUT_SECONDS, max_timeout or MAX_TIMEOUT_SECONDS)
    if not 0 < timeout <= limit:  # NaN fails too
        bad.append(("timeout_seconds", f"must be in (0, {limit:g}], got {request.timeout_seconds}"))
    if bad:
        raise InvalidRequest(bad)
    return WeightSyncOptions(
        master_address=request.master_address,
        master_port=request.master_port,
        world_size=request.world_size,
        rank_offset=request.rank_offset,
        group_name=request.group_name,
        backend=backend,
        timeout_seconds=timeout,
        group_id=secrets.token_hex(8),
    )


def group_proto(options: WeightSyncOptions, ranks: int) -> rollout_pb2.WeightSyncGroup:
    return rollout_pb2.WeightSyncGroup(ranks=ranks, **dataclasses.asdict(options))


@dataclass(frozen=True)
class GroupManifest:
    """A parsed manifest: the update it announces (meta tensors), and its buckets."""

    message: rollout_pb2.GroupUpdateManifest
    update: WeightUpdate
    buckets: list[buckets.Bucket]

    @property
    def wire_bytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)


def parse_manifest(message: rollout_pb2.GroupUpdateManifest, max_bytes: int) -> GroupManifest:
    """The manifest's update, every tensor entry checked for what it is (InvalidRequest naming
    ``manifest.tensors[i]...``); whether the transformer holds such tensors is ``spec.check``'s."""
    if len(message.tensors) > MAX_TENSORS:
        raise reject(f"{FIELD}.tensors", f"at most {MAX_TENSORS} tensors, got {len(message.tensors)}")
    tensors: dict[str, torch.Tensor] = {}
    for i, entry in enumerate(message.tensors):
        where = f"{FIELD}.tensors[{i}]"
        if not 0 < len(entry.name) <= MAX_NAME_CHARS or not entry.name.isprintable():
            raise reject(f"{where}.name", f"must be 1 to {MAX_NAME_CHARS} printable characters")
        if entry.name in tensors:
            raise reject(f"{where}.name", f"{quoted(entry.name)} is listed twice")
        if entry.dtype not in BY_SAFETENSORS:
            raise reject(
                f"{where}.dtype", f"must be one of {sorted(BY_SAFETENSORS)}, got {quoted(entry.dtype)}"
            )
        if len(entry.shape) > MAX_DIMS or any(n > MAX_DIM for n in entry.shape):
            raise reject(f"{where}.shape", f"must be at most {MAX_DIMS} sizes, each at most 2^40")
        # Zeros aside: torch computes every stride, and [0, 2^40, 2^40] overflows them.
        span = math.prod(max(n, 1) for n in entry.shape) * BY_SAFETENSORS[entry.dtype].itemsize
        if span > max_bytes:
            raise reject(f"{where}.shape", f"its sizes span {span} bytes, above the limit of {max_bytes}")
        tensors[entry.name] = torch.empty(list(entry.shape), dtype=BY_SAFETENSORS[entry.dtype], device="meta")
    sizes = [math.prod(t.shape) * t.dtype.itemsize for t in tensors.values()]
    if sum(sizes) > max_bytes:
        raise reject(
            f"{FIELD}.tensors", f"the tensors hold {sum(sizes)} bytes, above the limit of {max_bytes}"
        )
    try:
        layout = buckets.layout(sizes, [entry.bucket for entry in message.tensors])
    except ValueError as error:
        field, _, description = str(error).partition(" ")
        raise reject(f"{FIELD}.{field}", description) from None
    return GroupManifest(message, from_header(message.header, tensors, sum(sizes)), layout)


@dataclass(frozen=True)
class Received:
    """A group update as this rank received it, and the first of its tensors that is not finite, if
    any (every rank finds the same: the bytes are the same)."""

    update: WeightUpdate
    non_finite: InvalidRequest | None
    lines: dict[str, str]  # the checksum's line of each tensor, by name, when taken as it arrived


def receive(sync: WeightSync, manifest: GroupManifest, served_as_received: bool) -> Received:
    """This rank's copy of the update: every bucket the trainer broadcasts, in order, into a fresh
    buffer. All the receives are posted at once; each bucket's tensors are checked for finite values
    as soon as it is in, while later ones still arrive (every bucket is received even after a bad
    tensor: a rank that stopped midway would leave the trainer's broadcasts hanging). When the
    received tensors are what will be served (``served_as_received``: they are on the model's
    device), each one's checksum line is taken then too. WeightSyncFailed if a broadcast fails or
    times out."""
    entries = list(manifest.update.tensors.items())
    buffers = [
        torch.empty(bucket.nbytes, dtype=torch.uint8, device=sync.device) for bucket in manifest.buckets
    ]
    pending = [sync.post_broadcast(buffer) for buffer in buffers]
    tensors, lines, non_finite = {}, {}, None
    prefix = f"{manifest.update.target}/{'lora/' if manifest.update.kind == LORA else ''}"
    for bucket, buffer, work in zip(manifest.buckets, buffers, pending, strict=True):
        sync.wait(work)
        for placed in bucket.tensors:
            name, meta = entries[placed.index]
            piece = buffer[placed.offset : placed.offset + placed.nbytes]
            tensors[name] = tensor = piece.view(meta.dtype).reshape(meta.shape)
            try:
                check_finite(name, tensor)
            except InvalidRequest as error:
                non_finite = non_finite or error
            if served_as_received and manifest.update.kind != LORA:  # PEFT copies an adapter in
                lines[prefix + name] = checksum.digest_line(prefix + name, tensor)
    return Received(dataclasses.replace(manifest.update, tensors=tensors), non_finite, lines)
