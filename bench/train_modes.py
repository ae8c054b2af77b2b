"""Trainer wall time per iteration: sync, sync scoring steps while they stream, and async (one version
stale), in one run with the same settings and seeds.

Each mode runs ``examples/train_grpo.py`` for --iterations on a server of its own (started by the
trainer, one torch thread; the trainer has one more). Printed per mode: the median seconds per
iteration after the first (the first has no rollout to overlap with in async mode, and pays one-off
costs in every mode), its ratio to sync, and the medians of the rollout, train and update phases as
the trainer measured them. In async mode an iteration first takes the rollout that streamed while the
previous one trained, then pushes; its rollout seconds are those of that rollout.

    python bench/train_modes.py
    python bench/train_modes.py --iterations 12 --group-size 16
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TRAINER = Path(__file__).resolve().parent.parent / "examples" / "train_grpo.py"
MODES = {"sync": [], "sync, scored while streaming": ["--score-while-streaming"], "async": ["--async"]}
PHASES = ["rollout_seconds", "train_seconds", "update_seconds"]


def run_mode(flags: list[str], settings: list[str], out: Path) -> list[dict]:
    command = [sys.executable, str(TRAINER), *settings, *flags, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    with open(out / "metrics.csv") as file:
        return list(csv.DictReader(file))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    settings = [
        *("--iterations", str(args.iterations), "--prompts", str(args.prompts)),
        *("--group-size", str(args.group_size), "--steps", str(args.steps), "--size", str(args.size)),
    ]
    print(
        f"tiny-flux {args.size}px, {args.prompts} prompts x {args.group_size} samples, {args.steps} steps, "
        f"{args.iterations} iterations per mode (medians over iterations 1..{args.iterations - 1})"
    )
    print(f"{'mode':<30} {'s/iteration':>11} {'vs sync':>8} {'rollout':>8} {'train':>8} {'update':>8}")
    baseline = None
    with tempfile.TemporaryDirectory() as folder:
        for name, flags in MODES.items():
            rows = run_mode(flags, settings, Path(folder) / name.replace(" ", "-").replace(",", ""))[1:]
            seconds = statistics.median(float(row["iteration_seconds"]) for row in rows)
            baseline = baseline or seconds
            phases = [statistics.median(float(row[phase]) for row in rows) for phase in PHASES]
            print(
                f"{name:<30} {seconds:>11.2f} {baseline / seconds:>7.2f}x "
                + " ".join(f"{value:>8.2f}" for value in phases)
            )


if __name__ == "__main__":
    main()
