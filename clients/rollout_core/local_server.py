"""Run ``rollout-server serve`` as a child process on a free loopback port (a trainer's own server,
demos, tests, benchmarks, Ray's replicas). It imports nothing of the server: the child is a process of
its own, and this module knows it only by its command line and the line it logs once it serves.

Imports the standard library only."""

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SERVING_LINE = re.compile(r"serving .* at (?P<address>\S+:\d+)$")


@dataclass
class LocalServer:
    """A server child process; its output goes to ``log_path``."""

    process: subprocess.Popen
    address: str
    log_path: Path

    @classmethod
    def start(
        cls,
        log_path: Path,
        *args: str,
        launcher: tuple[str, ...] = (),
        timeout: float = 120.0,
        preexec_fn: Callable[[], None] | None = None,
        cwd: Path | None = None,
    ) -> "LocalServer":
        """Start ``rollout-server serve --port 0 ARGS`` (under ``python LAUNCHER``, e.g. torchrun's
        ``-m torch.distributed.run --nproc-per-node 2``) in ``cwd`` and return once it accepts
        connections. ``preexec_fn`` runs in the child before the server starts."""
        command = [sys.executable, *launcher, "-m", "rollout_server", "serve", "--port", "0", *args]
        with log_path.open("w") as log:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn, cwd=cwd
            )
        return cls.once_serving(process, log_path, timeout)

    @classmethod
    def once_serving(cls, process: "subprocess.Popen", log_path: Path, timeout: float) -> "LocalServer":
        """The server that ``process`` (anything with Popen's poll, returncode, send_signal, wait and
        kill) runs, once its log at ``log_path`` names its address and it accepts connections."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = next(filter(None, map(SERVING_LINE.search, log_path.read_text().splitlines())), None)
            if match:
                # A TCP connection, not a gRPC call: it works whatever the TLS and token options.
                host, port = match["address"].rsplit(":", 1)
                wait = max(deadline - time.monotonic(), 1)
                socket.create_connection((host, int(port)), timeout=wait).close()
                return cls(process, match["address"], log_path)
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
            time.sleep(0.1)
        process.kill()
        raise TimeoutError(f"server did not start within {timeout:.0f} s:\n{log_path.read_text()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (SIGTERM: graceful shutdown) and return the exit status; kill it if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
