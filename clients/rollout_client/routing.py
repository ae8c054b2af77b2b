"""A pool's replicas and what routes to them: each replica's health, version and load, the pool's
policy version, and the stall rule every call on a replica runs under (``rollout_client.pool`` has
the rules; this module keeps the books)."""

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2

from rollout.v1 import rollout_pb2
from rollout_client.events import Event, decode_stream
from rollout_client.failures import REFUSED_CREDENTIALS

if TYPE_CHECKING:
    from rollout_client.client import RolloutClient

log = logging.getLogger("rollout_client.pool")  # the pool's log: its routing is part of it

HEALTH_TIMEOUT = 2.0  # seconds for a health check or server info of the watcher


class NoReplica(RuntimeError):
    """No replica can take the work within the pool's wait."""


class ReplicaHung(grpc.RpcError):
    """A call ended because its replica was declared hung (the pool waited ``stall_seconds`` on it
    without receiving anything). Its code is UNAVAILABLE, as for a replica that went away."""

    def __init__(self, address: str, seconds: float):
        super().__init__(f"replica {address} sent nothing for {seconds:g} s")

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)

    def trailing_metadata(self) -> None:
        return None  # no server status came (grpc_status.rpc_status.from_call reads this)


@dataclasses.dataclass
class Replica:
    address: str
    client: "RolloutClient"
    version: int = 0
    healthy: bool = False
    outstanding: int = 0  # samples routed to it and not finished
    failures: int = 0  # prompt groups that failed on it and were re-run elsewhere
    stuck: str = ""  # why it cannot catch up with the pool's version, if it cannot
    hangs: int = 0  # times it was declared hung
    needs_probe: bool = False  # it hung: a probe rollout must complete before it routes again
    waiting: int = 0  # calls the pool is blocked on, waiting for the replica's next word
    heard_at: float = 0.0  # its last word (monotonic), or when the pool began to wait on it
    recovering: bool = False  # a replay or a probe of it is running


class Routing:
    """The replicas of ``addresses`` (each through a client of ``connect(address)``) and the pool's
    policy ``version``, guarded by ``lock`` (a Condition: routing waits on it for a replica).

    ``wait_seconds``: how long ``acquire`` waits for a routable replica. ``stall_seconds``: how long
    a call may wait on a replica without a word before ``watch_stalls`` declares it hung.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        connect: Callable[[str], "RolloutClient"],
        wait_seconds: float,
        stall_seconds: float,
        health_interval: float,
    ):
        self.connect, self.wait_seconds, self.stall_seconds = connect, wait_seconds, stall_seconds
        self.health_interval = health_interval
        self.replicas = [Replica(address, connect(address)) for address in addresses]
        self.version = 0
        self.lock = threading.Condition()

    # Routing ----------------------------------------------------------------------------------------

    def routable(self, replica: Replica, min_version: int) -> bool:
        if not replica.healthy:
            return False
        return replica.version == self.version or (0 < min_version <= replica.version)

    def current(self) -> list[Replica]:
        """The healthy replicas at the pool's version."""
        with self.lock:
            return [r for r in self.replicas if r.healthy and r.version == self.version]

    def acquire(self, samples: int, min_version: int, avoid: set[str]) -> Replica:
        """The least loaded routable replica (current ones first, then ones not in ``avoid``); waits
        up to ``wait_seconds`` for one."""
        deadline = time.monotonic() + self.wait_seconds
        with self.lock:
            while True:
                routable = [r for r in self.replicas if self.routable(r, min_version)]
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
                self.lock.wait(min(left, self.health_interval))

    def release(self, replica: Replica, samples: int) -> None:
        with self.lock:
            replica.outstanding -= samples

    def suspend(self, replica: Replica, reason: str) -> None:
        with self.lock:
            if replica.healthy:
                log.warning("replica %s out of routing: %s", replica.address, reason)
            replica.healthy = False

    def admit(self, replica: Replica, version: int) -> None:
        """Record a serving replica's version, and route to it when that is the pool's. Call with the
        lock held."""
        replica.version = version
        if not replica.healthy and not replica.needs_probe and version == self.version:
            replica.healthy = True
            log.info("replica %s in routing at policy version %d", replica.address, version)
            self.lock.notify_all()

    # Calls on a replica, under the stall rule -------------------------------------------------------

    @contextlib.contextmanager
    def on(self, replica: Replica) -> Iterator["RolloutClient"]:
        """The replica's client for one call. A call that fails because the replica was declared
        hung meanwhile (its channel closed under the call, or before it began) raises ReplicaHung."""
        with self.lock:
            client, hangs = replica.client, replica.hangs
        try:
            yield client
        except (grpc.RpcError, ValueError) as error:  # ValueError: an RPC on a closed channel
            if replica.hangs == hangs:
                raise
            raise ReplicaHung(replica.address, self.stall_seconds) from error

    @contextlib.contextmanager
    def waiting(self, replica: Replica) -> Iterator[None]:
        """The pool waits on ``replica`` for the body; the wait's end (an answer, or an error) is a
        word from it."""
        with self.lock:
            if not replica.waiting:
                replica.heard_at = time.monotonic()
            replica.waiting += 1
        try:
            yield
        finally:
            with self.lock:
                replica.waiting -= 1
                replica.heard_at = time.monotonic()

    def call(self, replica: Replica, send: Callable[["RolloutClient"], Any]) -> Any:
        """``send(client)``, one unary or client-streaming call on ``replica``, under the stall rule."""
        with self.on(replica) as client, self.waiting(replica):
            return send(client)

    def events(self, replica: Replica, request: rollout_pb2.RolloutRequest) -> Iterator[Event]:
        """The typed events of ``request`` on ``replica``, the pool waiting on the replica while it
        waits for each message (not while its caller holds an event); closing it cancels the call."""
        with self.on(replica) as client:
            call = client.call("Rollout", request)
            try:
                yield from decode_stream(self._messages(replica, call))
            finally:
                call.cancel()

    def _messages(self, replica: Replica, call) -> Iterator[rollout_pb2.RolloutResponse]:
        """The call's messages, each waited for under the stall rule."""
        while True:
            with self.waiting(replica):
                message = next(call, None)
            if message is None:
                return
            yield message

    def watch_stalls(self, stop: threading.Event) -> None:
        """Until ``stop``, declare hung each replica the pool has waited on for ``stall_seconds``
        without a word: it leaves routing and its channel is replaced, which cancels all its calls
        (its groups re-run elsewhere, its updates count as missed), and it needs a probe to route
        again."""
        while not stop.wait(min(1.0, self.stall_seconds / 4)):
            closing = []
            with self.lock:
                now = time.monotonic()
                for replica in self.replicas:
                    if not replica.waiting or now - replica.heard_at <= self.stall_seconds:
                        continue
                    log.warning(
                        "replica %s hung: the pool waited %.1f s on it without a word; its calls are "
                        "cancelled, and it routes again after a probe rollout",
                        replica.address,
                        now - replica.heard_at,
                    )
                    closing.append(replica.client)
                    replica.client = self.connect(replica.address)
                    replica.hangs += 1
                    replica.healthy, replica.needs_probe, replica.heard_at = False, True, now
            for client in closing:
                client.close()


def serving_version(client: "RolloutClient") -> int | None:
    """The server's policy version if its gRPC health says SERVING, else None (also when its channel
    was just closed: the replica was declared hung). Refused credentials are raised: waiting would
    not help."""
    try:
        if client.health(timeout=HEALTH_TIMEOUT) != health_pb2.HealthCheckResponse.SERVING:
            return None
        request = rollout_pb2.GetServerInfoRequest()
        return client.call("GetServerInfo", request, timeout=HEALTH_TIMEOUT).policy_version
    except grpc.RpcError as error:
        if error.code() in REFUSED_CREDENTIALS:
            raise
        return None
    except ValueError:  # an RPC on a closed channel
        return None
