"""Tree rollouts against flat rollouts of as many leaves: transformer rows, and wall seconds per leaf.

Each case is a tree request and its flat twin: the same prompt, steps, sampler and stochastic steps,
and as many samples as the tree has leaves (one root). The rows are what the server reports
(``RolloutFinished.transformer_rows``: per step, one per distinct latent, per CFG branch); the
seconds run from the request to its finished event at the client, latents streamed as a trainer
takes them (around the stochastic steps), images off unless --images. After a warm-up pair, each
round runs the tree and the flat request back to back, the first of them flipping every round;
printed per case: the rows of each, their ratio, the median seconds per leaf of each and the median
of the per-round ratios tree / flat.

* ``branchgrpo``: BranchGRPO's layout, 20 steps split in two at steps 0, 3, 6 and 9 (16 leaves;
  203 rows against 320 per CFG branch), every step stochastic.
* ``treegrpo``: a TreeGRPO window, 20 steps with SDE steps 2-5 only, each splitting in two
  (16 leaves), the other steps ODE.

Then (unless --iterations 0) reward against wall-clock: ``examples/train_grpo.py`` runs twice on the
same server with the same leaves per iteration, flat (one prompt x 32 samples) and as trees (4 roots
forking at steps 0, 2 and 4 into 8 leaves each, BranchGRPO's mean-fused advantages), on the shapes
reward of --prompt; printed: each run's reward over its first and last quarter of iterations, its
seconds per iteration, and the reward at equal wall-clock times; plotted: reward against cumulative
seconds (--plot).

    python bench/tree.py                       # the shapes preset at 64 x 64, CFG 3
    python bench/tree.py --model tiny-flux --size 128 --rounds 5 --iterations 0
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rollout.v1 import rollout_pb2
from rollout_client import Finished, RolloutClient
from rollout_core.local_server import LocalServer

CASES = {
    "branchgrpo": {"num_steps": 20, "branches": [(0, 2), (3, 2), (6, 2), (9, 2)], "stochastic_steps": []},
    "treegrpo": {
        "num_steps": 20,
        "branches": [(2, 2), (3, 2), (4, 2), (5, 2)],
        "stochastic_steps": [2, 3, 4, 5],
    },
}
PROMPT = "a red circle and a blue square"
ROOT = Path(__file__).resolve().parents[1]
# The training comparison: 32 leaves per iteration either way.
REWARD = "rollout_client.rewards.shapes:geneval_reward"
TRAINING = ["--reward", REWARD, "--steps", "8", "--size", "64", "--lr", "5e-4"]
SHAPES = {"flat": ["--group-size", "32"], "tree": ["--group-size", "4", "--tree", "0:2,2:2,4:2"]}


def requests(
    case: dict, args: argparse.Namespace, seed: int
) -> tuple[rollout_pb2.RolloutRequest, rollout_pb2.RolloutRequest]:
    """(tree, flat) requests of one case, the flat one with as many samples as the tree has leaves."""
    leaves = 1
    for _, factor in case["branches"]:
        leaves *= factor
    common = {
        "prompts": [PROMPT],
        "height": args.size,
        "width": args.size,
        "num_steps": case["num_steps"],
        "stochastic_steps": case["stochastic_steps"],
        "latents": rollout_pb2.LATENT_SELECTION_AROUND_STOCHASTIC,
        "images": args.images,
        "base_seed": seed,
    }
    branches = [rollout_pb2.Branch(step=step, factor=factor) for step, factor in case["branches"]]
    tree = rollout_pb2.RolloutRequest(samples_per_prompt=1, branches=branches, **common)
    flat = rollout_pb2.RolloutRequest(samples_per_prompt=leaves, **common)
    return tree, flat


def timed(client: RolloutClient, request: rollout_pb2.RolloutRequest) -> tuple[float, int]:
    """(wall seconds to the finished event, transformer rows) of one rollout."""
    start = time.perf_counter()
    finished = next(event for event in client.stream(request) if isinstance(event, Finished))
    return time.perf_counter() - start, finished.message.transformer_rows


def measure(client: RolloutClient, tree, flat, rounds: int) -> tuple:
    """(rows tree, rows flat, median s per leaf tree, flat, median time ratio tree / flat)."""
    leaves = flat.samples_per_prompt
    per_leaf: dict[str, list[float]] = {"tree": [], "flat": []}
    rows, ratios = {}, []
    for r in range(rounds):
        order = [("tree", tree), ("flat", flat)][:: 1 if r % 2 == 0 else -1]
        seconds = {}
        for kind, request in order:
            seconds[kind], rows[kind] = timed(client, request)
            per_leaf[kind].append(seconds[kind] / leaves)
        ratios.append(seconds["tree"] / seconds["flat"])
    medians = [statistics.median(per_leaf[kind]) for kind in ("tree", "flat")]
    return rows["tree"], rows["flat"], *medians, statistics.median(ratios)


def train(address: str, kind: str, args: argparse.Namespace, out: Path) -> list[dict]:
    """One training run of the comparison on the server at ``address``: its metrics rows."""
    command = [
        sys.executable,
        str(ROOT / "examples" / "train_grpo.py"),
        "--server",
        address,
        *TRAINING,
        *SHAPES[kind],
        "--prompt",
        args.prompt,
        "--iterations",
        str(args.iterations),
        "--out",
        str(out / kind),
        "--threads",
        str(args.threads),
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(out / kind / "metrics.csv") as file:
        return list(csv.DictReader(file))


def reward_at(rows: list[dict], seconds: float) -> float:
    """The mean reward of the iterations that ended by ``seconds`` of the run, the last 5 of them."""
    elapsed, done = 0.0, []
    for row in rows:
        elapsed += float(row["iteration_seconds"])
        if elapsed > seconds:
            break
        done.append(float(row["reward_mean"]))
    return statistics.mean(done[-5:]) if done else float("nan")


def compare_training(address: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as out:
        runs = {kind: train(address, kind, args, Path(out)) for kind in SHAPES}
    quarter = max(args.iterations // 4, 1)
    leaves = f"32 leaves per iteration, {args.iterations} iterations"
    print(f"\nreward against wall-clock: {args.prompt!r}, {leaves}\n")
    print("| run | reward, first quarter | reward, last quarter | s per iteration | seconds in all |")
    print("|---|---|---|---|---|")
    totals = {}
    for kind, rows in runs.items():
        rewards = [float(row["reward_mean"]) for row in rows]
        seconds = [float(row["iteration_seconds"]) for row in rows]
        totals[kind] = sum(seconds)
        first, last = statistics.mean(rewards[:quarter]), statistics.mean(rewards[-quarter:])
        print(
            f"| {kind} | {first:.3f} | {last:.3f} | {statistics.median(seconds):.1f} | {totals[kind]:.0f} |"
        )
    marks = [min(totals.values()) * k / 4 for k in (1, 2, 3, 4)]
    print("\n| wall-clock s | " + " | ".join(f"{mark:.0f}" for mark in marks) + " |")
    print("|---|" + "---|" * len(marks))
    for kind, rows in runs.items():
        print(f"| {kind} reward | " + " | ".join(f"{reward_at(rows, mark):.3f}" for mark in marks) + " |")
    if args.plot:
        plot(runs, args.plot)


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=120)
    for kind, rows in runs.items():
        elapsed, total = [], 0.0
        for row in rows:
            total += float(row["iteration_seconds"])
            elapsed.append(total)
        axis.plot(elapsed, [float(row["reward_mean"]) for row in rows], marker="o", markersize=3, label=kind)
    axis.set_xlabel("wall-clock seconds")
    axis.set_ylabel("dense shapes reward")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", action="store_true", help="decode and stream every leaf's image")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--iterations", type=int, default=40, help="of each training run (0: no training)")
    parser.add_argument("--prompt", default="a purple circle", help="the training runs' prompt")
    parser.add_argument("--plot", type=Path, help="write the reward against wall-clock plot here")
    args = parser.parse_args()
    table = []
    with tempfile.TemporaryDirectory() as logs:
        options = ("--model", args.model, "--threads", str(args.threads), "--device", args.device)
        server = LocalServer.start(Path(logs) / "server.log", *options)
        try:
            with RolloutClient(server.address, timeout=600) as client:
                timed(client, requests(CASES["branchgrpo"], args, 0)[0])  # warm-up
                for name in args.cases.split(","):
                    tree, flat = requests(CASES[name], args, 1)
                    table.append((name, flat.samples_per_prompt, *measure(client, tree, flat, args.rounds)))
            print_rows(args, table)
            if args.iterations and args.model == "shapes":  # the reward is the shapes task's
                compare_training(server.address, args)
        finally:
            server.stop()


def print_rows(args: argparse.Namespace, table: list[tuple]) -> None:
    images = "on" if args.images else "off"
    print(f"\n{args.model} at {args.size} x {args.size}, {args.rounds} rounds, images {images}\n")
    print(
        "| case | leaves | rows tree | rows flat | rows tree / flat | s per leaf tree | s per leaf flat "
        "| time tree / flat |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, leaves, tree_rows, flat_rows, tree_s, flat_s, ratio in table:
        print(
            f"| {name} | {leaves} | {tree_rows} | {flat_rows} | {tree_rows / flat_rows:.3f} | {tree_s:.4f} "
            f"| {flat_s:.4f} | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
