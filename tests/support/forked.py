"""Test servers and trainers forked from one interpreter that has imported their modules.

Importing torch, diffusers, transformers and peft costs a new interpreter about 9 CPU seconds, and a
run starts about 70 servers; forking from a process that imported them once costs milliseconds. A
forked server runs ``rollout-server serve`` exactly as the console script does (``cli.run``: the same
argument parsing, signal handling and exit); a forked trainer runs ``examples/train_grpo.py`` as its
``__main__``, as ``python examples/train_grpo.py`` does. Their output goes to a log file. The fork
server imports and runs nothing else (no torch kernel, no gRPC object exists before a fork). Tests of
the command itself, of torchrun and of a working directory start real interpreters
(``LocalServer.start``)."""

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

from rollout_server.families import registry

TRAINER = Path(__file__).resolve().parents[2] / "examples" / "train_grpo.py"
# What a server and the trainer import before they read their arguments; the rest is imported in the
# forked process.
PRELOAD = [
    "support.forked",
    "rollout_server.cli",
    "rollout_server.server",
    "rollout_server.families",
    # Every family's adapter (torch and diffusers with it): the families package itself imports none.
    *(f"{family.package}.adapter" for family in registry.specs()),
    "rollout_client.train",
]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def _log_to(log_path: str) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def serve(argv: list[str], log_path: str) -> None:
    """The forked process: ``rollout-server ARGV`` with stdout and stderr in ``log_path``."""
    _log_to(log_path)
    sys.argv = ["rollout-server", *argv]  # what the console script's process would hold
    from rollout_server import cli

    cli.run()


def train(argv: list[str], log_path: str) -> None:
    """The forked process: ``python examples/train_grpo.py ARGV`` with stdout and stderr in ``log_path``
    (an exit message and an uncaught exception's traceback too, and the exit code a script's)."""
    _log_to(log_path)
    sys.argv = [str(TRAINER), *map(str, argv)]
    runpy.run_path(str(TRAINER), run_name="__main__")


class ForkedProcess:
    """``subprocess.Popen``'s interface (what LocalServer and the tests use) over a forked process."""

    def __init__(self, argv: list[str], log_path: Path, main=serve):
        self.args = argv
        log_path.write_text("")  # there before the process is: the caller reads it at once
        self._process = _CONTEXT.Process(target=main, args=(argv, str(log_path)), daemon=True)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
