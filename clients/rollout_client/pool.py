"""``RolloutPool``: one client over several replicas of the same model, with the surface of
``RolloutClient``.

* **Group-affine routing.** A request's prompt groups (all samples of one prompt) each run whole on
  one replica, the one with the least outstanding samples. The pool fixes every sample's seed before
  it splits the request, the seeds one server would derive from the same base seed, so the noise is
  the same. It then reassembles the trajectories as one server returns them: prompt-major, the same
  request id, sample and prompt indices over the whole request.
* **Fan-out weight updates.** ``update_weights`` sends the update to every routable replica at once,
  and returns once they have applied it. A replica whose update fails is taken out of routing. The
  pool keeps a snapshot of every update since the last self-contained one (a full update) and replays
  the ones a replica missed, with their versions, before it routes to that replica again.
* **Failover.** A prompt group whose replica fails (it dies, drains, or reports an internal failure)
  is re-run with the same seeds on another replica, at most ``max_retries`` times per group;
  ``retries`` counts them. A watcher thread checks every replica's gRPC health each
  ``health_interval`` seconds, takes failing ones out of routing, and re-admits them once they are
  serving and at the pool's policy version.

Routing only sends work to replicas at the pool's policy version. When none is available, it falls
back to a healthy replica whose version still satisfies the request's ``min_policy_version`` (when
it sets one).
"""

import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout.v1 import rollout_pb2
from rollout_client.client import RolloutClient
from rollout_client.credentials import TLS
from rollout_client.events import Event
from rollout_client.trajectory import Trajectory
from rollout_core.noise import derive_seeds

log = logging.getLogger("rollout_client.pool")

# Failures of the replica rather than of the request: the group is re-run elsewhere.
REPLICA_FAILURES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


HEALTH_TIMEOUT = 2.0  # seconds for a health check or server info of the watcher
CHANNEL_OPTIONS = [
    # A replica that comes back is seen within a second, not after gRPC's reconnect backoff (which
    # grows to minutes); its own subchannels, so other channels to the address do not share that state.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
]


class NoReplica(RuntimeError):
    """No replica can take the work within the pool's wait."""


@dataclasses.dataclass
class Replica:
    address: str
    client: RolloutClient
    version: int = 0
    healthy: bool = False
    outstanding: int = 0  # samples routed to it and not finished
    failures: int = 0  # prompt groups that failed on it and were re-run elsewhere
    stuck: str = ""  # why it cannot catch up with the pool's version, if it cannot


@dataclasses.dataclass
class Update:
    """One applied update, kept to replay on a replica that missed it."""

    version: int
    weights: dict[str, torch.Tensor] | None  # UpdateWeights (a snapshot), or None for LoadWeights
    fields: dict[str, Any]

    def send(self, client: RolloutClient):
        if self.weights is None:
            return client.load_weights(version=self.version, **self.fields)
        return client.update_weights(self.weights, self.version, **self.fields)


class RolloutPool:
    """Several replicas behind the ``RolloutClient`` surface.

    >>> with RolloutPool(["10.0.3.7:50051", "10.0.3.8:50051"]) as pool:
    ...     trajectories = pool.rollout(prompts=["a red fox", "a kite"], samples_per_prompt=8, base_seed=7)
    """

    def __init__(
        self,
        addresses: Sequence[str],
        timeout: float | None = None,
        tls: TLS | None = None,
        token: str | None = None,
        max_retries: int = 2,
        health_interval: float = 1.0,
        wait_seconds: float = 60.0,
    ):
        if not addresses:
            raise ValueError("a pool needs at least one replica address")
        self.replicas = [
            Replica(a, RolloutClient(a, timeout, tls, token, channel_options=CHANNEL_OPTIONS))
            for a in addresses
        ]
        self.max_retries, self.wait_seconds = max_retries, wait_seconds
        self.retries = 0  # prompt groups re-run on another replica
        self._lock = threading.Condition()  # guards the replicas' routing state
        self._update_lock = threading.Lock()  # one update (or replay) at a time
        versions = [_serving_version(replica.client) for replica in self.replicas]
        self.version = max((v for v in versions if v is not None), default=0)
        for replica, version in zip(self.replicas, versions, strict=True):
            replica.version, replica.healthy = version or 0, version == self.version
        # The updates since the last full one, and the version they build on (None: a full update
        # heads them, so they build on nothing).
        self.updates: list[Update] = []
        self.updates_base: int | None = self.version
        self._info: rollout_pb2.GetServerInfoResponse | None = None
        self._stop = threading.Event()
        self._health_interval = health_interval
        self._watcher = threading.Thread(target=self._watch, name="rollout-pool-health", daemon=True)
        self._watcher.start()

    # Routing ----------------------------------------------------------------------------------------

    def _routable(self, replica: Replica, min_version: int) -> bool:
        if not replica.healthy:
            return False
        return replica.version == self.version or (0 < min_version <= replica.version)

    def _acquire(self, samples: int, min_version: int, avoid: set[str]) -> Replica:
        """The least loaded routable replica (current ones first, then ones not in ``avoid``); waits
        up to ``wait_seconds`` for one."""
        deadline = time.monotonic() + self.wait_seconds
        with self._lock:
            while True:
                routable = [r for r in self.replicas if self._routable(r, min_version)]
                if routable:
                    replica = min(
                        routable,
                        key=lambda r: (r.version != self.version, r.address in avoid, r.outstanding),
                    )
                    replica.outstanding += samples
                    return replica
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoReplica(
                        f"no replica at policy version {self.version} within {self.wait_seconds} s"
                    )
                self._lock.wait(min(left, self._health_interval))

    def _release(self, replica: Replica, samples: int) -> None:
        with self._lock:
            replica.outstanding -= samples

    def _suspend(self, replica: Replica, reason: str) -> None:
        with self._lock:
            if replica.healthy:
                log.warning("replica %s out of routing: %s", replica.address, reason)
            replica.healthy = False

    # Rollouts ---------------------------------------------------------------------------------------

    def rollout(self, request: rollout_pb2.RolloutRequest | None = None, **fields) -> list[Trajectory]:
        """Run a rollout, each prompt group on one replica, and return one Trajectory per sample as
        one server would (prompt-major order)."""
        request = _request(request, fields)
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
        request = _request(request, fields)
        samples = max(len(request.seeds), len(request.prompts))
        avoid: set[str] = set()
        for attempt in range(self.max_retries + 1):
            replica = self._acquire(samples, request.min_policy_version, avoid)
            started = False
            try:
                for event in replica.client.stream(request):
                    started = True
                    yield event
                return
            except grpc.RpcError as error:
                if started or error.code() not in REPLICA_FAILURES or attempt == self.max_retries:
                    raise
                self._failed(replica, error, avoid)
            finally:
                self._release(replica, samples)

    def _split(
        self, request: rollout_pb2.RolloutRequest
    ) -> list[tuple[rollout_pb2.RolloutRequest, int | None]]:
        """(request, prompt index) per prompt group, with its seeds fixed, so a re-run draws the same
        noise. A request the pool cannot split the way a server would read it goes whole to one
        replica (prompt index None), which answers it as a server does (INVALID_ARGUMENT where it
        is malformed)."""
        prompts = list(request.prompts)
        group_size = self._group_size(request) if prompts else None
        count = len(prompts) * (group_size or 0)
        if group_size is None or count > self._static_info().limits.max_samples:
            return [(request, None)]
        if request.seeds:
            seeds = list(request.seeds)
        else:
            base_seed = request.base_seed if request.HasField("base_seed") else secrets.randbits(64)
            seeds = derive_seeds(base_seed, count)
        request_id = request.request_id or uuid.uuid4().hex[:16]
        groups = []
        for p, prompt in enumerate(prompts):
            group = rollout_pb2.RolloutRequest()
            group.CopyFrom(request)
            group.request_id = request_id
            group.ClearField("base_seed")
            del group.prompts[:]
            group.prompts.append(prompt)
            del group.seeds[:]
            group.seeds.extend(seeds[p * group_size : (p + 1) * group_size])
            group.samples_per_prompt = group_size
            groups.append((group, p))
        return groups

    def _group_size(self, request: rollout_pb2.RolloutRequest) -> int | None:
        prompts = len(request.prompts)
        if request.seeds:
            if len(request.seeds) % prompts or request.HasField("base_seed"):
                return None
            size = len(request.seeds) // prompts
            if request.HasField("samples_per_prompt") and request.samples_per_prompt != size:
                return None
            return size
        if request.HasField("samples_per_prompt"):
            return request.samples_per_prompt or None
        return self._static_info().defaults.samples_per_prompt or None

    def _static_info(self) -> rollout_pb2.GetServerInfoResponse:
        """A replica's server info, for its defaults and limits (the same on every replica)."""
        if self._info is None:
            self._info = self.server_info()
        return self._info

    def _run_group(self, request: rollout_pb2.RolloutRequest, prompt_index: int | None) -> list[Trajectory]:
        samples = max(len(request.seeds), 1)
        avoid: set[str] = set()
        for attempt in range(self.max_retries + 1):
            replica = self._acquire(samples, request.min_policy_version, avoid)
            try:
                trajectories = replica.client.rollout(request)
                break
            except grpc.RpcError as error:
                if error.code() not in REPLICA_FAILURES or attempt == self.max_retries:
                    raise
                self._failed(replica, error, avoid)
            finally:
                self._release(replica, samples)
        if prompt_index is None:
            return trajectories  # the request went whole
        first = prompt_index * len(trajectories)
        return [
            dataclasses.replace(t, sample_index=first + t.sample_index, prompt_index=prompt_index)
            for t in trajectories
        ]

    def _failed(self, replica: Replica, error: grpc.RpcError, avoid: set[str]) -> None:
        avoid.add(replica.address)
        with self._lock:
            replica.failures += 1
            self.retries += 1
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full queue is not a failure
            self._suspend(replica, f"{error.code().name}: {error.details()}")
        log.warning("re-running a prompt group that failed on %s (%s)", replica.address, error.code().name)

    # Weights ----------------------------------------------------------------------------------------

    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        version: int,
        kind: str | None = None,
        lora_config: Any = None,
        adapter_name: str = "",
        progress: bool = False,
        target: str = "",
    ) -> rollout_pb2.UpdateWeightsResponse:
        """``RolloutClient.update_weights`` on every routable replica at once (a progress bar per
        replica for a large update, when asked); returns once all of them applied it (the first
        replica's response). A replica whose update fails leaves routing until it is brought to this
        version; if none applied it, the first error is raised."""
        snapshot = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights.items()}
        fields = {
            "kind": kind,
            "lora_config": lora_config,
            "adapter_name": adapter_name,
            "progress": progress,
            "target": target,
        }
        return self._fan_out(Update(version, snapshot, fields), full=_is_full(kind, lora_config))

    def load_weights(
        self, path: str, version: int, kind: str | None = None, adapter_name: str = "", target: str = ""
    ) -> rollout_pb2.LoadWeightsResponse:
        """``RolloutClient.load_weights`` on every routable replica: ``path`` must hold the same
        weights under each replica's ``--weights-root``."""
        fields = {"path": path, "kind": kind, "adapter_name": adapter_name, "target": target}
        return self._fan_out(Update(version, None, fields), full=kind == "full")

    def _fan_out(self, update: Update, full: bool):
        with self._update_lock:
            with self._lock:
                targets = [r for r in self.replicas if r.healthy and r.version == self.version]
            if not targets:
                raise NoReplica(f"no replica at policy version {self.version} to update")
            with ThreadPoolExecutor(len(targets), thread_name_prefix="rollout-pool-update") as executor:
                outcomes = list(executor.map(lambda r: _attempt(update.send, r.client), targets))
            applied = [
                (r, result) for r, (result, error) in zip(targets, outcomes, strict=True) if error is None
            ]
            errors = [error for _, error in outcomes if error is not None]
            if not applied and not any(_replica_failure(error) for error in errors):
                raise errors[0]  # the update itself was refused (by every replica alike)
            with self._lock:
                for replica, (_, error) in zip(targets, outcomes, strict=True):
                    if error is None:
                        replica.version = update.version
                    else:
                        log.warning(
                            "replica %s missed policy version %d: %s", replica.address, update.version, error
                        )
                        replica.healthy = False
                if applied:
                    self.version = update.version
                    self._keep(update, full)
                self._lock.notify_all()
            if not applied:
                raise errors[0]
            return applied[0][1]

    def _keep(self, update: Update, full: bool) -> None:
        """Add ``update`` to the kept ones. A full update replaces every earlier update of its
        transformer; once it replaces the model's only transformer, the kept updates build on nothing."""
        if not full:
            self.updates.append(update)
            return
        target = update.fields.get("target") or "transformer"
        self.updates = [u for u in self.updates if (u.fields.get("target") or "transformer") != target]
        self.updates.append(update)
        if len(self._static_info().transformers) <= 1:
            self.updates_base = None

    def _catch_up(self, replica: Replica, version: int) -> None:
        """Replay, in order and with their versions, the kept updates a replica at ``version`` has
        not applied (a restarted replica starts from the model folder: the pool's first version)."""
        with self._update_lock:
            if self.updates_base is not None and version < self.updates_base:
                raise RuntimeError(
                    f"it is at version {version}; the kept updates build on {self.updates_base}"
                )
            for update in self.updates:
                if update.version > version:
                    update.send(replica.client)
                    log.info("replica %s replayed policy version %d", replica.address, update.version)

    # Health -----------------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Each health_interval: take replicas that stopped serving out of routing; bring serving ones
        below the pool's version up to it; re-admit those at it."""
        while not self._stop.wait(self._health_interval):
            for replica in self.replicas:
                try:
                    version = _serving_version(replica.client)
                except grpc.RpcError as error:
                    self._suspend(replica, f"{error.code().name}: {error.details()}")
                    continue
                if version is None:
                    self._suspend(replica, "not serving")
                    continue
                if version < self.version:
                    self._suspend(replica, f"at policy version {version}, below the pool's {self.version}")
                    try:
                        self._catch_up(replica, version)
                    except (grpc.RpcError, RuntimeError) as error:
                        if replica.stuck != str(error):  # once, not every health round
                            log.warning("replica %s cannot catch up: %s", replica.address, error)
                        replica.stuck = str(error)
                        continue
                    replica.stuck = ""
                    version = _serving_version(replica.client)
                with self._lock:
                    replica.version = version if version is not None else replica.version
                    if not replica.healthy and version == self.version:
                        replica.healthy = True
                        log.info("replica %s in routing at policy version %d", replica.address, version)
                        self._lock.notify_all()

    # The rest of the client surface ----------------------------------------------------------------

    def server_info(self) -> rollout_pb2.GetServerInfoResponse:
        """GetServerInfo of a replica at the pool's policy version."""
        with self._lock:
            candidates = sorted(self.replicas, key=lambda r: (not r.healthy, r.version != self.version))
        errors = []
        for replica in candidates:
            try:
                return replica.client.server_info()
            except grpc.RpcError as error:
                errors.append(error)
        raise errors[0]

    def server_infos(self) -> dict[str, rollout_pb2.GetServerInfoResponse | grpc.RpcError]:
        """Every replica's GetServerInfo (or the error it gave), by address."""
        infos: dict[str, Any] = {}
        for replica in self.replicas:
            try:
                infos[replica.address] = replica.client.server_info()
            except grpc.RpcError as error:
                infos[replica.address] = error
        return infos

    def close(self) -> None:
        self._stop.set()
        self._watcher.join()
        for replica in self.replicas:
            replica.client.close()

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _request(request: rollout_pb2.RolloutRequest | None, fields: dict) -> rollout_pb2.RolloutRequest:
    if request is not None and fields:
        raise TypeError("pass either a RolloutRequest or its fields, not both")
    return request or rollout_pb2.RolloutRequest(**fields)


def _is_full(kind: str | None, lora_config: Any) -> bool:
    return (kind or ("lora" if lora_config is not None else "full")) == "full"


def _serving_version(client: RolloutClient) -> int | None:
    """The server's policy version if its gRPC health says SERVING, else None. Refused credentials
    are raised: waiting would not help."""
    try:
        health = health_pb2_grpc.HealthStub(client.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT, metadata=client.metadata
        )
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            return None
        request = rollout_pb2.GetServerInfoRequest()
        return client.stub.GetServerInfo(
            request, timeout=HEALTH_TIMEOUT, metadata=client.metadata
        ).policy_version
    except grpc.RpcError as error:
        if error.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise
        return None


def _replica_failure(error: grpc.RpcError) -> bool:
    return error.code() in REPLICA_FAILURES or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def _attempt(send, client: RolloutClient):
    try:
        return send(client), None
    except grpc.RpcError as error:
        return None, error
