"""Replicas as Ray actors (the ``ray`` extra: ``pip install 'rollout-server[ray]'``).

``launch(replicas, model)`` starts each replica as a Ray actor that runs ``rollout-server serve`` on
its node. The server binds the node's address on a port fixed per replica, and ``--sp K`` ranks run
inside it through torch.distributed, with K GPUs per replica on GPU. The call returns the gRPC
addresses, which go to ``rollout_client.RolloutPool``.

Server and actor live and die together:
- the server process gets SIGKILL when its actor's process ends;
- the actor exits when its server does.

Ray restarts a dead actor (``max_restarts``), and the new actor brings its server back on the same
port. The pool's health checks then re-admit it, after replaying the weight updates it missed.

    connect()                                    # or inside ray.init() or a Ray job
    replicas = launch(2, "tiny-flux")
    with RolloutPool(replicas.addresses) as pool: ...
    replicas.shutdown()

``rollout-server ray --replicas N [--sp K] --model M [--address RAY_ADDRESS]`` does the same from a
shell, prints the addresses, and keeps the replicas up until it is interrupted.
"""

import ctypes
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import ray

from rollout_core.local_server import LocalServer

PR_SET_PDEATHSIG = 1
# Ray waits a fixed 30 s for a new local node's raylet to register, which a loaded machine can miss.
LOCAL_START_ATTEMPTS = 3


def connect(address: str | None = None, **init_args) -> None:
    """``ray.init(address, **init_args)``; a local node that timed out during startup is started again,
    up to ``LOCAL_START_ATTEMPTS`` times, after its processes (which Ray leaves running) are killed."""
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            ray.init(address=address, **init_args)
            return
        except Exception as error:
            if "timed out during startup" not in str(error) or attempt == LOCAL_START_ATTEMPTS:
                raise
        ray.shutdown()
        started = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
        for child in started:
            child.kill()
        psutil.wait_procs(started, timeout=30)


def _die_with_parent() -> None:
    """In the server's child process: get SIGKILL when the actor's process ends (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ReplicaActor:
    """A ``rollout-server serve`` process on this actor's node, bound to its address and ``port``."""

    def __init__(self, port: int, serve_args: Sequence[str]):
        host = ray.util.get_node_ip_address()
        self.log_path = Path(tempfile.mkdtemp(prefix="rollout-replica-")) / "server.log"
        # Started from the actor's main thread: the child's death signal follows this thread's exit.
        self.server = LocalServer.start(
            self.log_path, "--host", host, "--port", str(port), *serve_args, preexec_fn=_die_with_parent
        )
        threading.Thread(target=self._exit_with_server, name="replica-watch", daemon=True).start()

    def _exit_with_server(self) -> None:
        code = self.server.process.wait()
        print(f"rollout-server exited with {code}; the replica actor exits for Ray to restart it", flush=True)
        os._exit(1)

    def address(self) -> str:
        return self.server.address

    def pid(self) -> int:
        """The server process id (tests kill it to see Ray bring the replica back)."""
        return self.server.process.pid

    def log(self) -> str:
        return self.server.log()


@dataclass
class RayReplicas:
    actors: list
    addresses: list[str]

    def shutdown(self) -> None:
        """Kill the actors for good (their servers die with them)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def launch(
    replicas: int,
    model: str,
    sp: int = 1,
    device: str = "cpu",
    serve_args: Sequence[str] = (),
    ports: Sequence[int] | None = None,
    base_port: int = 50100,
    cpus_per_replica: float = 1,
    max_restarts: int = -1,
    timeout: float = 600.0,
) -> RayReplicas:
    """Start ``replicas`` replica actors (Ray must be initialised) and return once all serve.

    Replica k listens on ``ports[k]`` (default ``base_port + k``) of its node. On a CUDA ``device``
    each replica gets ``sp`` GPUs; each gets ``cpus_per_replica`` CPUs. ``serve_args`` go to
    ``rollout-server serve`` as they are (e.g. ``["--threads", "1"]``).
    """
    ports = list(ports) if ports is not None else [base_port + k for k in range(replicas)]
    if len(ports) != replicas:
        raise ValueError(f"{replicas} replicas need {replicas} ports, not {len(ports)}")
    gpus = sp if device.startswith("cuda") else 0
    args = ["--model", model, "--sp", str(sp), "--device", device, *serve_args]
    actor_class = ray.remote(ReplicaActor)
    actors = [
        actor_class.options(num_cpus=cpus_per_replica, num_gpus=gpus, max_restarts=max_restarts).remote(
            port, args
        )
        for port in ports
    ]
    addresses = ray.get([actor.address.remote() for actor in actors], timeout=timeout)
    return RayReplicas(actors, addresses)


def wait_forever(replicas: RayReplicas) -> None:
    """Block until SIGINT or SIGTERM, then shut the replicas down."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    replicas.shutdown()
