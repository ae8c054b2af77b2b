"""The trainer's runs as the tests start them: its command line on a tiny run, in this process or in
a background one, and its metrics.csv read back."""

import csv
import time
from collections.abc import Callable
from pathlib import Path

from rollout_client.train.metrics import COLUMNS
from support import forked
from support.forked import ForkedProcess
from support.servers import run_example, start_server

# Columns every iteration times (above 0).
TIMED = ("rollout_seconds", "train_seconds", "update_seconds")
TINY = ["--iterations", "3", "--prompts", "2", "--group-size", "3", "--steps", "3", "--size", "64"]
# A safety net against a trainer that hangs, not a timing assertion.
WAIT_SECONDS = 180


def trainer_args(address: str, out, *flags: str) -> list:
    """The trainer's command line after ``python examples/train_grpo.py``."""
    return ["--server", address, *TINY, *flags, "--out", out]


def same_for_any_run(row: dict) -> dict:
    """A metrics row without what two runs with the same seeds may differ in: the server's policy
    versions, the timings, and the velocity-norm ratio (measured at the points of the process's first
    rollout, which for a resumed run is its first after resuming)."""
    return {
        name: value
        for name, value in row.items()
        if not name.endswith(("_version", "_seconds")) and name != "velocity_norm_ratio"
    }


def read_metrics(out) -> list[dict]:
    with open(out / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0])[: len(COLUMNS)] == COLUMNS
    return rows


def run_trainer(address: str, out, *flags: str) -> list[dict]:
    """The trainer in this process (a process of its own only where its boundary is what a test
    checks): its metrics.csv rows."""
    run_example("train_grpo", *trainer_args(address, out, *flags))
    return read_metrics(out)


def start_trainer(address: str, out: Path, *flags: str) -> tuple[ForkedProcess, Path]:
    """A trainer process in the background; its output goes to the returned log file."""
    log = out.with_name(out.name + ".log")
    return ForkedProcess(trainer_args(address, out, *flags), log, main=forked.train), log


def wait_until(process: ForkedProcess, log: Path, condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds; fails if the trainer exits first."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        exited = process.poll() is not None  # polled before the check: what it did before exiting counts
        if condition():
            return
        assert not exited, f"the trainer exited with {process.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"still waiting after {WAIT_SECONDS} s:\n{log.read_text()}"
        time.sleep(0.05)


def metrics_rows(out: Path) -> int:
    """The iterations a running trainer has finished: the whole rows of its metrics.csv, after the
    header."""
    path = out / "metrics.csv"
    return max(path.read_text().count("\n") - 1, 0) if path.exists() else 0


def training_server(cache_dir: Path, log: Path):
    """A server the trainer runs share: each run pushes its own policy before its first rollout, so a
    run sees nothing of the ones before it. It holds a rollout at its prune point for as long as the
    trainer takes to score it."""
    return start_server(cache_dir, log, "--prune-hold-seconds", "3600")
