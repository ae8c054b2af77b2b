"""A whole training run from its flags: the ranks, a server of its own when none is given, the
client, and the Trainer."""

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollout_client import RolloutClient, read_token
from rollout_client.train.algorithms import ALGORITHMS
from rollout_client.train.distributed import Ranks
from rollout_client.train.rollouts import CHANNEL_OPTIONS, ServerFailure, retrying
from rollout_client.train.trainer import Trainer
from rollout_core import wire
from rollout_core.local_server import LocalServer

if TYPE_CHECKING:
    from rollout_client.train.config import TrainConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the server builds its model locally


def run(config: "TrainConfig") -> tuple[list[dict], float, Ranks]:
    """Train as ``config`` say: (the metrics rows, the seconds the training took, this process's ranks).
    A server that fails for good raises ServerFailure, with the run's finished iterations
    checkpointed."""
    torch.set_num_threads(config.threads)
    ranks = Ranks.start(config.device)
    if torch.device(config.device).type == "cuda" and ranks.world > 1:
        config.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    config.checkpoint.out.mkdir(parents=True, exist_ok=True)
    # The trainer's own server, on this machine: a child process, stopped however the run ends.
    server = None
    if config.server.address is None and ranks.leader:
        server = LocalServer.start(
            config.checkpoint.out / "server.log", "--model", config.server.model, "--threads", "1"
        )
    try:
        token = read_token(config.server.token_file) if config.server.token_file else None
        address = ranks.agree(config.server.address or server.address if ranks.leader else None)
        with RolloutClient(
            address, timeout=config.server.stall_timeout, token=token, channel_options=CHANNEL_OPTIONS
        ) as client:
            info = retrying("reading the server's info", client.server_info, config.server.retries, address)
            if config.tree.prune_at is not None and wire.FEATURE_PRUNE_POINTS not in info.features:
                raise ServerFailure(
                    f"the server at {address} holds no rollout for its prune: --prune-at needs it"
                )
            if config.tree.prune_at is not None and wire.FEATURE_PREVIEWS not in info.features:
                raise ServerFailure(f"the server at {address} sends no previews: --prune-at scores them")
            if ALGORITHMS[config.algorithm_name].preview_steps(config) and (
                wire.FEATURE_PREVIEWS not in info.features
            ):
                raise ServerFailure(
                    f"the server at {address} sends no previews: --algorithm {config.algorithm} scores them"
                )
            needed = (wire.FEATURE_PREVIEWS, wire.FEATURE_PRUNE_POINTS)
            if config.eval.search and not all(feature in info.features for feature in needed):
                raise ServerFailure(
                    f"the server at {address} sends no previews or holds no rollout: --search needs both"
                )
            if config.server.colocate and wire.FEATURE_RELEASE_MEMORY not in info.features:
                raise ServerFailure(f"the server at {address} cannot release its memory: --colocate needs it")
            model_path = config.server.model_path or Path(info.model_path)
            started = time.perf_counter()
            rows = Trainer(config, client, model_path, ranks).train()
            return rows, time.perf_counter() - started, ranks
    finally:
        if server is not None:
            server.stop()
        ranks.close()
