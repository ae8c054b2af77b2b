"""What a denoising step of the shapes preset costs next to tiny-flux's. The same request (4 prompts
x 4 samples, ODE, 10 steps, no images) goes alternately to a shapes server at its size (64 x 64) and
to a tiny-flux server at the demo's size (128 x 128); after a warm-up round, prints the median
seconds per step of each (the finished events' denoise_seconds / steps) and their ratio.

    python bench/shapes_step_cost.py
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient
from rollout_core.local_server import LocalServer

CASES = {"shapes": 64, "tiny-flux": 128}  # preset -> image side
PROMPTS = ["a red circle", "two blue squares", "a green triangle and a yellow circle", "a purple square"]
STEPS = 10


def step_seconds(client: RolloutClient, side: int) -> float:
    request = rollout_pb2.RolloutRequest(
        prompts=PROMPTS,
        samples_per_prompt=4,
        base_seed=5,
        num_steps=STEPS,
        height=side,
        width=side,
        sampler=rollout_pb2.SAMPLER_TYPE_ODE,
        images=False,
        manifest_only=True,
    )
    return list(client.stream(request))[-1].message.denoise_seconds / STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        servers = {
            preset: LocalServer.start(
                Path(scratch) / f"{preset}.log", "--model", preset, "--threads", str(args.threads)
            )
            for preset in CASES
        }
        runs: dict[str, list[float]] = {preset: [] for preset in CASES}
        try:
            clients = {name: RolloutClient(server.address, timeout=600) for name, server in servers.items()}
            for _ in range(args.repeats + 1):  # the first round warms up
                for preset, side in CASES.items():
                    runs[preset].append(step_seconds(clients[preset], side))
        finally:
            for server in servers.values():
                server.stop()
    medians = {preset: statistics.median(seconds[1:]) for preset, seconds in runs.items()}
    print("| model | size | seconds per step (16 samples) |")
    print("|---|---|---|")
    for preset, side in CASES.items():
        print(f"| {preset} | {side} x {side} | {medians[preset]:.4f} |")
    print(f"\nshapes / tiny-flux: {medians['shapes'] / medians['tiny-flux']:.2f}x")


if __name__ == "__main__":
    main()
