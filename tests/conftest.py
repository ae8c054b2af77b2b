"""Shared fixtures: the tiny-flux preset, and real rollout servers on loopback ports."""

import os
from pathlib import Path

import pytest
import torch

from rollout_server.local import LocalServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


def start_server(cache_dir: Path, log_path: Path, *args: str) -> LocalServer:
    """A real ``rollout-server serve`` on a free loopback port, sharing the session's preset cache."""
    return LocalServer.start(log_path, "--cache-dir", str(cache_dir), "--threads", "1", *args)


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
