"""RL on the shapes task under one wall-clock budget: five algorithms, two training seeds each, every
run evaluated on the same 256 held-out images before and after (paired), on its EMA where it keeps one.

Each run is ``examples/train_grpo.py`` on its own shapes server with the shared flags below, one of the
``ALGORITHMS``' flags, ``--seed`` and ``--time-budget`` (seconds for the whole run, its two evals
included; ``--iterations`` is each algorithm's cosine horizon, about what fits the budget on 2 cores).
A run whose eval.json is complete is not run again, so the bench resumes where it stopped. Printed: a
markdown table per run (accuracy before -> after +- its standard error, the paired difference +- its
standard error, per task type, the dense reward of the first and last 10 iterations, the final
velocity-norm ratio to the base model, the largest ratio deviation (the on-policy proof of the
ratio-based ones; NaN for the forward-process ones), iterations and seconds) and one per algorithm
(the mean over the seeds); plotted (--plot): the paired differences with their error bars, and each
run's dense reward.

    python bench/shapes_rl.py --out shapes-rl                 # all of it: about 75 minutes on 2 cores
    python bench/shapes_rl.py --out shapes-rl --only nft-anchored --seeds 2024
"""

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = [
    "--model", "shapes", "--prompt-set", "shapes",
    "--reward", "rollout_client.rewards.shapes:geneval_reward",
    "--steps", "8", "--size", "64", "--threads", "2", "--prompts", "4",
    "--eval-every", "100000", "--eval-samples", "4", "--checkpoint-every", "10",
]  # fmt: skip
ALGORITHMS = {
    # FlowGRPO as `make train-shapes` ran it before: all 8 steps stochastic, PPO's clip.
    "flowgrpo": ["--group-size", "8", "--lr", "5e-4", "--iterations", "75"],
    # Flow-GRPO-Fast's window of 2 SDE steps in the first half, with GRPO-Guard's ratio.
    "flowgrpo-window-guard": [
        "--group-size", "8", "--lr", "5e-4", "--iterations", "120", "--window", "2", "--grpo-guard",
    ],
    # One root per prompt forking into 4 at step 0 and 2 at step 1, deterministic after: 8 leaves that
    # share their initial noise and differ only in the first two (layout) steps.
    "tree-early": [
        "--group-size", "1", "--tree", "0:4,1:2", "--tree-sde", "forks",
        "--lr", "5e-4", "--iterations", "140",
    ],
    # DiffusionNFT with the official scripts' x0 loss, an old policy, the high-noise half, an anchor
    # to the base model and an EMA for the evals.
    "nft-anchored": [
        "--group-size", "16", "--algorithm", "nft", "--lr", "3e-4", "--iterations", "50",
        "--nft-loss", "x0", "--nft-anchor", "2", "--nft-old-decay", "0.5", "--nft-old-ramp", "20",
        "--nft-min-level", "0.5", "--ema-decay", "0.9",
    ],
    # AWM with the robust weighting and a KL to the EMA.
    "awm": [
        "--group-size", "16", "--algorithm", "awm", "--lr", "3e-4", "--iterations", "58",
        "--awm-power", "0.25", "--ema-decay", "0.9", "--awm-kl", "1",
    ],
}  # fmt: skip
TASKS = ("single", "counting", "two_objects", "position")


def run(out: Path, name: str, seed: int, budget: float) -> Path:
    folder = out / f"{name}-s{seed}"
    if complete(folder):
        return folder
    command = [sys.executable, str(ROOT / "examples" / "train_grpo.py"), *SHARED, *ALGORITHMS[name]]
    command += ["--seed", str(seed), "--time-budget", f"{budget:g}", "--out", str(folder)]
    print(f"running {name} seed {seed}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    with open(out / f"{name}-s{seed}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return folder


def complete(folder: Path) -> bool:
    path = folder / "eval.json"
    return path.exists() and "paired" in json.loads(path.read_text())


def summary(folder: Path) -> dict:
    tables = json.loads((folder / "eval.json").read_text())
    with open(folder / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    rewards = [float(row["reward_mean"]) for row in rows]
    return {
        "paired": tables["paired"],
        "before_se": tables["before"]["accuracy"]["se"],
        "after_se": tables["after"]["accuracy"]["se"],
        "tasks": {
            task: (
                tables["before"][task]["correct"],
                tables["after"][task]["correct"],
                tables["after"][task]["total"],
            )
            for task in TASKS
        },
        "reward_first": statistics.mean(rewards[:10]),
        "reward_last": statistics.mean(rewards[-10:]),
        "rewards": rewards,
        "velocity_norm_ratio": float(rows[-1]["velocity_norm_ratio"]),
        "ratio_max_dev": max(float(row["ratio_max_dev"]) for row in rows),
        "iterations": len(rows),
        "seconds": sum(float(row["iteration_seconds"]) for row in rows),
    }


def percent(value: float) -> str:
    return f"{100 * value:.1f}"


def print_tables(results: dict[tuple[str, int], dict]) -> None:
    print(
        "| algorithm | seed | accuracy before -> after (%) | paired difference (points) | "
        + " | ".join(TASKS)
        + " | dense reward, first -> last 10 | velocity norm / base | ratio_max_dev | iterations | s |"
    )
    print("|---|---|---|---|" + "---|" * len(TASKS) + "---|---|---|---|---|")
    for (name, seed), s in results.items():
        p = s["paired"]
        tasks = " | ".join(f"{b} -> {a} / {t}" for b, a, t in s["tasks"].values())
        print(
            f"| {name} | {seed} | {percent(p['before'])} +- {percent(s['before_se'])} -> "
            f"{percent(p['after'])} +- {percent(s['after_se'])} | "
            f"{100 * p['difference']:+.1f} +- {percent(p['se'])} | {tasks} | "
            f"{s['reward_first']:.3f} -> {s['reward_last']:.3f} | {s['velocity_norm_ratio']:.3f} | "
            f"{s['ratio_max_dev']:.1e} | {s['iterations']} | {s['seconds']:.0f} |"
        )
    print()
    print("| algorithm | mean paired difference over the seeds (points) | each seed |")
    print("|---|---|---|")
    for name in dict.fromkeys(name for name, _ in results):
        differences = [100 * s["paired"]["difference"] for (n, _), s in results.items() if n == name]
        each = ", ".join(f"{d:+.1f}" for d in differences)
        print(f"| {name} | {statistics.mean(differences):+.1f} | {each} |")


def plot(results: dict[tuple[str, int], dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=120)
    labels = [f"{name}\nseed {seed}" for name, seed in results]
    differences = [100 * s["paired"]["difference"] for s in results.values()]
    errors = [100 * s["paired"]["se"] for s in results.values()]
    left.bar(range(len(labels)), differences, yerr=errors, capsize=3, color="tab:blue")
    left.axhline(0, color="black", linewidth=0.8)
    left.set_xticks(range(len(labels)), labels, fontsize=6, rotation=60, ha="right")
    left.set_ylabel("held-out strict accuracy, after - before (points)")
    left.grid(axis="y", alpha=0.3)
    for (name, seed), s in results.items():
        rewards = s["rewards"]
        window = 5
        smooth = [statistics.mean(rewards[max(0, k - window + 1) : k + 1]) for k in range(len(rewards))]
        fraction = [k / max(len(rewards) - 1, 1) for k in range(len(rewards))]
        right.plot(fraction, smooth, label=f"{name} s{seed}", linewidth=1)
    right.set_xlabel("fraction of the run (same wall-clock budget)")
    right.set_ylabel("dense reward of the rollouts (mean of 5)")
    right.legend(fontsize=6)
    right.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("shapes-rl"))
    parser.add_argument("--budget", type=float, default=420.0, help="seconds per run, evals included")
    parser.add_argument("--seeds", type=int, nargs="+", default=[2024, 2025])
    parser.add_argument("--only", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS))
    parser.add_argument("--plot", type=Path, help="write the figure here")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in args.seeds:
        for name in args.only:
            results[name, seed] = summary(run(args.out, name, seed, args.budget))
    results = dict(sorted(results.items(), key=lambda item: list(ALGORITHMS).index(item[0][0])))
    print_tables(results)
    if args.plot:
        plot(results, args.plot)
    if any(math.isnan(s["velocity_norm_ratio"]) for s in results.values()):
        print("(a NaN velocity ratio: a run trained all parameters, which has no base to compare)")


if __name__ == "__main__":
    main()
