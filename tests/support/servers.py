"""Real servers and processes: ``rollout-server serve`` forked from the preloaded fork server, examples and
the command line run in this process, the servers' logs, metrics and memory, and SP=2 runs."""

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rollout_client import RolloutClient
from rollout_core.local_server import LocalServer
from support.forked import ForkedProcess
from support.requests import Rollout, split_events

ROOT = Path(__file__).resolve().parents[2]
# The torch threads of every server a test starts: 1 by default (two test workers share 2 cores);
# TEST_SERVER_THREADS=2 runs the suite with servers whose kernels split their reductions otherwise.
SERVER_THREADS = os.environ.get("TEST_SERVER_THREADS", "1")


def start_server(cache_dir: Path, log_path: Path, *args: str, timeout: float = 120.0) -> LocalServer:
    """A real ``rollout-server serve`` on a free loopback port, sharing the session's preset cache, in
    a process forked from the preloaded fork server (forked.py)."""
    argv = ["serve", "--port", "0", "--cache-dir", str(cache_dir), "--threads", SERVER_THREADS, *args]
    return LocalServer.once_serving(ForkedProcess(argv, log_path), log_path, timeout)


def example_module(name: str):
    """``examples/{name}.py`` as a module: its functions and its argument parser."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def at_server_threads():
    """Compute inside at the servers' torch thread count: a CPU kernel splits its reductions by the
    threads it runs on, so a reference compared bitwise with a server's output must use as many."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(SERVER_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_example(name: str, *argv) -> None:
    """Run ``examples/{name}.py ARGV`` in this process, as its command line would: a failure raises
    (SystemExit with the run's one-line reason). The torch threads and global RNG state of the test
    process are restored after: an example sets both for its run."""
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            example_module(name).main([str(arg) for arg in argv])
    finally:
        torch.set_num_threads(threads)


def command_line_exit(*argv: str) -> str:
    """Run ``rollout-server`` with ``argv`` in this process, expecting it to refuse: the message it exits
    with. Any other exception escapes, as a traceback would in a terminal."""
    from rollout_server import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    return exited.value.code


def vm_rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid``."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def imported_modules(script: str, *args: str) -> tuple[int, set[str]]:
    """Run the console script ``script`` with ``args`` under ``python -X importtime``: its exit status
    and every module it imported."""
    command = [sys.executable, "-X", "importtime", str(Path(sys.executable).with_name(script)), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    return result.returncode, {line.rsplit("|", 1)[1].strip() for line in lines[1:]}  # [0]: the header


METRICS_LINE = re.compile(r"metrics at (?P<url>http://\S+/metrics)")
HTTP_LINE = re.compile(r"SGLang-compatible HTTP API at (?P<url>https?://\S+) ")


def metrics_url(server: LocalServer) -> str:
    """The /metrics address of a server started with ``--metrics-port``, from its log."""
    return METRICS_LINE.search(server.log())["url"]


def http_url(server: LocalServer) -> str:
    """The HTTP front end's address of a server started with ``--http-port``, from its log."""
    return HTTP_LINE.search(server.log())["url"]


def scrape(url: str) -> dict[tuple, float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def stream_at_sp2(cache_dir: Path, log_path: Path, preset: str, request) -> Rollout:
    """The events of ``request`` from a fresh server of ``preset`` at --sp 2, stopped cleanly after."""
    server = start_server(cache_dir, log_path, "--model", preset, "--sp", "2")
    try:
        with RolloutClient(server.address, timeout=300) as client:
            run = split_events(client.stream(request))
    finally:
        assert server.stop() == 0
    assert run.started.message.sp_degree == 2
    return run
