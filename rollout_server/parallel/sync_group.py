"""A rank's weight-sync group with a trainer: a process group of its own, rendezvoused through the
trainer's store (the sequence-parallel world is untouched), joined on a thread of its own so that a
store or a peer that never answers holds that thread alone.

The group's lifecycle on this rank: ``PendingJoin`` forms a ``WeightSync`` (init), whose
``post_broadcast`` and ``wait`` receive the trainer's broadcasts (receive), until ``close`` (destroy).
Which ranks join, install, receive and leave, and when, is ``rollout_server.weight_sync``'s.
"""

import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rollout_server.errors import WeightSyncFailed

log = logging.getLogger("rollout_server.parallel")


@dataclass(frozen=True)
class WeightSyncOptions:
    """Where and how a server's ranks join a trainer's weight-sync group (rollout.v1
    InitWeightSyncRequest, checked)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    group_name: str
    backend: str
    timeout_seconds: float
    group_id: str  # given by the server: every group update names it


class WeightSync:
    """This rank's place in a weight-sync group: a process group of its own (the sequence-parallel
    world is untouched), rendezvoused through the trainer's store under the group's prefix. Rank 0 of
    the group, the trainer, is the source of every broadcast."""

    def __init__(self, options: WeightSyncOptions, rank: int, device: torch.device):
        self.options, self.rank = options, rank
        self.device = device if options.backend == "nccl" else torch.device("cpu")
        timeout = datetime.timedelta(seconds=options.timeout_seconds)
        try:
            # A client of the trainer's store: the server connects out, and listens for no trainer.
            self._store = dist.TCPStore(
                options.master_address,
                options.master_port,
                is_master=False,
                timeout=timeout,
                wait_for_workers=False,
            )
            store = dist.PrefixStore(f"{options.group_name}/", self._store)
            if options.backend == "nccl":
                nccl = dist.ProcessGroupNCCL.Options()
                nccl._timeout = timeout
                self._group = dist.ProcessGroupNCCL(store, rank, options.world_size, nccl)
            else:
                gloo = dist.ProcessGroupGloo._Options()
                gloo._timeout = timeout
                # Pair connections on the interface that reaches the trainer.
                gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=address_towards(options))]
                self._group = dist.ProcessGroupGloo(store, rank, options.world_size, gloo)
        except Exception as error:  # the store or the rendezvous: refused, timed out
            raise WeightSyncFailed(
                f"joining weight-sync group {options.group_name!r} failed: {error}"
            ) from error
        log.info("rank %d of weight-sync group %r joined (%s)", rank, options.group_name, options.backend)

    def post_broadcast(self, buffer: torch.Tensor):
        """Post the receive of the trainer's next broadcast into ``buffer`` (uint8, on
        ``self.device``); ``wait`` for the returned work."""
        return self._group.broadcast([buffer], dist.BroadcastOptions())

    def wait(self, work) -> None:
        """Until a posted broadcast is in; WeightSyncFailed if it failed or timed out."""
        try:
            work.wait()
        except Exception as error:
            raise WeightSyncFailed(
                f"a broadcast of weight-sync group {self.options.group_name!r} failed: {error}"
            ) from error

    def close(self) -> None:
        """Leave the group (its sockets close; the trainer's next collective fails)."""
        self._group = self._store = None


# Joins still blocked past their deadline (a store that accepts and never answers holds its thread
# until the peer closes the socket); more than this many, and InitWeightSync is refused.
MAX_STUCK_JOINS = 4
_joins: list[threading.Thread] = []


def stuck_joins() -> int:
    """How many joins of this process still run (past their deadline, if none is pending)."""
    _joins[:] = [thread for thread in _joins if thread.is_alive()]
    return len(_joins)


class PendingJoin:
    """A ``WeightSync`` being formed on a thread of its own, so that a store or a peer that never
    answers holds that thread alone, never the engine's worker. torch's store client and gloo's
    rendezvous do not all honour their timeout (a store that accepts the connection and never answers
    blocks the handshake until the peer closes it): the deadline, ``timeout_seconds`` from now, is
    kept here. A join abandoned at its deadline closes its group if it ever forms."""

    def __init__(self, options: WeightSyncOptions, rank: int, device: torch.device):
        self.options = options
        self.deadline = time.monotonic() + options.timeout_seconds
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._sync: WeightSync | None = None
        self._error: WeightSyncFailed | None = None
        self._abandoned = False
        thread = threading.Thread(
            target=self._join, args=(rank, device), name=f"weight-sync-join-{options.group_id}", daemon=True
        )
        _joins.append(thread)
        thread.start()

    def _join(self, rank: int, device: torch.device) -> None:
        try:
            sync = WeightSync(self.options, rank, device)
        except WeightSyncFailed as error:
            self._error = error
        else:
            with self._lock:
                if self._abandoned:
                    sync.close()
                else:
                    self._sync = sync
        self._finished.set()

    def wait_finished(self) -> None:
        """Until the join ends or its deadline passes."""
        self._finished.wait(max(0.0, self.deadline - time.monotonic()))

    def result(self) -> WeightSync:
        """The joined group, once joined or the deadline passed; WeightSyncFailed if it failed or is
        not done by then (it is abandoned)."""
        self.wait_finished()
        with self._lock:
            if self._sync is not None:
                return self._sync
            if self._error is not None:
                raise self._error
            self._abandoned = True
        options = self.options
        raise WeightSyncFailed(
            f"joining weight-sync group {options.group_name!r} did not finish within "
            f"{options.timeout_seconds:g} s (timeout_seconds): no answer from the trainer's store at "
            f"{options.master_address}:{options.master_port}, or not every rank of the group arrived"
        )

    def abandon(self) -> None:
        """Give the join up: its group, joined or not yet, is closed."""
        with self._lock:
            self._abandoned = True
            sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()


def address_towards(options: WeightSyncOptions) -> str:
    """This host's address on the route to the trainer's store (no packet is sent)."""
    family, kind, _, _, address = socket.getaddrinfo(
        options.master_address, options.master_port, type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, kind) as probe:
        probe.connect(address)
        return probe.getsockname()[0]
