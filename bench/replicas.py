"""Replicas: rollouts/s of a RolloutPool over 1 and over 2 replicas, with C concurrent requests.

Two tiny-flux servers start, one torch thread each. The pool over the first one and the pool over both
take turns, round by round, starting with a different one each round. In a round, C client threads
start together, and each sends --requests requests back to back, each of 1 prompt x 2 samples. The
requests are manifest-only with images off: the engines are measured, not PNG or tensor encoding.
Every prompt is new, and the two pools get the same prompts. Printed: the median rollouts/s of each
pool over the rounds, and the median ratio 2 replicas / 1 replica of the rounds. Each pool first gets
a warm-up round, not counted.

    python bench/replicas.py                     # C = 8, 3 rounds
    python bench/replicas.py --clients 16 --rounds 5
"""

import argparse
import itertools
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout.v1 import rollout_pb2
from rollout_client import RolloutPool
from rollout_core.local_server import LocalServer

counter = itertools.count()


def request(args: argparse.Namespace) -> rollout_pb2.RolloutRequest:
    k = next(counter)
    return rollout_pb2.RolloutRequest(
        prompts=[f"a lighthouse number {k}"],
        samples_per_prompt=2,
        base_seed=k,
        num_steps=args.steps,
        height=args.size,
        width=args.size,
        manifest_only=True,
        images=False,
    )


def run_round(pool: RolloutPool, args: argparse.Namespace, clients: int, per_client: int) -> float:
    """Rollouts per second of ``clients`` threads sending ``per_client`` requests each."""
    start = threading.Barrier(clients + 1)

    def client() -> None:
        start.wait()
        for _ in range(per_client):
            pool.rollout(request(args))

    with ThreadPoolExecutor(clients) as executor:
        futures = [executor.submit(client) for _ in range(clients)]
        start.wait()
        began = time.perf_counter()
        for future in futures:
            future.result()
    return clients * per_client / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="per client per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        servers = [
            LocalServer.start(Path(folder) / f"replica-{k}.log", "--model", "tiny-flux", "--threads", "1")
            for k in range(2)
        ]
        try:
            pools = {
                "1 replica": RolloutPool([servers[0].address], timeout=600),
                "2 replicas": RolloutPool([server.address for server in servers], timeout=600),
            }
            for pool in pools.values():
                run_round(pool, args, 4, 1)  # warm-up
            rates: dict[str, list[float]] = {name: [] for name in pools}
            for round_index in range(args.rounds):
                order = list(pools) if round_index % 2 == 0 else list(reversed(pools))
                for name in order:
                    rates[name].append(run_round(pools[name], args, args.clients, args.requests))
            for pool in pools.values():
                pool.close()
        finally:
            for server in servers:
                server.stop()
    ratios = [two / one for one, two in zip(rates["1 replica"], rates["2 replicas"], strict=True)]
    print(
        f"tiny-flux {args.size}px, {args.steps} steps, {args.clients} concurrent requests of 1 prompt x 2 "
        f"samples, {args.rounds} rounds of {args.requests} requests per client; 1 torch thread per replica"
    )
    print(f"{'pool':<12} {'rollouts/s':>10}")
    for name, values in rates.items():
        print(f"{name:<12} {statistics.median(values):>10.2f}")
    rounds = ", ".join(f"{ratio:.2f}" for ratio in ratios)
    print(f"2 replicas / 1 replica: {statistics.median(ratios):.2f}x (rounds: {rounds})")


if __name__ == "__main__":
    main()
