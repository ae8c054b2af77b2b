"""Shared fixtures: the tiny-flux preset, and real rollout servers on loopback ports."""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

SERVING_LINE = re.compile(r"serving .* at (?P<address>\S+:\d+)$")


@dataclass
class ServerProcess:
    process: subprocess.Popen
    address: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def start_server(cache_dir: Path, log_path: Path, *args: str, timeout: float = 120.0) -> ServerProcess:
    """Start ``rollout-server serve`` on a free loopback port and wait until it serves."""
    command = [
        sys.executable,
        "-m",
        "rollout_server",
        "serve",
        "--port",
        "0",
        "--cache-dir",
        str(cache_dir),
        "--threads",
        "1",
        *args,
    ]
    log_file = log_path.open("w")
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            match = SERVING_LINE.search(line)
            if match:
                server = ServerProcess(process, match["address"], log_path)
                with grpc.insecure_channel(server.address) as channel:
                    grpc.channel_ready_future(channel).result(timeout=30)
                return server
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"server did not start:\n{log_path.read_text()}")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_flux_folder(cache_dir) -> Path:
    from rollout_server.presets import resolve_model

    return resolve_model("tiny-flux", cache_dir)


@pytest.fixture(scope="session")
def server(tiny_flux_folder, cache_dir, tmp_path_factory):
    """A tiny-flux server shared by the tests that leave it in a clean state."""
    process = start_server(cache_dir, tmp_path_factory.mktemp("logs") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="session")
def client(server):
    from rollout_client import RolloutClient

    with RolloutClient(server.address, timeout=300) as rollout_client:
        yield rollout_client


@pytest.fixture(scope="session")
def tiny_transformer(tiny_flux_folder):
    """The tiny transformer, loaded the trainer's way: plain diffusers from_pretrained."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(tiny_flux_folder / "transformer").eval()
