"""``RolloutPool``: one client over several replicas of the same model, with the surface of
``RolloutClient``.

* **Group-affine routing.** A request's prompt groups (all samples of one prompt) each run whole on
  one replica, the one with the least outstanding samples. The pool fixes every sample's seed before
  it splits the request, the seeds one server would derive from the same base seed, so the noise is
  the same. It then reassembles the trajectories as one server returns them: prompt-major, the same
  request id, sample and prompt indices over the whole request. A tree rollout (a request with
  branches) is not split: it runs whole on one replica, its seeds fixed the same way.
* **Fan-out weight updates.** ``update_weights`` sends the update to every routable replica at once,
  and returns once they have applied it. A replica whose update fails is taken out of routing. The
  pool keeps a snapshot of every update since the last self-contained one (a full update) and replays
  the ones a replica missed, with their versions, before it routes to that replica again.
* **One broadcast for every replica.** ``init_weight_sync`` puts every replica's ranks in one
  torch.distributed group with the trainer; ``update_weights_from_group`` then sends a full model at
  collective speed, once, whatever the number of replicas, under the same version rules.
* **Failover.** A prompt group whose replica fails (it dies, drains, hangs, or reports an internal
  failure) is re-run with the same seeds on another replica, at most ``max_retries`` times per
  group; ``retries`` counts them.
* **Hung replicas.** A replica on which the pool has waited ``stall_seconds`` without receiving
  anything (no message of a rollout, no answer to a call) is hung: a monitor thread cancels all its
  calls (it replaces the replica's channel), so its groups re-run elsewhere and its updates count as
  missed, and it comes back only after a probe rollout completes on it.
* **Health.** A watcher thread per replica checks its gRPC health each ``health_interval`` seconds,
  takes it out of routing when it fails, and re-admits it once it is serving and at the pool's
  policy version. A watcher never waits on a replica's work: replays and probes run in threads of
  their own, one per replica at a time, each call under the stall rule.

Routing only sends work to replicas at the pool's policy version. When none is available, it falls
back to a healthy replica whose version still satisfies the request's ``min_policy_version`` (when
it sets one).
"""

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from rollout.v1 import rollout_pb2
from rollout_client.client import RolloutClient
from rollout_client.events import Event  # noqa: TC001 - read at run time, as RolloutSource's
from rollout_client.failures import REPLICA_FAILURES, SERVER_FAILURES
from rollout_client.routing import NoReplica, Replica, ReplicaHung, Routing, serving_version
from rollout_client.source import as_request
from rollout_client.trajectory import Trajectory, collect
from rollout_client.updates import WeightsUpdate, from_weights
from rollout_client.weight_sync import WeightSyncGroup
from rollout_core.layout import prompt_groups, sample_layout
from rollout_core.tree import widest

if TYPE_CHECKING:
    from rollout_client.credentials import TLS

__all__ = ["NoReplica", "ReplicaHung", "RolloutPool"]  # the errors of routing.py reach the pool's callers

log = logging.getLogger("rollout_client.pool")

# The default stall_seconds: a healthy replica answers within a step, a prompt encoding or a decode.
STALL_SECONDS = 60.0
# What a replica that hung must complete before it routes again: one step of one sample at the
# server's defaults, without images (it shows the worker runs, not only the network thread).
PROBE = rollout_pb2.RolloutRequest(
    request_id="pool-probe", prompts=["a probe"], samples_per_prompt=1, num_steps=1, images=False
)
CHANNEL_OPTIONS = [
    # A replica that comes back is seen within a second, not after gRPC's reconnect backoff (which
    # grows to minutes); its own subchannels, so other channels to the address do not share that state.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
]


@dataclasses.dataclass
class Kept:
    """One applied update, kept to replay on a replica that missed it: ``send`` makes its call
    (UpdateWeights of a snapshot, or LoadWeights) on a replica's client. ``full``: it replaces the
    whole of its ``target``, so the updates of that target before it need no replay."""

    version: int
    target: str
    full: bool
    send: Callable[[RolloutClient], Any]


class RolloutPool:
    """Several replicas behind the ``RolloutClient`` surface.

    >>> with RolloutPool(["10.0.3.7:50051", "10.0.3.8:50051"]) as pool:
    ...     trajectories = pool.rollout(prompts=["a red fox", "a kite"], samples_per_prompt=8, base_seed=7)

    ``stall_seconds``: how long the pool waits on a replica without receiving anything before it
    declares it hung. It must exceed the longest silence of a healthy replica: its longest step,
    prompt encoding, decode or weight update, and the queueing behind work the pool did not send.
    Default: 60 s, or half the ``timeout`` when that is shorter (so a hang is seen before the
    call's deadline turns it into the request's error).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        timeout: float | None = None,
        tls: "TLS | None" = None,
        token: str | None = None,
        max_retries: int = 2,
        health_interval: float = 1.0,
        wait_seconds: float = 60.0,
        stall_seconds: float | None = None,
    ):
        if not addresses:
            raise ValueError("a pool needs at least one replica address")
        if stall_seconds is None:
            stall_seconds = STALL_SECONDS if timeout is None else min(STALL_SECONDS, timeout / 2)
        if not stall_seconds > 0:
            raise ValueError(f"stall_seconds must be > 0, got {stall_seconds}")
        # No gRPC retries on a replica's channel: a refused or failed group is re-run on another
        # replica at once, rather than retried on the same one.
        connect = functools.partial(
            RolloutClient, timeout=timeout, tls=tls, token=token, channel_options=CHANNEL_OPTIONS, retry=None
        )
        self._routing = Routing(addresses, connect, wait_seconds, stall_seconds, health_interval)
        self.replicas = self._routing.replicas
        self.max_retries = max_retries
        self.retries = 0  # prompt groups re-run on another replica
        self._update_lock = threading.Lock()  # one fan-out update at a time
        with ThreadPoolExecutor(len(self.replicas)) as executor:  # a stopped replica delays no other
            versions = list(executor.map(serving_version, [replica.client for replica in self.replicas]))
        self._routing.version = max((v for v in versions if v is not None), default=0)
        for replica, version in zip(self.replicas, versions, strict=True):
            replica.version, replica.healthy = version or 0, version == self.version
        # The updates since the last full one, and the version they build on (None: a full update
        # heads them, so they build on nothing).
        self.updates: list[Kept] = []
        self.updates_base: int | None = self.version
        self.weight_sync: WeightSyncGroup | None = None  # see init_weight_sync
        self._sync_replicas: list[Replica] = []  # its replicas, in its rank order
        self._info: rollout_pb2.GetServerInfoResponse | None = None
        self._stop = threading.Event()
        self._recoveries = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="rollout-pool-recover")
        self._watchers = [
            threading.Thread(target=self._watch, args=(replica,), name=f"rollout-pool-watch-{k}", daemon=True)
            for k, replica in enumerate(self.replicas)
        ]
        self._watchers.append(
            threading.Thread(
                target=self._routing.watch_stalls, args=(self._stop,), name="rollout-pool-stalls", daemon=True
            )
        )
        for watcher in self._watchers:
            watcher.start()

    @property
    def version(self) -> int:
        """The pool's policy version (the highest a replica served when the pool started, then that of
        the last update a replica applied): work routes to the replicas at it."""
        return self._routing.version

    # Rollouts ---------------------------------------------------------------------------------------

    def rollout(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> list[Trajectory]:
        """Run a rollout, each prompt group on one replica, and return one Trajectory per sample as
        one server would (prompt-major order)."""
        request = as_request(request, fields)
        groups = self._split(request)
        if len(groups) == 1:
            return self._run_group(*groups[0])
        with ThreadPoolExecutor(len(groups), thread_name_prefix="rollout-pool") as executor:
            results = list(executor.map(lambda group: self._run_group(*group), groups))
        return [trajectory for group in results for trajectory in group]

    def stream(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> Iterator[Event]:
        """Typed events of one rollout, the whole request on one replica (its events are that
        replica's, unchanged). A replica that fails before the first event is replaced; after it,
        the error reaches the caller, since events already yielded cannot be taken back."""
        request = as_request(request, fields)
        samples = max(widest(request), len(request.prompts))
        avoid: set[str] = set()
        for attempt in range(self.max_retries + 1):
            replica = self._routing.acquire(samples, request.min_policy_version, avoid)
            started = False
            try:
                for event in self._routing.events(replica, request):
                    started = True
                    yield event
                return
            except grpc.RpcError as error:
                if started or error.code() not in REPLICA_FAILURES or attempt == self.max_retries:
                    raise
                self._failed(replica, error, avoid)
            finally:
                self._routing.release(replica, samples)

    def _split(
        self, request: rollout_pb2.RolloutRequest
    ) -> list[tuple[rollout_pb2.RolloutRequest, int | None]]:
        """(request, prompt index) per prompt group, laid out by the rule a server resolves requests
        by (``rollout_core.layout``), with its seeds fixed, so a re-run draws the same noise. A
        request that rule refuses goes whole to one replica (prompt index None), which answers it
        as a server does (INVALID_ARGUMENT naming the field). A tree rollout is one group: its node
        ids, and the advantages computed over them, span its prompts."""
        layout, _ = sample_layout(request, self._static_info().limits.max_samples)
        if layout is None:
            return [(request, None)]

        if request.branches:
            return [(prompt_groups(request, layout, range(len(request.prompts))), None)]
        return [(prompt_groups(request, layout, [p]), p) for p in range(len(request.prompts))]

    def _static_info(self) -> rollout_pb2.GetServerInfoResponse:
        """A replica's server info, for its defaults and limits (the same on every replica)."""
        if self._info is None:
            self._info = self.server_info()
        return self._info

    def _run_group(self, request: rollout_pb2.RolloutRequest, prompt_index: int | None) -> list[Trajectory]:
        samples = max(widest(request), 1)
        avoid: set[str] = set()
        for attempt in range(self.max_retries + 1):
            replica = self._routing.acquire(samples, request.min_policy_version, avoid)
            try:
                trajectories = collect(
                    self._routing.events(replica, request), [image.data for image in request.condition_images]
                )
                break
            except grpc.RpcError as error:
                if error.code() not in REPLICA_FAILURES or attempt == self.max_retries:
                    raise
                self._failed(replica, error, avoid)
            finally:
                self._routing.release(replica, samples)
        if prompt_index is None:
            return trajectories  # the request went whole
        first = prompt_index * len(trajectories)
        return [
            dataclasses.replace(t, sample_index=first + t.sample_index, prompt_index=prompt_index)
            for t in trajectories
        ]

    def _failed(self, replica: Replica, error: grpc.RpcError, avoid: set[str]) -> None:
        avoid.add(replica.address)
        with self._routing.lock:
            replica.failures += 1
            self.retries += 1
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full queue is not a failure
            self._routing.suspend(replica, f"{error.code().name}: {error.details()}")
        log.warning("re-running a prompt group that failed on %s (%s)", replica.address, error.code().name)

    # Weights ----------------------------------------------------------------------------------------

    def push(self, update: WeightsUpdate, progress: bool = False) -> rollout_pb2.UpdateWeightsResponse:
        """``RolloutClient.push`` on every routable replica at once (a progress bar per replica for a
        large update, when asked); returns once all of them applied it (the first replica's
        response). A replica whose update fails, or that hangs on it, leaves routing until it is
        brought to this version; if none applied it, the first error is raised."""
        send = functools.partial(RolloutClient.push, update=update.snapshot(), progress=progress)
        return self._fan_out(Kept(update.version, update.target, update.resolved_kind == "full", send))

    update_weights = from_weights(push)

    def load_weights(
        self, path: str, version: int, kind: str | None = None, adapter_name: str = "", target: str = ""
    ) -> rollout_pb2.LoadWeightsResponse:
        """``RolloutClient.load_weights`` on every routable replica: ``path`` must hold the same
        weights under each replica's ``--weights-root``."""
        send = functools.partial(
            RolloutClient.load_weights,
            path=path,
            version=version,
            kind=kind,
            adapter_name=adapter_name,
            target=target,
        )
        return self._fan_out(Kept(version, target, kind == "full", send))

    def _fan_out(self, update: Kept):
        if update.full:
            self._static_info()  # read now, not under the lock in _keep: it calls a replica
        with self._update_lock:
            targets = self._routing.current()
            if not targets:
                raise NoReplica(f"no replica at policy version {self.version} to update")
            with ThreadPoolExecutor(len(targets), thread_name_prefix="rollout-pool-update") as executor:
                outcomes = list(executor.map(lambda r: _attempt(self._routing.call, r, update.send), targets))
            return self._settle(update, targets, outcomes)

    def _settle(self, update: Kept, targets: list[Replica], outcomes: list[tuple]):
        """Record which of ``targets`` applied ``update`` (outcomes: (result, error) each) under the
        pool's version rules; returns the first result, or raises when none applied."""
        applied = [(r, result) for r, (result, error) in zip(targets, outcomes, strict=True) if error is None]
        errors = [error for _, error in outcomes if error is not None]
        if not applied and not any(error.code() in SERVER_FAILURES for error in errors):
            raise errors[0]  # the update itself was refused (by every replica alike)
        with self._routing.lock:
            for replica, (_, error) in zip(targets, outcomes, strict=True):
                if error is None:
                    replica.version = update.version
                else:
                    log.warning(
                        "replica %s missed policy version %d: %s", replica.address, update.version, error
                    )
                    replica.healthy = False
            if applied:
                self._routing.version = update.version
                self._keep(update)
            self._routing.lock.notify_all()
        if not applied:
            raise errors[0]
        return applied[0][1]

    def init_weight_sync(self, **options) -> WeightSyncGroup:
        """Put this process (the trainer's rank 0) and every rank of every replica at the pool's
        policy version in one weight-sync group (options as ``WeightSyncGroup``'s), replacing the
        pool's previous group; ``update_weights_from_group`` then reaches all of them with one
        broadcast per bucket."""
        with self._update_lock:
            targets = self._routing.current()
            if not targets:
                raise NoReplica(f"no replica at policy version {self.version} to join a group")
            if self.weight_sync is not None:
                with contextlib.suppress(grpc.RpcError):  # a replica that is gone has left it anyway
                    self.weight_sync.close()
            self._sync_replicas, self.weight_sync = [], None
            self.weight_sync = WeightSyncGroup([r.client for r in targets], **options)
            self._sync_replicas = targets
        return self.weight_sync

    def push_over_group(self, update: WeightsUpdate) -> rollout_pb2.GroupUpdateApplied:
        """``push`` over the pool's weight-sync group (``init_weight_sync`` first): one broadcast per
        bucket reaches every replica in it. The version rules are the same: a replica that fails the
        update leaves routing, and is brought to this version over gRPC (from the pool's snapshot)
        before it routes again; once a broadcast failed the group is gone: call
        ``init_weight_sync`` again. Returns the first replica's answer."""
        if self.weight_sync is None:
            raise RuntimeError("the pool has no weight-sync group: call init_weight_sync first")
        send = functools.partial(RolloutClient.push, update=update.snapshot(), progress=False)
        kept = Kept(update.version, update.target, update.resolved_kind == "full", send)
        if kept.full:
            self._static_info()
        with self._update_lock:
            outcomes = self.weight_sync.push_outcomes(update)  # from where they are
            pairs = [(outcome.applied, outcome.error) for outcome in outcomes]
            return self._settle(kept, self._sync_replicas, pairs)

    update_weights_from_group = from_weights(push_over_group)

    def _keep(self, update: Kept) -> None:
        """Add ``update`` to the kept ones. A full update replaces every earlier update of its
        transformer; once it replaces the model's only transformer, the kept updates build on nothing."""
        if not update.full:
            self.updates.append(update)
            return
        target = update.target or "transformer"
        self.updates = [u for u in self.updates if (u.target or "transformer") != target]
        self.updates.append(update)
        if len(self._static_info().transformers) <= 1:
            self.updates_base = None

    def _missed(self, version: int) -> list[Kept]:
        """The kept updates a replica at ``version`` has not applied, in order (a restarted replica
        starts from the model folder: the pool's first version). Call with the lock held."""
        if version >= self.version:
            return []
        if self.updates_base is not None and version < self.updates_base:
            raise RuntimeError(f"it is at version {version}; the kept updates build on {self.updates_base}")
        return [update for update in self.updates if update.version > version]

    # Health -----------------------------------------------------------------------------------------

    def _watch(self, replica: Replica) -> None:
        """Each health_interval (a check takes at most two HEALTH_TIMEOUTs): take the replica out of
        routing if it stopped serving, re-admit it if it serves at the pool's version, or start
        bringing it back (``_recover``, off this thread: a watcher never waits on a replica's work)."""
        while not self._stop.wait(self._routing.health_interval):
            with self._routing.lock:
                client, known = replica.client, replica.version
            try:
                version = serving_version(client)
            except grpc.RpcError as error:
                self._routing.suspend(replica, f"{error.code().name}: {error.details()}")
                continue
            if version is None:
                self._routing.suspend(replica, "not serving")
            else:
                self._serving(replica, version, known)

    def _serving(self, replica: Replica, version: int, known: int) -> None:
        """The replica serves at ``version`` (the pool knew it at ``known`` before the check)."""
        with self._routing.lock:
            if replica.recovering or replica.version != known:
                return  # an update or a replay changed it during the check: the reading may be stale
            if version < self.version:
                self._routing.suspend(
                    replica, f"at policy version {version}, below the pool's {self.version}"
                )
            elif not replica.needs_probe:
                self._routing.admit(replica, version)
                return
            replica.recovering = True
        self._recoveries.submit(self._recover, replica, version)

    def _recover(self, replica: Replica, version: int) -> None:
        """Bring a serving replica at ``version`` back: replay, in order and with their versions, the
        updates it missed (and those kept meanwhile), run the probe rollout if it hung, then admit
        it. Every call falls under the stall rule, so a replica that hangs again ends it."""
        try:
            with self._routing.lock:
                hangs = replica.hangs
                missed = self._missed(version)
            while missed:
                for update in missed:
                    self._routing.call(replica, update.send)
                    version = update.version
                    log.info("replica %s replayed policy version %d", replica.address, version)
                with self._routing.lock:
                    missed = self._missed(version)
            if replica.needs_probe:
                collect(self._routing.events(replica, PROBE))
                log.info("replica %s completed a probe rollout", replica.address)
            with self._routing.lock:
                if replica.hangs == hangs:
                    replica.needs_probe = False
                self._routing.admit(replica, version)
            replica.stuck = ""
        except (grpc.RpcError, RuntimeError, ValueError) as error:
            if replica.stuck != str(error):  # once, not every health round
                log.warning("replica %s cannot come back yet: %s", replica.address, error)
            replica.stuck = str(error)
        finally:
            with self._routing.lock:
                replica.recovering = False

    # The rest of the client surface ----------------------------------------------------------------

    def server_info(self) -> rollout_pb2.GetServerInfoResponse:
        """GetServerInfo of a replica at the pool's policy version."""
        with self._routing.lock:
            candidates = sorted(self.replicas, key=lambda r: (not r.healthy, r.version != self.version))
        errors = []
        for replica in candidates:
            try:
                return self._routing.call(replica, RolloutClient.server_info)
            except grpc.RpcError as error:
                errors.append(error)
        raise errors[0]

    def server_infos(self) -> dict[str, rollout_pb2.GetServerInfoResponse | grpc.RpcError]:
        """Every replica's GetServerInfo (or the error it gave), by address."""
        infos: dict[str, Any] = {}
        for replica in self.replicas:
            try:
                infos[replica.address] = self._routing.call(replica, RolloutClient.server_info)
            except grpc.RpcError as error:
                infos[replica.address] = error
        return infos

    def close(self) -> None:
        if self.weight_sync is not None:
            with contextlib.suppress(grpc.RpcError):
                self.weight_sync.close()
        self._stop.set()
        for watcher in self._watchers:
            watcher.join()
        for replica in self.replicas:
            replica.client.close()  # ends the calls of replays and probes still running
        self._recoveries.shutdown()

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _attempt(function, *args):
    """``function(*args)`` and None, or None and the gRPC error it raised."""
    try:
        return function(*args), None
    except grpc.RpcError as error:
        return None, error
