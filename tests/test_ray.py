"""Replicas as Ray actors on a real local Ray cluster: they serve a pool rollout; a killed actor (or a
dead server inside one) is restarted by Ray, its old server does not outlive it, and the pool
re-admits it. The tests share one cluster (its start costs seconds of CPU), and `rollout-server ray`
joins it by its address as it would join a running cluster."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import ray
from support.requests import make_request
from support.servers import SERVER_THREADS

from rollout_client import RolloutPool

REQUEST = make_request(
    {"prompts": ["a red fox", "a kite"], "samples_per_prompt": 2, "base_seed": 3},
    {"num_steps": 3, "height": 64, "width": 64},
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_port_pair() -> int:
    """A free port whose successor is free too (replica k listens on base + k)."""
    return next(port for port in iter(free_port, None) if not listening("127.0.0.1", port + 1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ray_cluster(cache_dir, tiny_flux_folder) -> str:
    """A local cluster for this module's tests; its GCS address."""
    from rollout_server.ray import connect

    connect(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_replica_actors_serve_a_pool_and_come_back_after_a_kill(ray_cluster, cache_dir):
    from rollout_server.ray import launch

    base = free_port_pair()
    replicas = launch(
        2,
        "tiny-flux",
        serve_args=["--threads", SERVER_THREADS, "--cache-dir", str(cache_dir)],
        base_port=base,
    )
    try:
        assert [address.rsplit(":", 1)[1] for address in replicas.addresses] == [str(base), str(base + 1)]
        with RolloutPool(replicas.addresses, timeout=60, health_interval=0.2) as pool:
            assert len(pool.rollout(REQUEST)) == 4
            assert all(replica.healthy for replica in pool.replicas)

            # The actor is killed: Ray restarts it, its server comes back on the same address.
            first = ray.get(replicas.actors[0].pid.remote())
            ray.kill(replicas.actors[0], no_restart=False)
            wait_until(lambda: not pool.replicas[0].healthy)
            wait_until(lambda: not alive(first))  # the server died with its actor
            wait_until(lambda: pool.replicas[0].healthy)
            assert ray.get(replicas.actors[0].address.remote()) == replicas.addresses[0]
            second = ray.get(replicas.actors[0].pid.remote())
            assert second != first

            # The server inside an actor dies: the actor exits with it, and Ray restarts both.
            os.kill(second, 9)
            wait_until(lambda: not pool.replicas[0].healthy)
            wait_until(lambda: pool.replicas[0].healthy)
            assert ray.get(replicas.actors[0].pid.remote()) not in (first, second)

            trajectories = pool.rollout(REQUEST)
            assert [t.prompt_index for t in trajectories] == [0, 0, 1, 1]
            assert pool.retries == 0  # nothing was routed to the replica while it was down
    finally:
        replicas.shutdown()


def test_rollout_server_ray_prints_addresses_serves_and_stops(ray_cluster, cache_dir):
    """`rollout-server ray --address` on a running cluster: the replica's address on stdout, a pool
    over it serves, SIGTERM takes the replica down. (Ports per replica: the test above.)"""
    base = free_port()
    command = [
        *(sys.executable, "-m", "rollout_server", "ray", "--address", ray_cluster),
        *("--replicas", "1", "--base-port", str(base)),
        *("--", "--threads", SERVER_THREADS, "--cache-dir", str(cache_dir)),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        addresses = [process.stdout.readline().strip()]
        assert addresses[0].rsplit(":", 1)[1] == str(base)
        with RolloutPool(addresses, timeout=60) as pool:
            assert len(pool.rollout(REQUEST)) == 4
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        for address in addresses:
            host, port = address.rsplit(":", 1)
            wait_until(lambda h=host, p=int(port): not listening(h, p))
    finally:
        process.kill()
        process.wait()


def listening(host: str, port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) == 0
