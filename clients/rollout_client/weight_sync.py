"""``WeightSyncGroup``: the trainer's side of a weight-sync group, where one broadcast reaches every
rank of every server.

The trainer process is rank 0 of the group: it hosts the group's store (a torch.distributed
TCPStore) and is the source of every broadcast. ``WeightSyncGroup(clients, ...)`` has each server join
with InitWeightSync (a server with N sequence-parallel ranks takes N consecutive group ranks), then
``push`` (or ``update_weights``) sends each server the manifest, waits until all are ready, tells
them to start, and broadcasts the tensors in buckets (``rollout_core.buckets``): one collective per
bucket reaches every server at once, however many there are.

The group has no authentication of its own: keep the trainer and the servers on a private network
(docs/security.md). Its RPCs take the servers' admin token.

A data-parallel or FSDP trainer calls this on one rank: the weights must be whole tensors in that
process. With FSDP2 or any DTensor state dict, ``full_tensors`` gathers them first (a collective of
the trainer's own group: every trainer rank calls it, and rank 0 pushes).
"""

import collections
import datetime
import logging
import queue
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import torch
import torch.distributed as dist

from rollout.v1 import rollout_pb2
from rollout_client.updates import WeightsUpdate, from_weights
from rollout_core import buckets, checksum
from rollout_core.dtypes import SAFETENSORS_NAMES

if TYPE_CHECKING:
    from rollout_client.client import RolloutClient

log = logging.getLogger("rollout_client.weight_sync")

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
IN_FLIGHT = 2  # broadcasts posted at once: the trainer packs the next bucket while one is sent
DEFAULT_TIMEOUT = 120.0


class ChecksumMismatch(RuntimeError):
    """A server reports serving weights whose checksum is not the trainer's."""


@dataclass
class Outcome:
    """One server's part in a group update: what it applied, or the error it answered."""

    applied: rollout_pb2.GroupUpdateApplied | None = None
    error: grpc.RpcError | None = None


def full_tensors(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``state_dict`` with every DTensor (FSDP2, tensor parallelism) gathered to a whole tensor;
    plain tensors are detached as they are. Gathering is a collective: call it on every trainer rank."""
    return {
        name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()
        for name, tensor in state_dict.items()
    }


class _Call:
    """One server's UpdateWeightsFromGroup call: requests go in through a queue. The manifest names
    the group as that server knows it (the id its InitWeightSync answered)."""

    def __init__(self, client: "RolloutClient", manifest: rollout_pb2.GroupUpdateManifest, group_id: str):
        named = rollout_pb2.GroupUpdateManifest(group_id=group_id)
        named.MergeFrom(manifest)
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(rollout_pb2.UpdateWeightsFromGroupRequest(manifest=named))
        self._responses = client.call("UpdateWeightsFromGroup", iter(self._requests.get, None))

    def answer(self) -> rollout_pb2.UpdateWeightsFromGroupResponse:
        return next(self._responses)

    def start(self) -> None:
        self._requests.put(rollout_pb2.UpdateWeightsFromGroupRequest(start=rollout_pb2.GroupUpdateStart()))

    def end(self) -> None:
        """Close the request stream (before ``start``: the server drops the update)."""
        self._requests.put(None)


class WeightSyncGroup:
    """A torch.distributed group of this trainer process (rank 0) and every rank of ``clients``'
    servers, for full-speed weight updates.

    >>> group = WeightSyncGroup([client], master_address="10.0.3.1")
    >>> group.update_weights(transformer.state_dict(), version=1)  # every rank checked, checksum too
    >>> group.close()

    ``master_address``: this host's address as the servers reach it (the store and gloo's
    connections bind to it); ``master_port`` 0 picks a free one. ``backend``: "gloo" (host buffers;
    CPU servers) or "nccl" (the tensors' CUDA device). ``timeout``: seconds any collective may take,
    the rendezvous included; a server's update fails after it, keeping its previous weights.
    ``bucket_bytes``: tensors are broadcast in buckets of about this size (a larger tensor goes alone,
    without a copy).
    """

    def __init__(
        self,
        clients: Sequence["RolloutClient"],
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str = "gloo",
        timeout: float = DEFAULT_TIMEOUT,
        group_name: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        if not clients:
            raise ValueError("a weight-sync group needs at least one server")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.clients, self.backend, self.bucket_bytes = list(clients), backend, bucket_bytes
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self.group_name = group_name or f"rollout-weights-{uuid.uuid4().hex[:12]}"
        self.infos = [client.server_info() for client in self.clients]
        self.rank_offsets, offset = [], 1
        for info in self.infos:
            self.rank_offsets.append(offset)
            offset += info.sp_degree or 1
        self.world_size = offset
        delta = datetime.timedelta(seconds=timeout)
        self._store = dist.TCPStore(master_address, master_port, None, True, delta, wait_for_workers=False)
        self.master_address, self.master_port, self.timeout = master_address, self._store.port, timeout
        prefixed = dist.PrefixStore(f"{self.group_name}/", self._store)
        # The trainer's rendezvous and every server's InitWeightSync run at once; a server that
        # refuses (a bad option, another update in progress) ends the wait at once, not at the timeout.
        created: Future = Future()

        def create() -> None:
            try:
                created.set_result(self._create_group(prefixed, delta))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                created.set_exception(error)

        threading.Thread(target=create, name="weight-sync-rendezvous", daemon=True).start()
        executor = ThreadPoolExecutor(len(self.clients), thread_name_prefix="weight-sync-join")
        joins = [executor.submit(self._join, k) for k in range(len(self.clients))]
        executor.shutdown(wait=False)
        done, _ = futures.wait([*joins, created], return_when=futures.FIRST_EXCEPTION)
        failed = [future.exception() for future in (*joins, created) if future in done and future.exception()]
        if failed:
            self._group = self._store = None
            raise failed[0]  # a server's answer first: it says why
        self._group = created.result()
        # Each server's id for this group: its updates name it, and a server that answers another id
        # (or none) in GetServerInfo has left the group (``joined``).
        self.group_ids = [join.result().group.group_id for join in joins]

    def _join(self, index: int) -> rollout_pb2.InitWeightSyncResponse:
        client = self.clients[index]
        request = rollout_pb2.InitWeightSyncRequest(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=self.world_size,
            rank_offset=self.rank_offsets[index],
            group_name=self.group_name,
            backend=self.backend,
            timeout_seconds=self.timeout,
        )
        return client.call("InitWeightSync", request)

    def _create_group(self, store, timeout: datetime.timedelta):
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, 0, self.world_size, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.master_address)]
        return dist.ProcessGroupGloo(store, 0, self.world_size, options)

    def push(
        self, update: WeightsUpdate, expect_checksum: str | None = None
    ) -> list[rollout_pb2.GroupUpdateApplied]:
        """Broadcast ``update`` to every server of the group; returns each server's answer once all
        applied it. Kinds, dtypes, versions and targets as for ``RolloutClient.push``.

        Every rank of every server must report the same ``weights_checksum``: ``expect_checksum``
        when given, else, for a FULL update of a model whose only transformer it replaces, the
        checksum of the update's tensors themselves (ChecksumMismatch otherwise). A server that
        refuses or fails raises its gRPC error (see ``push_outcomes``)."""
        outcomes = self.push_outcomes(update, expect_checksum)
        for outcome in outcomes:
            if outcome.error is not None:
                raise outcome.error
        return [outcome.applied for outcome in outcomes]

    update_weights = from_weights(push)

    def push_outcomes(self, update: WeightsUpdate, expect_checksum: str | None = None) -> list[Outcome]:
        """``push``, with each server's outcome instead of the first error. When a server refuses the
        manifest, nothing is broadcast and the others drop the update (ABORTED); when a broadcast
        fails, every server keeps its previous weights and leaves the group."""
        if self._group is None:
            raise RuntimeError("the weight-sync group broke in an earlier update: create a new one")
        tensors = {name: tensor.detach() for name, tensor in full_tensors(update.weights).items()}
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        assigned = buckets.assign(sizes, self.bucket_bytes)
        manifest = rollout_pb2.GroupUpdateManifest(
            header=update.header(),
            tensors=[
                rollout_pb2.GroupTensor(
                    name=name, dtype=SAFETENSORS_NAMES[t.dtype], shape=list(t.shape), bucket=bucket
                )
                for (name, t), bucket in zip(tensors.items(), assigned, strict=True)
            ],
        )
        full = update.resolved_kind == "full"
        if expect_checksum is None and full and self._replaces_whole_policy(update.target):
            expect_checksum = checksum.weights_checksum(
                checksum.policy_tensors({update.target or "transformer": tensors})
            )
        calls = [_Call(client, manifest, k) for client, k in zip(self.clients, self.group_ids, strict=True)]
        outcomes = [Outcome() for _ in calls]
        with ThreadPoolExecutor(len(calls)) as executor:
            answers = list(executor.map(_answer, calls))
        for outcome, answer in zip(outcomes, answers, strict=True):
            if isinstance(answer, grpc.RpcError):
                outcome.error = answer
        if any(outcome.error for outcome in outcomes):
            for call, outcome in zip(calls, outcomes, strict=True):
                call.end()
                if outcome.error is None:  # it was ready: it drops the update now
                    outcome.error = _answer(call)
            return outcomes
        for call in calls:
            call.start()
        try:
            self._broadcast(list(tensors.values()), buckets.layout(sizes, assigned))
        except Exception as error:  # noqa: BLE001 - the servers' answers say what happened to them
            log.warning("the broadcast failed, and the group with it: %s", error)
            self._group = None
        for call in calls:
            call.end()
        with ThreadPoolExecutor(len(calls)) as executor:
            answers = list(executor.map(_answer, calls))
        for outcome, answer in zip(outcomes, answers, strict=True):
            if isinstance(answer, grpc.RpcError):
                outcome.error = answer
            else:
                outcome.applied = answer.applied
        served = {c for o in outcomes if o.applied is not None for c in o.applied.rank_checksums}
        if (expect_checksum is not None and served - {expect_checksum}) or len(served) > 1:
            raise ChecksumMismatch(
                f"the servers report {sorted(served)} after the update; expected {expect_checksum or 'one'}"
            )
        return outcomes

    update = from_weights(push_outcomes)

    def joined(self) -> list[bool]:
        """Whether each server is still in this group (one that restarted, or joined another, is
        not): its GetServerInfo names the group's id (and name: a server older than ids gives none)."""
        joined = []
        for client, group_id in zip(self.clients, self.group_ids, strict=True):
            info = client.server_info().weight_sync
            joined.append((info.group_id, info.group_name) == (group_id, self.group_name))
        return joined

    def _replaces_whole_policy(self, target: str) -> bool:
        return all(list(info.transformers) == [target or "transformer"] for info in self.infos)

    def _broadcast(self, tensors: list[torch.Tensor], layout: list[buckets.Bucket]) -> None:
        """Every bucket, in order, from this process (the group's rank 0): the next bucket is packed
        while the one before is in flight, and at most ``IN_FLIGHT`` are."""
        in_flight: collections.deque = collections.deque()
        for bucket in layout:
            first = tensors[bucket.tensors[0].index]
            if len(bucket.tensors) == 1 and first.is_contiguous() and first.device == self.device:
                buffer = first.reshape(-1).view(torch.uint8)  # a tensor alone: no copy
            else:
                buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
                end = 0
                for placed in bucket.tensors:
                    buffer[end : placed.offset].zero_()  # the padding before it
                    data = tensors[placed.index].contiguous().reshape(-1).view(torch.uint8)
                    buffer[placed.offset : placed.offset + placed.nbytes].copy_(data)
                    end = placed.offset + placed.nbytes
            if len(in_flight) == IN_FLIGHT:
                in_flight.popleft().wait()
            in_flight.append(self._group.broadcast([buffer], dist.BroadcastOptions()))
        while in_flight:
            in_flight.popleft().wait()

    def close(self) -> None:
        """Have every server leave the group (DestroyWeightSync), then leave it."""
        try:
            with ThreadPoolExecutor(len(self.clients)) as executor:
                list(executor.map(_destroy, self.clients))
        finally:
            self._group = self._store = None

    def __enter__(self) -> "WeightSyncGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _answer(call: _Call) -> rollout_pb2.UpdateWeightsFromGroupResponse | grpc.RpcError:
    try:
        return call.answer()
    except grpc.RpcError as error:
        return error
    except StopIteration:  # the call ended with OK before answering: not a server of this protocol
        raise RuntimeError("the server ended UpdateWeightsFromGroup without an answer") from None


def _destroy(client: "RolloutClient") -> None:
    client.call("DestroyWeightSync", rollout_pb2.DestroyWeightSyncRequest())
