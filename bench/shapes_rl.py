"""RL on the shapes task under one wall-clock budget: six algorithms, two training seeds each, every
run evaluated on the same 256 held-out images before and after (paired), on its EMA where it keeps one,
at the training's sampling settings (8 steps) and at the server's defaults (its steps and CFG).

Each run is ``examples/train_grpo.py`` on its own shapes server with the shared flags below, one of the
``ALGORITHMS``' flags, ``--seed`` and ``--time-budget`` (seconds for the whole run, its two evals
included; ``--iterations`` is each algorithm's cosine horizon, about what fits the budget on 2 cores).
A run whose eval.json is complete is not run again, so the bench resumes where it stopped. Printed: a
markdown table per run (accuracy before -> after +- its standard error, the paired difference +- its
standard error, the same at the server's defaults, per task type, the dense reward of the first and
last 10 iterations, the final velocity-norm ratio to the base model, the largest ratio deviation (the
on-policy proof of the ratio-based ones; NaN for the forward-process ones), iterations, the seconds of
the iterations and the run's wall seconds) and one per algorithm
(the mean over the seeds, and points per minute of the run); plotted (--plot): each run's held-out
accuracy against its wall-clock seconds (before at 0, each eval of --eval-every at the seconds its
iteration started, after at the run's end), with error bars, and each run's dense reward.

    python bench/shapes_rl.py --out shapes-rl                 # all of it: about 90 minutes on 2 cores
    python bench/shapes_rl.py --out shapes-rl --only nft-anchored --seeds 2024
    python bench/shapes_rl.py --out shapes-rl --only step-grpo awm --threads 1 --parallel 2
"""

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = [
    "--model", "shapes", "--prompt-set", "shapes",
    "--reward", "rollout_client.rewards.shapes:geneval_reward",
    "--steps", "8", "--size", "64", "--prompts", "4",
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
    # Step-GRPO: one root a prompt forking into 4 at step 0, each child into 2 at steps 2 and 4 (16
    # leaves), stochastic at the forks only; each fork's children rewarded on their previews at the
    # next fork (the leaves on their images) and standardised among their siblings; an EMA evaluated.
    "step-grpo": [
        "--group-size", "1", "--algorithm", "step-grpo", "--tree", "0:4,2:2,4:2", "--tree-sde", "forks",
        "--lr", "5e-4", "--iterations", "100", "--ema-decay", "0.9",
    ],
}  # fmt: skip
TASKS = ("single", "counting", "two_objects", "position")


def run(out: Path, name: str, seed: int, budget: float, threads: int) -> Path:
    """The run's folder, complete: trained now unless an earlier bench completed it (a run stopped half
    way starts again: its budget counts from its process's start)."""
    folder = out / f"{name}-s{seed}"
    if complete(folder):
        return folder
    command = [sys.executable, str(ROOT / "examples" / "train_grpo.py"), *SHARED, *ALGORITHMS[name]]
    command += ["--seed", str(seed), "--time-budget", f"{budget:g}", "--out", str(folder)]
    command += ["--threads", str(threads)]
    print(f"running {name} seed {seed}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(out / f"{name}-s{seed}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    # The whole run's wall-clock, its server's start and its final eval included.
    (folder / "wall_seconds").write_text(f"{time.perf_counter() - start:.1f}\n")
    return folder


def complete(folder: Path) -> bool:
    path = folder / "eval.json"
    return path.exists() and "paired" in json.loads(path.read_text())


def summary(folder: Path) -> dict:
    tables = json.loads((folder / "eval.json").read_text())
    with open(folder / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    rewards = [float(row["reward_mean"]) for row in rows]
    seconds = sum(float(row["iteration_seconds"]) for row in rows)
    wall = folder / "wall_seconds"
    # (seconds into the run, accuracy, se): before, each eval of --eval-every, after.
    started = 0.0
    evals = []
    for row in rows:
        if row["eval_accuracy"] != "nan":
            evals.append((started, float(row["eval_accuracy"]), float(row["eval_se"])))
        started += float(row["iteration_seconds"])
    wall_seconds = float(wall.read_text()) if wall.exists() else seconds
    evals.append((wall_seconds, tables["after"]["accuracy"]["mean"], tables["after"]["accuracy"]["se"]))
    return {
        "paired": tables["paired"],
        "defaults": tables.get("defaults", {}).get("paired"),
        "evals": evals,
        "wall_seconds": wall_seconds,
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
        "seconds": seconds,
    }


def percent(value: float) -> str:
    return f"{100 * value:.1f}"


def print_tables(results: dict[tuple[str, int], dict]) -> None:
    print(
        "| algorithm | seed | accuracy before -> after (%) | paired difference (points) | "
        "at the server's defaults: before -> after (%), paired (points) | "
        + " | ".join(TASKS)
        + " | dense reward, first -> last 10 | velocity norm / base | ratio_max_dev | iterations | s "
        "| wall s |"
    )
    print("|---|---|---|---|---|" + "---|" * len(TASKS) + "---|---|---|---|---|---|")
    for (name, seed), s in results.items():
        p, d = s["paired"], s["defaults"]
        tasks = " | ".join(f"{b} -> {a} / {t}" for b, a, t in s["tasks"].values())
        defaults = "not measured"
        if d is not None:
            defaults = f"{percent(d['before'])} -> {percent(d['after'])}, "
            defaults += f"{100 * d['difference']:+.1f} +- {percent(d['se'])}"
        print(
            f"| {name} | {seed} | {percent(p['before'])} +- {percent(s['before_se'])} -> "
            f"{percent(p['after'])} +- {percent(s['after_se'])} | "
            f"{100 * p['difference']:+.1f} +- {percent(p['se'])} | {defaults} | {tasks} | "
            f"{s['reward_first']:.3f} -> {s['reward_last']:.3f} | {s['velocity_norm_ratio']:.3f} | "
            f"{s['ratio_max_dev']:.1e} | {s['iterations']} | {s['seconds']:.0f} | {s['wall_seconds']:.0f} |"
        )
    print()
    print(
        "| algorithm | mean paired difference over the seeds (points) | each seed | at the server's "
        "defaults, each seed | points per minute of the run (mean) |"
    )
    print("|---|---|---|---|---|")
    for name in dict.fromkeys(name for name, _ in results):
        runs = [s for (n, _), s in results.items() if n == name]
        differences = [100 * s["paired"]["difference"] for s in runs]
        each = ", ".join(f"{d:+.1f}" for d in differences)
        defaults = ", ".join(
            "-" if s["defaults"] is None else f"{100 * s['defaults']['difference']:+.1f}" for s in runs
        )
        per_minute = statistics.mean(100 * s["paired"]["difference"] / (s["wall_seconds"] / 60) for s in runs)
        print(f"| {name} | {statistics.mean(differences):+.1f} | {each} | {defaults} | {per_minute:+.2f} |")


def plot(results: dict[tuple[str, int], dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=120)
    colours = {name: f"C{k}" for k, name in enumerate(dict.fromkeys(name for name, _ in results))}
    for (name, seed), s in results.items():
        seconds, accuracy, se = zip(*s["evals"], strict=True)
        left.errorbar(
            seconds,
            [100 * a for a in accuracy],
            yerr=[100 * e for e in se],
            marker="o" if seed == min(seed for _, seed in results) else "s",
            markersize=3,
            capsize=2,
            linewidth=1,
            color=colours[name],
            label=f"{name} s{seed}",
        )
    left.set_xlabel("wall-clock seconds into the run (evals included)")
    left.set_ylabel("held-out strict accuracy (%), 256 images")
    left.legend(fontsize=6)
    left.grid(alpha=0.3)
    for (name, seed), s in results.items():
        rewards = s["rewards"]
        window = 5
        smooth = [statistics.mean(rewards[max(0, k - window + 1) : k + 1]) for k in range(len(rewards))]
        fraction = [k / max(len(rewards) - 1, 1) for k in range(len(rewards))]
        right.plot(fraction, smooth, label=f"{name} s{seed}", linewidth=1, color=colours[name])
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
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run's trainer")
    parser.add_argument(
        "--parallel", type=int, default=1, help="runs at once (each with its server), in the order listed"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [(name, seed) for seed in args.seeds for name in args.only]
    with ThreadPoolExecutor(args.parallel) as pool:
        folders = list(pool.map(lambda run_of: run(args.out, *run_of, args.budget, args.threads), todo))
    results = {run_of: summary(folder) for run_of, folder in zip(todo, folders, strict=True)}
    results = dict(sorted(results.items(), key=lambda item: list(ALGORITHMS).index(item[0][0])))
    print_tables(results)
    if args.plot:
        plot(results, args.plot)
    if any(math.isnan(s["velocity_norm_ratio"]) for s in results.values()):
        print("(a NaN velocity ratio: a run trained all parameters, which has no base to compare)")


if __name__ == "__main__":
    main()
