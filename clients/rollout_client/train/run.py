"""A whole training run from its flags: the ranks, a server of its own when none is given, the
client, and the Trainer."""

import argparse
import os
import time
from pathlib import Path

import torch

from rollout_client import RolloutClient, read_token
from rollout_client.train.distributed import Ranks
from rollout_client.train.rollouts import CHANNEL_OPTIONS, ServerFailure, retrying
from rollout_client.train.trainer import Trainer
from rollout_core import wire

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the server builds its model locally


def run(args: argparse.Namespace) -> tuple[list[dict], float, Ranks]:
    """Train as ``args`` say: (the metrics rows, the seconds the training took, this process's ranks).
    A server that fails for good raises ServerFailure, with the run's finished iterations
    checkpointed."""
    torch.set_num_threads(args.threads)
    ranks = Ranks.start(args.device)
    if torch.device(args.device).type == "cuda" and ranks.world > 1:
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    if args.server is None and ranks.leader:
        from rollout_server.local import LocalServer  # the trainer's own server, on this machine

        server = LocalServer.start(args.out / "server.log", "--model", args.model, "--threads", "1")
    token = read_token(args.token_file) if args.token_file else None
    address = ranks.agree(args.server or server.address if ranks.leader else None)
    try:
        with RolloutClient(
            address, timeout=args.stall_timeout, token=token, channel_options=CHANNEL_OPTIONS
        ) as client:
            info = retrying("reading the server's info", client.server_info, args.retries, address)
            if args.prune_at is not None and wire.FEATURE_PRUNE_POINTS not in info.features:
                raise ServerFailure(
                    f"the server at {address} holds no rollout for its prune: --prune-at needs it"
                )
            model_path = args.model_path or Path(info.model_path)
            started = time.perf_counter()
            rows = Trainer(args, client, model_path, ranks).train()
            return rows, time.perf_counter() - started, ranks
    finally:
        if server is not None:
            server.stop()
        ranks.close()
