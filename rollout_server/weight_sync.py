"""The weight-sync group's lifecycle on every rank of the server: join, install, update, leave.

    no group --join--> joining --install--> joined --update--> joined ... --leave or close--> no group

* **join** (InitWeightSync) is no barrier. Between two rounds (a side job) every rank leaves its
  group, gives up a join still pending, and starts joining the new one on a thread of its own
  (``parallel.sync_group.PendingJoin``), so rounds go on while the ranks rendezvous.
* **install**: once rank 0's join ended or its deadline passed, every rank installs the group it
  joined, between two later rounds, if all of them joined it; otherwise no group is left
  (``WeightSyncFailed``).
* **update** (UpdateWeightsFromGroup): at the update's barrier, once the trainer starts, every rank
  receives the broadcasts (``weights.group.receive``) and the policy applies them on every rank
  (``Policy.apply_received``). A broadcast that fails anywhere leaves every rank's weights as they
  were and every rank out of the group.
* **leave** (DestroyWeightSync): every rank leaves, between rollouts; ``close`` leaves at shutdown.

Rank 0 drives each step from the engine's worker and broadcasts it (``protocol.SYNC_COMMANDS``); the
other ranks ``follow`` the commands in rank 0's order. The failures every rank meets alike are rank
0's to report.
"""

import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_server.errors import NoWeightSyncGroup, UpdateAbandoned, WeightSyncFailed
from rollout_server.parallel.protocol import HEARTBEAT, SYNC_INSTALL, SYNC_JOIN, SYNC_LEAVE, SYNC_UPDATE
from rollout_server.parallel.sync_group import (
    MAX_STUCK_JOINS,
    PendingJoin,
    WeightSync,
    WeightSyncOptions,
    stuck_joins,
)
from rollout_server.validation import quoted
from rollout_server.weights import group

if TYPE_CHECKING:
    from rollout_server.parallel import SequenceParallel
    from rollout_server.policy import Policy
    from rollout_server.scheduler import Scheduler


@dataclass(frozen=True)
class GroupApplied:
    """What a group update did, beyond what UpdateWeights reports."""

    transfer_seconds: float  # the broadcasts alone
    total_tensors: int  # of the target (or its adapter layout) for this kind
    rank_checksums: list[str]  # the served checksum as each rank computed it, rank 0 first


class GroupMembership:
    """This rank's part in a trainer's weight-sync group: the group joined (none at first) and a join
    still pending. On rank 0 the front ends' calls queue each step on the ``scheduler``; the other
    ranks ``follow`` rank 0's commands. ``check_resident`` raises MemoryReleased while the weights'
    memory is released (an update waits for it)."""

    def __init__(
        self,
        parallel: "SequenceParallel",
        policy: "Policy",
        scheduler: "Scheduler",
        device: torch.device,
        check_resident: Callable[[], None],
    ):
        self.parallel = parallel
        self.policy = policy
        self.scheduler = scheduler
        self.device = device  # the server's: which backends a group may use
        self._check_resident = check_resident
        self.joined: WeightSync | None = None
        self._pending: PendingJoin | None = None

    @property
    def options(self) -> WeightSyncOptions | None:
        """The group joined, if any."""
        return None if self.joined is None else self.joined.options

    # Rank 0: what the front ends call.

    def check_init(self, request: rollout_pb2.InitWeightSyncRequest) -> WeightSyncOptions:
        """The options of an InitWeightSync request for this server's ranks; InvalidRequest naming
        every bad field."""
        rank_timeout = self.parallel.timeout_seconds if self.parallel.enabled else None
        return group.parse_init(request, self.parallel.degree, self.device, rank_timeout)

    def join(self, options: WeightSyncOptions) -> Future:
        """Have every rank join a weight-sync group without holding a rollout: the ranks start joining
        between two rounds, each on a thread of its own, and install the group between two later
        rounds, once rank 0's join ended or ``options.timeout_seconds`` passed. The future ends once
        every rank installed it; WeightSyncFailed (no group is left) if any could not, in time."""
        joined: Future = Future()
        if (stuck := stuck_joins()) >= MAX_STUCK_JOINS:
            joined.set_exception(
                WeightSyncFailed(f"{stuck} earlier joins still wait on stores that never answer; retry later")
            )
            return joined

        def coordinate() -> None:
            try:
                pending = self.scheduler.submit_side_job(functools.partial(self._start_join, options))
                pending.result().wait_finished()
                install = functools.partial(self._install, options.group_id)
                joined.set_result(self.scheduler.submit_side_job(install).result())
            except BaseException as error:  # noqa: BLE001 - the caller's future carries it
                joined.set_exception(error)

        threading.Thread(target=coordinate, name="weight-sync-join", daemon=True).start()
        return joined

    def leave(self) -> Future:
        """Every rank leaves its weight-sync group, between rollouts; the future says whether there
        was one."""
        return self.scheduler.submit_update(self._leave)

    def check_update(self, message: rollout_pb2.GroupUpdateManifest) -> group.GroupManifest:
        """The manifest of a group update, checked whole against the current weights (InvalidRequest
        naming its field, StaleUpdate, NoWeightSyncGroup, MemoryReleased): off the event loop, as
        ``Policy.check``."""
        self._check_resident()
        self._check_group(message.group_id)
        manifest = group.parse_manifest(message, self.policy.spec.max_update_bytes)
        self.policy.check(manifest.update, prefix="manifest.")
        return manifest

    def update(self, manifest: group.GroupManifest, on_ready: Callable[[], None], start: Future) -> Future:
        """Queue a checked group update. At its barrier the version is checked again, ``on_ready()``
        is called, and the worker waits for ``start`` (True: the trainer broadcasts now; False, or
        nothing within the group's timeout: UpdateAbandoned); then every rank receives and applies
        it. The future ends with a ``GroupApplied``, or the failure."""

        def run() -> GroupApplied:
            self._check_resident()
            self._check_group(manifest.message.group_id)
            self.policy.check(manifest.update, prefix="manifest.")
            on_ready()
            self._wait_for_start(start)
            self.parallel.broadcast_command(SYNC_UPDATE, manifest.message.SerializeToString())
            seconds = self._receive_on_every_rank(manifest)
            total = self.policy.expected_tensors(manifest.update)
            return GroupApplied(seconds, total, list(self.policy.rank_checksums))

        return self.scheduler.submit_update(run)

    # Rank 0, on the engine's worker between two rounds.

    def _check_group(self, group_id: str) -> None:
        """NoWeightSyncGroup unless the server is in the group ``group_id`` names (a manifest without
        one comes from a client older than the field: it is taken for the group joined)."""
        sync = self.joined
        if sync is None:
            raise NoWeightSyncGroup("the server is in no weight-sync group: call InitWeightSync first")
        if group_id and group_id != sync.options.group_id:
            raise NoWeightSyncGroup(
                f"manifest.group_id {quoted(group_id)} names a group this server is no longer in (it is in "
                f"weight-sync group {sync.options.group_name!r} now): the update is refused"
            )

    def _start_join(self, options: WeightSyncOptions) -> PendingJoin:
        """Every rank leaves its group (and any join still pending) and starts joining the group
        ``options`` describes. Returns rank 0's join."""
        self.parallel.broadcast_command(SYNC_JOIN, json.dumps(dataclasses.asdict(options)).encode())
        return self._start_join_here(options)

    def _install(self, group_id: str) -> None:
        """Once rank 0's own join ended or its deadline passed: every rank installs the group it
        joined, if all of them joined it; WeightSyncFailed, with no group left, otherwise. The ranks
        join at the same rendezvous, so when rank 0's join ended the others' have too (or end within
        their deadline); when rank 0's failed, they give theirs up at once."""
        pending = self._pending
        if pending is None or pending.options.group_id != group_id:
            raise WeightSyncFailed("the join was replaced by a later InitWeightSync or a DestroyWeightSync")
        self._pending = None
        try:
            joined, failure = pending.result(), None
        except WeightSyncFailed as error:
            joined, failure = None, error
        self.parallel.broadcast_command(SYNC_INSTALL, json.dumps(failure is None).encode())
        self._install_here(joined, failure)

    def _leave(self) -> bool:
        """Every rank leaves the weight-sync group; whether there was one."""
        self.parallel.broadcast_command(SYNC_LEAVE)
        return self._leave_here()

    def _wait_for_start(self, start: Future) -> None:
        """Wait for the trainer's start (the other ranks get heartbeats meanwhile)."""
        sync = self.joined
        deadline = time.monotonic() + sync.options.timeout_seconds
        while True:
            try:
                started = start.result(
                    timeout=min(self.parallel.timeout_seconds / 4, sync.options.timeout_seconds)
                )
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    started = False
                    break
                self.parallel.broadcast_command(HEARTBEAT)
        if not started:
            raise UpdateAbandoned("the trainer did not start the group update: nothing was received")

    # The other ranks: rank 0's commands, in its order.

    def follow(self, command: str, payload: bytes) -> None:
        """Run one of rank 0's ``protocol.SYNC_COMMANDS`` on this rank."""
        steps = {
            SYNC_JOIN: self._follow_join,
            SYNC_INSTALL: self._follow_install,
            SYNC_UPDATE: self._follow_update,
            SYNC_LEAVE: self._follow_leave,
        }
        steps[command](payload)

    def _follow_join(self, payload: bytes) -> None:
        self._start_join_here(WeightSyncOptions(**json.loads(payload)))

    def _follow_install(self, payload: bytes) -> None:
        # Commands arrive in rank 0's order: this rank's pending join is the one rank 0 installs.
        pending, self._pending = self._pending, None
        joined, failure = None, WeightSyncFailed("rank 0 of the server could not join the group")
        if pending is None:
            failure = WeightSyncFailed(f"rank {self.parallel.rank} has no join pending")
        elif json.loads(payload):
            try:
                joined, failure = pending.result(), None
            except WeightSyncFailed as error:
                failure = error
        else:
            pending.abandon()
        self._install_here(joined, failure)

    def _follow_update(self, payload: bytes) -> None:
        message = rollout_pb2.GroupUpdateManifest.FromString(payload)
        self._receive_on_every_rank(group.parse_manifest(message, self.policy.spec.max_update_bytes))

    def _follow_leave(self, payload: bytes) -> None:
        self._leave_here()

    # Every rank.

    def close(self) -> None:
        """Leave the group, and give up a join still pending (at shutdown, on this rank alone)."""
        self._leave_here()

    def _start_join_here(self, options: WeightSyncOptions) -> PendingJoin:
        self._leave_here()
        self._pending = PendingJoin(options, options.rank_offset + self.parallel.rank, self.policy.device)
        return self._pending

    def _install_here(self, joined: WeightSync | None, failure: WeightSyncFailed | None) -> None:
        if not self.parallel.all_succeeded(failure is None):
            if joined is not None:
                joined.close()
            raise failure or WeightSyncFailed("another rank of the server could not join the group")
        self.joined = joined

    def _leave_here(self) -> bool:
        """Leave the group joined, and give up a join still pending; whether there was a group."""
        if self._pending is not None:
            self._pending.abandon()
            self._pending = None
        sync, self.joined = self.joined, None
        if sync is not None:
            sync.close()
        return sync is not None

    def _receive_on_every_rank(self, manifest: group.GroupManifest) -> float:
        """Receive the trainer's broadcasts here and learn whether every rank did, then apply them on
        every rank. Returns the seconds the broadcasts took."""
        started_at = time.perf_counter()
        received, failure = None, None
        try:
            served_as_received = self.joined.device == self.policy.device
            received = group.receive(self.joined, manifest, served_as_received)
        except Exception as error:  # noqa: BLE001 - leaving the group below ends the trainer's broadcast
            failure = error
        if not self.parallel.all_succeeded(failure is None):
            self._leave_here()  # the group's state is unknown after a failed collective
            raise failure or WeightSyncFailed("the broadcast failed on another rank of the server")
        seconds = time.perf_counter() - started_at
        if received.non_finite is not None:  # alike on every rank: the same bytes arrived
            raise received.non_finite
        self.policy.apply_received(received.update, received.lines)
        return seconds
