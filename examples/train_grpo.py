"""FlowGRPO (or DiffusionNFT) on the rollout stream: a small, real trainer to copy from.

Each iteration samples P prompts x G images on a rollout server, scores the images with a reward
(JPEG compressibility by default: no download), standardises the rewards within each prompt's group,
recomputes the stochastic steps' log-probs with gradients, takes one PPO-clipped step on a LoRA of the
transformer, and pushes the adapter back as the next policy version. The next rollouts ask for that
version with ``min_policy_version``, so they never run on an older policy than they should.

    python examples/train_grpo.py                       # its own tiny-flux server; writes train-output/
    python examples/train_grpo.py --async               # next rollouts stream while this one trains
    python examples/train_grpo.py --server HOST:PORT --model-path FOLDER
    python examples/train_grpo.py --model shapes --prompt-set shapes \
        --reward rollout_client.rewards.shapes:geneval_reward --eval-every 5   # make train-shapes

Sync: iteration i rolls out on policy version i, so at its update the ratio exp(logp_new - logp_old)
is 1 up to float rounding (``ratio_max_dev`` in metrics.csv: the on-policy proof). Async: iteration
i + 1's rollouts are requested when iteration i starts training, with ``min_policy_version = i``: they
run on version i while the trainer holds i + 1, one version stale at most, and the clipped ratio
corrects for it.

Every iteration starts by pushing the trainer's policy, so the first rollouts of a run (fresh or
resumed) are on-policy whatever the server held before. A checkpoint (adapter, optimizer, schedule,
RNG, metrics) is written every --checkpoint-every iterations; --resume goes on from it. A server that
fails (down, restarting, overloaded, or silent for --stall-timeout seconds) is retried --retries
times with a growing pause; then the run stops, its finished iterations checkpointed.

Writes to --out: metrics.csv (one row per iteration), reward.png (reward mean +/- std per iteration),
the first and last iteration's images in samples/iter-NNNN/, the final LoRA in lora/ (a PEFT
adapter folder) and checkpoint.pt.

``--prompt-set shapes`` draws each iteration's P prompts from the shapes task's train prompts
(``rollout_client.rewards.shapes.train_prompts()``); with ``--eval-every N`` the served policy is
evaluated GenEval-style on the disjoint eval prompts (``rollout_client.shapes_eval``) before
iterations 0, N, 2N ... and once more after the last: metrics.csv gains ``eval_accuracy``, and the
run writes accuracy.png, eval.json (the tables before and after) and samples/eval-before.png and
samples/eval-after.png (the eval images, framed green where strictly right, red where wrong).
``--prompt TEXT`` (repeatable) trains on those prompts every iteration instead.

``--tree 0:2,3:2,6:2`` samples trees instead of flat groups (BranchGRPO, TreeGRPO): each of a
prompt's --group-size roots forks at those steps (``step:factor``, or ``step:factor:noise_level``),
the leaves are scored, and every edge (a node's transition) is trained once with its node's
advantage (``--tree-advantages``: BranchGRPO's depth-normalised fused rewards, mean or
log-prob-weighted, or TreeGRPO's backed-up leaf advantages; ``rollout_client.grpo``). With
``--prune-at S --prune-keep K`` the trainer terminates nodes early: when step S arrives, each node
that took it is scored by the reward of its predicted final image, and per prompt all but the K/2
best and K/2 worst are pruned with their subtrees (``PruneRollout``). The request names S as its
prune point, so the server runs step S + 1 only once the trainer has answered: the prune stops its
nodes there, and metrics.csv counts the nodes asked for and those the server stopped.

``--train full`` trains every parameter of the transformer instead of a LoRA, and pushes it over a
weight-sync group by default (``--weight-sync``; ``rollout_client.WeightSyncGroup``): every push checks
the checksum the server serves against the trainer's own. Under ``torchrun --nproc-per-node N`` the
trainer runs N data-parallel ranks: each rolls out its block of the prompt groups with the seeds one
rank would draw, the gradients are averaged before each step, and rank 0 pushes and writes the run.

``--algorithm nft`` swaps the update for DiffusionNFT's (``rollout_client.nft``): the rollouts stream
only their final latents, and each iteration takes --nft-draws optimizer steps of its flow-matching
style loss on them, noised afresh for each step, against the rollout policy's own velocities. No
step's log-prob enters it, so ``ratio_max_dev`` is empty; the rollouts still ask for the pushed
version, so every update starts from the policy that sampled its data.
"""

import argparse
import contextlib
import csv
import functools
import importlib
import itertools
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file
from tqdm import tqdm

from rollout.v1 import rollout_pb2
from rollout_client import Collector, RolloutClient, Step, Trajectory, read_token
from rollout_client.events import decode_stream
from rollout_client.grpo import (
    backed_up_advantages,
    branch_advantages,
    clipped_policy_loss,
    group_advantages,
    kl_to_reference,
    micro_batches,
    row_batches,
    sde_window,
    step_transitions,
    tree_edges,
)
from rollout_client.nft import final_latents, nft_loss, noise_levels, noised, optimality, velocities
from rollout_client.weight_sync import ChecksumMismatch
from rollout_core import checksum, wire
from rollout_core.layout import prompt_groups, sample_layout
from rollout_server.local import LocalServer

if TYPE_CHECKING:
    from rollout_client.rewards import Reward
    from rollout_client.shapes_eval import ShapesEval
    from rollout_client.weight_sync import WeightSyncGroup

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the server builds its model locally

PROMPTS = [
    "a red fox in the snow",
    "a lighthouse at dusk",
    "two cats on a sofa",
    "a bowl of ramen",
    "an old tram in the rain",
    "a kite over the dunes",
    "a mountain lake at dawn",
    "a city street at night",
]
PROMPT_SETS = ("scenes", "shapes")  # PROMPTS above, or the shapes task's train prompts
ALGORITHMS = ("flowgrpo", "nft")
TRAINED = ("lora", "full")  # --train
WEIGHT_SYNCS = ("auto", "grpc", "group")  # --weight-sync
TREE_ADVANTAGES = ("branch-mean", "branch-log-prob", "backed-up")  # the first is the default
DEFAULT_PRUNE_KEEP = 4
# FLUX's attention and feed-forward layers, with the latent projections in and out.
FLUX_TARGETS = ["x_embedder", "to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_out"]
COLUMNS = [
    "iteration",
    "policy_version",
    "pushed_version",
    "reward_mean",
    "reward_std",
    "loss",
    "ratio_max_dev",
    "kl",
    "scored_steps",
    "rollout_seconds",
    "train_seconds",
    "update_seconds",
    "iteration_seconds",
    "eval_accuracy",
    "transformer_rows",
    "pruned_leaves",
    "prune_asked",
    "prune_stopped",
    "eval_seconds",
]
CHECKPOINT = "checkpoint.pt"
# Flags that do not change what a run computes: a resumed run may set them anew.
OPERATIONAL_FLAGS = {
    "server",
    "model_path",
    "token_file",
    "device",
    "threads",
    "out",
    "resume",
    "checkpoint_every",
    "stall_timeout",
    "retries",
    "weight_sync",
    "sync_address",
}
# Statuses of a server that is down, restarting, overloaded or stuck rather than of a bad request.
SERVER_FAILURES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}
MAX_RETRY_PAUSE = 30.0  # seconds; the pauses double from 1 s up to this
REPORT_SECONDS = 10.0  # while a call waits on the server, a line at least this often
# A server that is down is tried about once a second, not after gRPC's reconnect backoff (up to 2 min).
CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 1000)]
T = TypeVar("T")


def int_at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{why}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its "invalid int value" message
    return parse


def float_above_zero(why: str = "") -> Callable[[str], float]:
    """An argparse type: a float above 0 (NaN is not)."""

    def parse(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0{why}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="address of a running server (default: start one on --model)")
    parser.add_argument("--model", default="tiny-flux", help="preset or folder for the server we start")
    parser.add_argument("--model-path", type=Path, help="the model folder (default: the server's)")
    parser.add_argument("--token-file", type=Path, help="admin token of a server started with tokens")
    parser.add_argument("--iterations", type=int_at_least(1), default=70)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration (P)")
    parser.add_argument(
        "--prompt-set",
        choices=PROMPT_SETS,
        default="scenes",
        help="the fixed scene prompts, or P of the shapes task's train prompts drawn per iteration",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="train on this prompt every iteration (repeatable; instead of --prompt-set's prompts)",
    )
    parser.add_argument(
        "--prompt-pool",
        type=int_at_least(0),
        default=0,
        help="with --prompt-set shapes: draw from the first this many train prompts only (0: all)",
    )
    parser.add_argument(
        "--eval-every",
        type=int_at_least(0),
        default=0,
        help="with --prompt-set shapes: evaluate the policy on the eval prompts this often (0: never)",
    )
    parser.add_argument(
        "--cfg",
        type=float,
        help="true CFG scale of the rollouts, Flux and Qwen-Image (default: the server's; shapes: 3)",
    )
    parser.add_argument(
        "--group-size",
        type=int_at_least(1),
        default=8,
        help="samples per prompt (G); with --tree, the roots per prompt",
    )
    parser.add_argument(
        "--tree",
        default="",
        help="tree rollouts: branch points step:factor[:noise_level], comma-separated (e.g. 0:2,3:2,6:2)",
    )
    parser.add_argument(
        "--prune-at",
        type=int_at_least(0),
        help="with --tree: when this step arrives, prune each prompt's middle nodes by predicted reward",
    )
    parser.add_argument(
        "--prune-keep",
        type=int_at_least(2, " (a prompt's advantages compare at least two of its nodes)"),
        help="with --prune-at: the nodes each prompt keeps there, the best half and the worst half "
        f"(default {DEFAULT_PRUNE_KEEP})",
    )
    parser.add_argument(
        "--tree-advantages",
        choices=TREE_ADVANTAGES,
        help="with --tree: BranchGRPO's fused rewards (mean or log-prob weighted), or TreeGRPO's backed-up "
        f"(default {TREE_ADVANTAGES[0]})",
    )
    parser.add_argument("--steps", type=int, default=6, help="denoising steps")
    parser.add_argument("--size", type=int, default=128, help="image height and width")
    parser.add_argument(
        "--noise-level",
        type=float_above_zero(" (at 0 the sampler is deterministic: no log-probs to train on)"),
        default=1.0,
    )
    parser.add_argument(
        "--window", type=int, default=0, help="Flow-GRPO-Fast: this many consecutive SDE steps (0: all)"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="peak; a cosine takes it to lr / 10")
    parser.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        default="flowgrpo",
        help="FlowGRPO's clipped policy loss on the stochastic steps, or DiffusionNFT's on the final latents",
    )
    parser.add_argument(
        "--nft-beta", type=float_above_zero(), default=1.0, help="nft: the implicit policies' step beta"
    )
    parser.add_argument(
        "--nft-draws",
        type=int_at_least(1),
        default=4,
        help="nft: optimizer steps per iteration, each on a fresh noise and level of every sample",
    )
    parser.add_argument(
        "--clip-range",
        type=float,
        help="PPO clip range (default 1e-4; 1e-2 with --async, whose one-version-stale ratios reach 1e-2)",
    )
    parser.add_argument("--kl-beta", type=float, default=0.0, help="weight of the KL to the base model")
    parser.add_argument(
        "--train",
        choices=TRAINED,
        default="lora",
        help="what the optimizer trains: a LoRA of the transformer, or every parameter of it",
    )
    parser.add_argument(
        "--weight-sync",
        choices=WEIGHT_SYNCS,
        default="auto",
        help="how the policy reaches the server: UpdateWeights over gRPC, or broadcasts over a "
        "weight-sync group (auto: the group for --train full, gRPC for a LoRA)",
    )
    parser.add_argument(
        "--sync-address",
        default="127.0.0.1",
        help="with the weight-sync group: this host's address as the server reaches it",
    )
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument(
        "--lora-alpha", type=float, default=32.0, help="the LoRA's output scale is alpha / rank"
    )
    parser.add_argument("--lora-targets", default=",".join(FLUX_TARGETS), help="comma-separated modules")
    parser.add_argument(
        "--micro-batch", type=int_at_least(1), default=32, help="rows per forward and backward"
    )
    parser.add_argument("--reward", default="rollout_client.rewards:jpeg_compressibility")
    parser.add_argument("--async", dest="async_", action="store_true", help="one version stale rollouts")
    parser.add_argument(
        "--score-while-streaming",
        action="store_true",
        help="sync only: compute each step's log-probs as it arrives (holds their graphs until the end)",
    )
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    parser.add_argument("--out", type=Path, default=Path("train-output"))
    parser.add_argument(
        "--checkpoint-every", type=int_at_least(1), default=10, help="iterations between checkpoints"
    )
    parser.add_argument("--resume", action="store_true", help=f"go on from --out's {CHECKPOINT}")
    parser.add_argument(
        "--stall-timeout",
        type=float_above_zero(),
        default=120.0,
        help="seconds the server may send nothing: between a rollout's events, or for a whole push or "
        "info call (above the slowest step of a rollout, queueing included)",
    )
    parser.add_argument(
        "--retries",
        type=int_at_least(0),
        default=8,
        help="times a failed server phase is tried again, after pauses of 1, 2, 4 ... 30 s",
    )
    args = parser.parse_args(argv)
    if args.weight_sync == "auto":
        args.weight_sync = "group" if args.train == "full" else "grpc"
    if args.train == "full" and args.kl_beta:
        parser.error("--kl-beta compares with the base model through the LoRA: it needs --train lora")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        # Ranks split each iteration's prompts and average their gradients before one optimizer step.
        for flag in ("async_", "tree", "prune_at", "score_while_streaming"):
            if getattr(args, flag) not in (None, False, ""):
                parser.error(f"--{flag.rstrip('_').replace('_', '-')} runs on one trainer rank, not {world}")
        if args.algorithm == "nft":
            parser.error(f"--algorithm nft runs on one trainer rank, not {world}")
        if args.prompts % world:
            parser.error(f"--prompts {args.prompts} must split evenly over the {world} trainer ranks")
    if args.clip_range is None:
        args.clip_range = 1e-2 if args.async_ else 1e-4
    if args.async_ and args.score_while_streaming:
        parser.error("--score-while-streaming scores with the rollout's policy: it needs sync mode")
    if args.prompt:
        if args.prompt_pool:
            parser.error("--prompt-pool draws from a prompt set: it does not go with --prompt")
        args.prompts = len(args.prompt)
    prompt_count = len(PROMPTS) if args.prompt_set == "scenes" else len(prompt_pool(args))
    if not args.prompt and not 1 <= args.prompts <= prompt_count:
        parser.error(f"--prompts must be in [1, {prompt_count}] for --prompt-set {args.prompt_set}")
    try:
        branches = branch_points(args.tree)
    except ValueError as error:
        parser.error(f"--tree: {error}")
    if any(not 0 <= branch.step < args.steps or branch.factor < 1 for branch in branches):
        parser.error("--tree: every branch step must be in [0, --steps), every factor at least 1")
    leaves_per_prompt = args.group_size * math.prod(branch.factor for branch in branches)
    if leaves_per_prompt < 2:
        parser.error(
            "argument --group-size: must be at least 2 (advantages are standardised within a prompt's "
            "group: one sample has none), or 1 with a --tree that forks"
        )
    if args.tree:
        # Edges are trained once each with their node's advantage: FlowGRPO's clipped loss only, on
        # the whole tree once it has arrived, with every step stochastic.
        for flag in ("window", "score_while_streaming"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} does not go with --tree")
        if args.algorithm == "nft":
            parser.error("--tree trains edges with FlowGRPO's loss: it does not go with --algorithm nft")
    elif args.tree_advantages is not None:
        parser.error("--tree-advantages scores the nodes of a tree: it needs --tree")
    args.tree_advantages = args.tree_advantages or TREE_ADVANTAGES[0]
    if args.prune_keep is None:
        args.prune_keep = DEFAULT_PRUNE_KEEP
    elif args.prune_at is None:
        parser.error("--prune-keep is what --prune-at keeps: it needs --prune-at")
    if args.prune_at is not None:
        check_prune_flags(parser, args, branches)
    if args.algorithm == "nft":
        # NFT scores no step: nothing to window or to score early, no step Gaussians for the KL, and
        # its old velocities must be the rollout policy's, which a stale rollout is not.
        for flag in ("window", "kl_beta", "async_", "score_while_streaming"):
            if getattr(args, flag):
                name = flag.rstrip("_").replace("_", "-")
                parser.error(f"--{name} is for FlowGRPO: --algorithm nft scores no step")
    for flag in ("prompt_pool", "eval_every"):
        if getattr(args, flag) and args.prompt_set != "shapes":
            parser.error(f"--{flag.replace('_', '-')} is for the shapes task: it needs --prompt-set shapes")
    if args.cfg is not None and not args.cfg >= 1:
        parser.error(f"--cfg must be at least 1, got {args.cfg}")
    if not 0 <= args.window <= args.steps:
        parser.error("--window must be in [0, --steps]")
    args.checkpoint = None
    if args.resume:
        path = args.out / CHECKPOINT
        if not path.is_file():
            parser.error(f"--resume: no {CHECKPOINT} in {args.out}")
        args.checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        changed = [
            f"--{name.rstrip('_').replace('_', '-')} {value} (the checkpoint's run has {recorded})"
            for name, value in run_settings(args).items()
            if (recorded := args.checkpoint["settings"].get(name)) != value
        ]
        if changed:
            parser.error(f"--resume: this command sets {', '.join(changed)}")
    return args


def check_prune_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, branches: list[rollout_pb2.Branch]
) -> None:
    """--prune-at and --prune-keep must prune something, in time: after the tree's first fork (the
    roots before it are whole groups), before the last step (the prune stops nodes at the next one),
    keeping fewer nodes than a prompt has there."""
    forks = [branch.step for branch in branches if branch.factor > 1]
    at = args.prune_at
    if not forks:
        parser.error("--prune-at prunes a tree: it needs --tree, with a factor above 1")
    if args.async_:
        parser.error("--prune-at prunes as the rollout streams to the trainer: it needs sync mode")
    if at < forks[0]:
        parser.error(
            f"--prune-at {at} is before --tree's first fork at step {forks[0]}: only roots are there"
        )
    if at >= args.steps - 1:
        parser.error(
            f"--prune-at must be below --steps - 1 ({args.steps - 1}): its prune stops the next step"
        )
    nodes = args.group_size * math.prod(branch.factor for branch in branches if branch.step <= at)
    if args.prune_keep >= nodes:
        parser.error(
            f"--prune-keep {args.prune_keep} prunes nothing: a prompt has {nodes} nodes at step {at} "
            "(--group-size times --tree's factors up to it)"
        )


def branch_points(text: str) -> list[rollout_pb2.Branch]:
    """--tree's ``step:factor[:noise_level],...`` as a request's branches (none for ""); ValueError
    naming an item that is not one."""
    points = []
    for item in filter(None, text.split(",")):
        fields = item.split(":")
        try:
            if len(fields) not in (2, 3):
                raise ValueError(item)
            branch = rollout_pb2.Branch(step=int(fields[0]), factor=int(fields[1]))
            if len(fields) == 3:
                branch.noise_level = float(fields[2])
        except ValueError:
            raise ValueError(f"not step:factor[:noise_level]: {item!r}") from None
        points.append(branch)
    return points


def run_settings(args: argparse.Namespace) -> dict:
    """The flags that decide what a run computes, as its checkpoints record them."""
    ignored = OPERATIONAL_FLAGS | {"checkpoint"}
    return {name: value for name, value in vars(args).items() if name not in ignored}


def load_reward(spec: str) -> "Reward":
    """``module:callable``, e.g. ``rollout_client.rewards:jpeg_compressibility``."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def load_policy(model_path: Path, args: argparse.Namespace) -> tuple[torch.nn.Module, LoraConfig | None]:
    """The base transformer, frozen, with a trainable LoRA; or, with --train full, all trainable."""
    from diffusers import AutoModel  # the trainer's side; the client library never imports diffusers

    transformer = AutoModel.from_pretrained(str(model_path), subfolder="transformer").to(args.device)
    if args.train == "full":
        return transformer, None
    transformer.requires_grad_(False)
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=args.lora_targets.split(",")
    )
    transformer.add_adapter(config)
    return transformer, config


def lora_modules(transformer: torch.nn.Module) -> list[str]:
    """The modules a LoRA is attached to."""
    return sorted(name for name, module in transformer.named_modules() if isinstance(module, BaseTunerLayer))


@dataclass
class Rollout:
    """One iteration's samples, as they stream in."""

    collector: Collector = field(default_factory=Collector)
    seconds: float = 0.0
    prune_asked: int = 0  # nodes --prune-at asked the server to stop
    prune_stopped: int = 0  # of those, the nodes the server answered it stopped

    @property
    def trajectories(self) -> list[Trajectory]:
        return self.collector.trajectories()

    @property
    def policy_version(self) -> int:
        return self.collector.started.message.policy_version


def shapes_train_prompts() -> tuple[str, ...]:
    from rollout_client.rewards import shapes

    return shapes.train_prompts()


def prompt_pool(args: argparse.Namespace) -> tuple[str, ...]:
    """The shapes train prompts an iteration draws from: all, or the first --prompt-pool."""
    return shapes_train_prompts()[: args.prompt_pool or None]


def iteration_prompts(args: argparse.Namespace, iteration: int) -> list[str]:
    """--prompt's, the fixed scene prompts, or P distinct shapes train prompts drawn from the
    iteration's seed."""
    if args.prompt:
        return list(args.prompt)
    if args.prompt_set == "scenes":
        return PROMPTS[: args.prompts]
    pool = prompt_pool(args)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
    return [pool[k] for k in torch.randperm(len(pool), generator=generator)[: args.prompts].tolist()]


def rollout_request(args: argparse.Namespace, iteration: int, min_version: int) -> rollout_pb2.RolloutRequest:
    generator = torch.Generator().manual_seed(args.seed + iteration)
    window = sde_window(args.steps, args.window, generator) if args.window else []
    samples = args.prompts * args.group_size
    return rollout_pb2.RolloutRequest(
        request_id=f"grpo-iter-{iteration}",
        prompts=iteration_prompts(args, iteration),
        samples_per_prompt=args.group_size,
        base_seed=args.seed + iteration * samples,  # per-sample seeds never repeat across iterations
        num_steps=args.steps,
        height=args.size,
        width=args.size,
        sampler=rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
        noise_level=args.noise_level,
        stochastic_steps=window,
        latents=rollout_pb2.LATENT_SELECTION_FINAL_ONLY
        if args.algorithm == "nft"
        else rollout_pb2.LATENT_SELECTION_AROUND_STOCHASTIC,
        min_policy_version=min_version,
        true_cfg_scale=args.cfg,
        branches=branch_points(args.tree),
        # The early-termination rule predicts each node's image from its velocity; the server waits
        # for its prune after that step.
        debug_tensors=[] if args.prune_at is None else [rollout_pb2.DEBUG_TENSOR_VELOCITY],
        prune_points=[] if args.prune_at is None else [args.prune_at],
    )


@dataclass(frozen=True)
class Ranks:
    """This trainer process among the data-parallel ranks of a ``torchrun`` launch (or alone): each
    rank rolls out its share of every iteration's prompt groups, and the gradients are averaged over
    the ranks before each optimizer step (the all-reduce DDP does), so every rank holds the same
    policy; rank 0 pushes it and writes the run's files."""

    rank: int = 0
    world: int = 1

    @classmethod
    def start(cls, device: str) -> "Ranks":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend)
        return cls(torch.distributed.get_rank(), world)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree(self, value: T) -> T:
        """Rank 0's ``value``, on every rank."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order."""
        if self.world == 1:
            return [value]
        values = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        return values

    def average_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        for parameter in parameters:
            if parameter.grad is not None:
                torch.distributed.all_reduce(parameter.grad)
                parameter.grad /= self.world

    def share(self, request: rollout_pb2.RolloutRequest, max_samples: int) -> rollout_pb2.RolloutRequest:
        """This rank's prompt groups of ``request`` (a contiguous block), with the seeds one server
        would give them: every rank count draws the same noise for the same sample."""
        if self.world == 1:
            return request
        layout, _ = sample_layout(request, max_samples)
        per_rank = len(request.prompts) // self.world
        mine = range(self.rank * per_rank, (self.rank + 1) * per_rank)
        share = prompt_groups(request, layout, mine)
        share.request_id = f"{request.request_id}-rank-{self.rank}"
        return share

    def close(self) -> None:
        if self.world > 1:
            torch.distributed.destroy_process_group()


def say(message: str) -> None:
    tqdm.write(f"train_grpo: {message}", file=sys.stderr)


class ServerStalled(Exception):
    """A call the watchdog gave up on: the server sent nothing for ``--stall-timeout`` seconds."""


class ServerFailure(Exception):
    """The server failed for good (after the retries), refused a call, or serves other weights than
    the trainer pushed: the run stops, with one line saying why."""


class Watchdog:
    """Watches a server call from a thread of its own. While the trainer waits on the server it says
    so every ``REPORT_SECONDS`` (a quarter of ``stall_seconds`` when that is shorter); once it has
    waited ``stall_seconds`` without progress it calls ``cancel``, if given (a unary call ends on
    its own deadline instead). Time the trainer spends on its own work between events is not waiting."""

    def __init__(self, what: str, stall_seconds: float, cancel: Callable[[], None] | None = None):
        self.what, self.stall_seconds, self.cancel = what, stall_seconds, cancel
        self.stalled = False
        self.waiting_since: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"watchdog {what}", daemon=True)

    def __enter__(self) -> "Watchdog":
        self.waiting_since = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def watched(self, items: Iterator[T]) -> Iterator[T]:
        """``items``, timing the wait for each."""
        while True:
            self.waiting_since = time.monotonic()
            try:
                item = next(items)
            except StopIteration:
                return
            finally:
                self.waiting_since = None
            yield item

    def _watch(self) -> None:
        interval = min(REPORT_SECONDS, self.stall_seconds / 4)
        while not self._done.wait(interval):
            since = self.waiting_since
            waited = 0.0 if since is None else time.monotonic() - since
            if waited >= self.stall_seconds and self.cancel is not None:
                say(f"{self.what}: nothing from the server for {waited:.0f} s, giving up on the call")
                self.stalled = True
                self.cancel()
                return
            if waited >= interval:
                say(f"{self.what}: waiting for the server, {waited:.1f} s of {self.stall_seconds:g}")


def stream(client: RolloutClient, request, stall_seconds: float, on_step=None) -> Rollout:
    """Run one rollout, storing each event as it arrives; ``on_step(rollout, step)`` after every step.
    The call has no deadline, since its length depends on the server's load; a server that sends
    nothing for ``stall_seconds`` ends it with ServerStalled."""
    rollout, start = Rollout(), time.perf_counter()
    call = client.stub.Rollout(request, metadata=client.metadata)
    with Watchdog(f"rollout {request.request_id}", stall_seconds, call.cancel) as watchdog:
        try:
            for event in watchdog.watched(decode_stream(call)):
                rollout.collector.add(event)
                if on_step is not None and isinstance(event, Step):
                    on_step(rollout, event)
        except grpc.RpcError as error:
            if watchdog.stalled:
                raise ServerStalled(f"no event from the server for {stall_seconds:g} s") from error
            raise
        finally:
            call.cancel()
    if rollout.collector.finished is None:
        raise RuntimeError(f"rollout {request.request_id} ended without its finished event")
    rollout.seconds = time.perf_counter() - start
    return rollout


def describe(error: Exception) -> str:
    """A failure on one line: the gRPC status and its message, or the exception's text."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        text = f"{error.code().name}: {error.details()}"
    else:
        text = str(error)
    return " ".join(text.split())


def retrying(what: str, attempt: Callable[[], T], retries: int, address: str) -> T:
    """``attempt()``; after a server failure (SERVER_FAILURES, or a stall) it is tried again up to
    ``retries`` times, after pauses of 1, 2, 4 ... MAX_RETRY_PAUSE seconds. Any other gRPC error, or
    the last failure, raises ServerFailure."""
    for retry in itertools.count():
        try:
            return attempt()
        except (grpc.RpcError, ServerStalled) as error:
            reason = describe(error)
            transient = isinstance(error, ServerStalled) or (
                hasattr(error, "code") and error.code() in SERVER_FAILURES
            )
            if not transient:
                raise ServerFailure(f"{what}: the server at {address} refused it: {reason}") from error
            if retry == retries:
                raise ServerFailure(
                    f"{what}: the server at {address} failed {retry + 1} times, last with {reason}"
                ) from error
            pause = min(2.0**retry, MAX_RETRY_PAUSE)
            say(
                f"{what}: the server at {address} failed ({reason}); "
                f"retry {retry + 1} of {retries} in {pause:g} s"
            )
            time.sleep(pause)


class PolicyUpdate:
    """One clipped policy step, accumulated piece by piece ((step, rows) micro-batches).

    A piece scored before the advantages are known (while the rollout still streams) keeps its graph
    until ``finish``; once they are known, each piece is backpropagated at once, so memory is bounded
    by one micro-batch."""

    def __init__(self, transformer: torch.nn.Module, args: argparse.Namespace):
        self.transformer, self.args = transformer, args
        self.pending: list[tuple[int, list[int], tuple]] = []  # (step, rows, (transition, reference))
        self.scored_steps: set[int] = set()
        self.weight = 0.0  # of one row at one step in the loss, once the rollout is complete
        self.loss = self.kl = self.ratio_max_dev = 0.0

    def score_ready(self, collector: Collector) -> None:
        """Score the steps that have fully arrived and are not scored yet (advantages unknown)."""
        steps = [i for i in stochastic_steps(collector) if i not in self.scored_steps and collector.ready(i)]
        if not steps:
            return
        trajectories = collector.trajectories()
        for i, rows in micro_batches(trajectories, steps, self.args.micro_batch):
            self.pending.append((i, rows, self._score(trajectories, i, rows)))
        self.scored_steps.update(steps)

    def finish(self, collector: Collector, advantages: torch.Tensor) -> None:
        """Backpropagate every scored step with the per-sample advantages, scoring the steps not
        scored yet."""
        steps, trajectories = stochastic_steps(collector), collector.trajectories()
        self.weight = 1.0 / (len(steps) * len(trajectories))  # the loss is a mean over steps and samples
        for i, rows, scored in self.pending:
            self._backward(trajectories, advantages[rows], i, rows, scored)
        todo = [i for i in steps if i not in self.scored_steps]
        for i, rows in micro_batches(trajectories, todo, self.args.micro_batch):
            self._backward(trajectories, advantages[rows], i, rows, self._score(trajectories, i, rows))

    def finish_tree(self, leaves: list[Trajectory], node_advantages: torch.Tensor) -> None:
        """Backpropagate every edge of the tree once, on a leaf below it, with its node's advantage."""
        edges = tree_edges(leaves)
        self.weight = 1.0 / len(edges)  # the loss is a mean over edges
        for i in sorted({edge.step for edge in edges}):
            at_step = [edge for edge in edges if edge.step == i]
            holders = [leaves[edge.row] for edge in at_step]
            for piece in row_batches(holders, self.args.micro_batch):
                rows = [at_step[k].row for k in piece]
                edge_advantages = node_advantages[[at_step[k].node for k in piece]]
                self._backward(leaves, edge_advantages, i, rows, self._score(leaves, i, rows))

    def _score(self, trajectories, i, rows):
        pieces = [trajectories[r] for r in rows]
        transition = step_transitions(self.transformer, pieces, i, self.args.device)
        reference = None
        if self.args.kl_beta > 0:
            with torch.no_grad():
                self.transformer.disable_adapters()
                try:
                    reference = step_transitions(self.transformer, pieces, i, self.args.device).means
                finally:
                    self.transformer.enable_adapters()
        return transition, reference

    def _backward(self, trajectories, piece_advantages, i, rows, scored) -> None:
        transition, reference = scored
        old = torch.stack([trajectories[r].log_probs[i] for r in rows]).to(transition.log_probs.device)
        ratio = torch.exp(transition.log_probs.detach() - old)
        self.ratio_max_dev = max(self.ratio_max_dev, (ratio - 1).abs().max().item())
        piece_advantages = piece_advantages.to(old.device)
        loss = clipped_policy_loss(transition.log_probs, old, piece_advantages, self.args.clip_range)
        if reference is not None:
            kl = kl_to_reference(transition.means, reference, transition.stds).mean()
            self.kl += kl.item() * len(rows) * self.weight
            loss = loss + self.args.kl_beta * kl
        (loss * len(rows) * self.weight).backward()
        self.loss += loss.item() * len(rows) * self.weight


def tree_advantages(leaves: list[Trajectory], rewards: torch.Tensor, rule: str) -> torch.Tensor:
    """The advantage of every node of the leaves' tree, float32 [nodes], by --tree-advantages."""
    tree = leaves[0].tree
    leaf_rewards = {leaf.sample_index: reward for leaf, reward in zip(leaves, rewards.tolist(), strict=True)}
    if rule == "backed-up":
        return backed_up_advantages(tree, leaf_rewards)
    if rule == "branch-mean":
        return branch_advantages(tree, leaf_rewards)
    # Each node's own steps' log-probs, summed: read on a leaf below it.
    own = torch.zeros(len(tree), dtype=torch.float64)
    for leaf in leaves:
        for node_id in leaf.node_path:
            node = tree[node_id]
            own[node_id] = leaf.log_probs[node.start_step : node.end_step].nan_to_num().double().sum()
    return branch_advantages(tree, leaf_rewards, fusion="log_prob", node_log_probs=own)


def nft_update(
    transformer, optimizer, trajectories: list[Trajectory], advantages, args, iteration: int
) -> float:
    """DiffusionNFT's update (``rollout_client.nft``): --nft-draws optimizer steps, each on every
    sample's final latent noised afresh, against the velocities of the policy that rolled them out
    (computed at every draw's points before the first step). Returns the mean loss."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_033 + iteration)  # a resumed run draws alike
    x = final_latents(trajectories).to(args.device)
    r = optimality(advantages)
    pieces = row_batches(trajectories, args.micro_batch)
    draws = []
    with torch.no_grad():
        for _ in range(args.nft_draws):
            levels = noise_levels(len(trajectories), generator)
            x_s, target = noised(x, torch.randn(x.shape, generator=generator).to(args.device), levels)
            v_old = torch.empty_like(x_s)
            for rows in pieces:
                v_old[rows] = velocities(
                    transformer, [trajectories[k] for k in rows], x_s[rows], levels[rows]
                )
            draws.append((x_s, target, levels, v_old))
    parameters = [p for p in transformer.parameters() if p.requires_grad]
    total = 0.0
    for x_s, target, levels, v_old in draws:
        optimizer.zero_grad(set_to_none=True)
        for rows in pieces:
            v = velocities(transformer, [trajectories[k] for k in rows], x_s[rows], levels[rows])
            loss = (
                nft_loss(v, v_old[rows], target[rows], r[rows], args.nft_beta) * len(rows) / len(trajectories)
            )
            loss.backward()
            total += loss.item() / args.nft_draws
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
    return total


def step_arrived(
    rollout: Rollout,
    step: Step,
    bar: tqdm,
    update: PolicyUpdate | None,
    early: "EarlyTermination | None",
) -> None:
    bar.update(1)
    if update is not None:
        update.score_ready(rollout.collector)
    if early is not None and step.index == early.step:
        early.prune(rollout, step)


class EarlyTermination:
    """--prune-at S --prune-keep K on a tree rollout: when step S arrives, each node that took it is
    scored by the reward of its predicted final image, x0 = x_S - sigma_S v (flow matching's estimate
    from the streamed velocity), decoded by the model's own VAE through its family adapter. Per
    prompt, the K / 2 best and K / 2 worst nodes go on (a group's extremes carry its advantages) and
    the others are pruned with their subtrees. The server holds the rollout after step S (its prune
    point) until this answer, which it always gets (an empty prune says "none"), so the nodes stop at
    step S + 1."""

    def __init__(self, client: RolloutClient, reward: "Reward", model_path: Path, args: argparse.Namespace):
        from rollout_server import families  # the trainer's side: it decodes as the server does

        self.client, self.reward, self.step, self.keep = client, reward, args.prune_at, args.prune_keep
        self.decoder = families.load(model_path, torch.device(args.device), torch.float32)

    @torch.no_grad()
    def prune(self, rollout: Rollout, step: Step) -> None:
        from rollout_server.families.base import MediaShape

        collector = rollout.collector
        message = collector.started.message
        shape = MediaShape.of(message.resolved)
        sigma = message.sigmas[self.step]
        images = []
        for row, node in enumerate(step.nodes):
            x0 = collector.latent(node, self.step) - sigma * step.debug["velocity"][row]
            images.extend(next(self.decoder.decode_frames(x0[None].to(self.decoder.device), shape)))
        prompts = [message.resolved.prompts[collector.tree[node].prompt_index] for node in step.nodes]
        scores = self.reward(images, prompts).tolist()
        pruned = []
        for p in set(collector.tree[node].prompt_index for node in step.nodes):
            ranked = sorted(
                (score, node)
                for node, score in zip(step.nodes, scores, strict=True)
                if collector.tree[node].prompt_index == p
            )
            best = self.keep // 2
            pruned += [node for _, node in ranked[self.keep - best : len(ranked) - best]]
        rollout.prune_asked += len(pruned)
        try:
            answer = self.client.prune(collector.started, sorted(pruned))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            say(
                f"rollout {step.request_id}: the prune at step {self.step} stopped nothing: {error.details()}"
            )
            return
        rollout.prune_stopped += len(set(pruned) & set(answer.nodes))
        if pruned and answer.step != self.step + 1:
            say(f"rollout {step.request_id}: the prune at step {self.step} landed at step {answer.step}")


def stochastic_steps(collector: Collector) -> list[int]:
    return [i for i, stochastic in enumerate(collector.started.message.stochastic) if stochastic]


def save_images(trajectories: list[Trajectory], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for trajectory in trajectories:
        slug = re.sub(r"[^a-z0-9]+", "-", trajectory.prompt.lower()).strip("-")
        name = f"p{trajectory.prompt_index:02d}-s{trajectory.sample_index:03d}-{slug}.png"
        (folder / name).write_bytes(trajectory.image_png)


def save_policy(transformer: torch.nn.Module, config: LoraConfig | None, out: Path) -> Path:
    """The trained policy, where ``LoadWeights`` (and diffusers) take it: the LoRA as a PEFT adapter
    folder ``lora/``, or the whole transformer as a diffusers model folder ``transformer/``."""
    if config is None:
        transformer.save_pretrained(out / "transformer")
        return out / "transformer"
    save_adapter(transformer, config, out / "lora")
    return out / "lora"


def save_adapter(transformer: torch.nn.Module, config: LoraConfig, folder: Path) -> None:
    """The LoRA as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors): what
    ``LoadWeights`` takes, and what ``peft`` and diffusers load."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    weights = get_peft_model_state_dict(transformer)
    save_file(
        {name: t.detach().cpu().contiguous() for name, t in weights.items()},
        folder / "adapter_model.safetensors",
    )


def plot_rewards(rows: list[dict], reward: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    iterations = [row["iteration"] for row in rows]
    mean = [row["reward_mean"] for row in rows]
    std = [row["reward_std"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=120)
    axis.plot(iterations, mean, marker="o", markersize=3, label="reward mean")
    lower = [m - s for m, s in zip(mean, std, strict=True)]
    upper = [m + s for m, s in zip(mean, std, strict=True)]
    axis.fill_between(iterations, lower, upper, alpha=0.25, label="+/- std")
    axis.set_xlabel("iteration")
    axis.set_ylabel("reward (-JPEG kB / 500)" if reward.endswith(":jpeg_compressibility") else reward)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_accuracy(rows: list[dict], final: tuple[int, float], path: Path) -> None:
    """The eval accuracy at every evaluated iteration and after the last."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    points = [
        (row["iteration"], row["eval_accuracy"])
        for row in rows
        if not math.isnan(row.get("eval_accuracy", math.nan))
    ]
    points.append(final)
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=120)
    axis.plot(*zip(*points, strict=True), marker="o", markersize=4)
    axis.set_xlabel("iteration (policy before its update)")
    axis.set_ylabel("strict eval accuracy")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def eval_grid(result: "ShapesEval", path: Path, columns: int = 8) -> None:
    """The eval images in a contact sheet, each framed green where strictly right and red where wrong."""
    from PIL import ImageOps

    from rollout_client.images import contact_sheet

    framed = [
        ImageOps.expand(image, border=2, fill=(40, 170, 60) if correct else (220, 40, 40))
        for image, correct in zip(result.images, result.correct, strict=True)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    contact_sheet(framed, columns).save(path)


def evaluate(client: RolloutClient, args: argparse.Namespace) -> "ShapesEval":
    """The served policy's eval on the shapes task, at the training size and steps, ODE, with --cfg."""
    from rollout_client.shapes_eval import eval_request, evaluate_policy

    request = eval_request(steps=args.steps, size=args.size, seed=args.seed, true_cfg_scale=args.cfg)
    return retrying("eval", functools.partial(evaluate_policy, client, request), args.retries, client.address)


def record_eval(path: Path, when: str, table: dict[str, tuple[int, int]]) -> None:
    """Writes ``table`` into eval.json as ``when``: "before" starts the file afresh, "after" is added to
    what a run (resumed or not) wrote before."""
    tables = json.loads(path.read_text()) if when != "before" and path.exists() else {}
    tables[when] = {task: {"correct": correct, "total": total} for task, (correct, total) in table.items()}
    path.write_text(json.dumps(tables, indent=2) + "\n")


class Pusher:
    """Sends the trainer's policy as the server's next policy version (whatever the server held
    before: another run's policy, or none after a restart), over gRPC or the weight-sync group
    (--weight-sync), and checks what the server then serves: the checksum of the trainer's own
    weights, and for a LoRA the modules it bound. Each call's deadline is ``stall_seconds``."""

    def __init__(self, client: RolloutClient, transformer, lora_config: LoraConfig | None, args):
        self.client, self.transformer, self.lora_config, self.args = client, transformer, lora_config, args
        self.group: WeightSyncGroup | None = None  # created at the first push over the group
        self.trained = lora_modules(transformer) if lora_config is not None else []
        # A LoRA run's base never changes: its part of the checksum is computed once.
        self.base_lines = {}
        if lora_config is not None:
            base = checksum.policy_tensors({"transformer": checksum.base_tensors(transformer)})
            self.base_lines = checksum.digest_lines(base)

    def weights(self) -> dict[str, torch.Tensor]:
        """What a push sends: the adapter, or every tensor of the transformer."""
        if self.lora_config is None:
            return {name: t.detach().cpu() for name, t in self.transformer.state_dict().items()}
        return {name: t.detach().cpu() for name, t in get_peft_model_state_dict(self.transformer).items()}

    def expected_checksum(self, weights: dict[str, torch.Tensor]) -> str:
        if self.lora_config is None:
            return checksum.weights_checksum(checksum.policy_tensors({"transformer": weights}))
        adapter = checksum.policy_tensors({}, {"transformer": weights})
        return checksum.combine(self.base_lines | checksum.digest_lines(adapter))

    def push(self) -> int:
        """Push the policy; returns its version."""
        weights, client = self.weights(), self.client
        expected = self.expected_checksum(weights)
        kind = "full" if self.lora_config is None else "lora"
        with Watchdog("policy push", self.args.stall_timeout):
            version = client.server_info().policy_version + 1
            if self.args.weight_sync == "group":
                served = self._push_over_group(weights, version, kind, expected)
            else:
                pushed = client.update_weights(weights, version, kind, self.lora_config, progress=False)
                served = pushed.weights_checksum
            bound = list(client.server_info().lora_adapter.modules)
        if served != expected:
            raise ServerFailure(f"the server serves weights {served}, not the trained {expected}")
        if bound != self.trained:
            raise ServerFailure(f"the server's LoRA binds {bound}, not the trained {self.trained}")
        return version

    def _push_over_group(self, weights, version: int, kind: str, expected: str) -> str:
        if self.group is not None and not all(self.group.joined()):
            # The server restarted, or joined another trainer's group: it is not in this one, so it
            # gets a new group (leaving the old one needs no call: the server already has).
            say("the server is no longer in the weight-sync group: forming a new one")
            self.group = None
        if self.group is None:
            self.group = self.client.init_weight_sync(
                master_address=self.args.sync_address, timeout=self.args.stall_timeout
            )
        try:
            [applied] = self.group.update_weights(
                weights, version, kind, self.lora_config, expect_checksum=expected
            )
        except ChecksumMismatch as mismatch:
            raise ServerFailure(f"the push of policy {version} over the group: {mismatch}") from None
        except Exception:
            self.group = None  # a failed update may have torn the group down: a retry joins a new one
            raise
        return applied.weights_checksum

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(grpc.RpcError):
                self.group.close()


def save_checkpoint(path: Path, args, transformer, optimizer, schedule, rows: list[dict]) -> None:
    """What the run needs to go on after ``len(rows)`` iterations, written to a temporary file and
    renamed over ``path``: a kill at any moment leaves the previous checkpoint or this one, whole."""
    state = {
        "settings": run_settings(args),
        "iterations_done": len(rows),
        "policy": {name: t.detach().cpu() for name, t in trainable_state(transformer, args).items()},
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "rng": {"cpu": torch.get_rng_state()}
        | ({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}),
        "rows": rows,
    }
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def trainable_state(transformer: torch.nn.Module, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """What the optimizer trains: the LoRA's tensors, or (--train full) the transformer's."""
    return transformer.state_dict() if args.train == "full" else get_peft_model_state_dict(transformer)


def restore_checkpoint(checkpoint: dict, transformer, optimizer, schedule) -> list[dict]:
    """Load a checkpoint's policy, optimizer, schedule and RNG state; returns its metrics rows."""
    if checkpoint["settings"]["train"] == "full":
        transformer.load_state_dict(checkpoint["policy"])
    else:
        loaded = set_peft_model_state_dict(transformer, checkpoint["policy"])
        if loaded.unexpected_keys:
            raise RuntimeError(
                f"the checkpoint's adapter has tensors this LoRA lacks: {loaded.unexpected_keys}"
            )
    optimizer.load_state_dict(checkpoint["optimizer"])
    schedule.load_state_dict(checkpoint["schedule"])
    torch.set_rng_state(checkpoint["rng"]["cpu"])
    if "cuda" in checkpoint["rng"]:
        torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
    return checkpoint["rows"]


def train(args: argparse.Namespace, client: RolloutClient, model_path: Path, ranks: Ranks) -> list[dict]:
    torch.manual_seed(args.seed)
    reward = load_reward(args.reward)
    transformer, lora_config = load_policy(model_path, args)
    pusher = Pusher(client, transformer, lora_config, args)
    parameters = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr)
    max_samples = client.server_info().limits.max_samples
    # A cosine from lr down to lr / 10 over the run: the late steps refine instead of overshooting.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.iterations, eta_min=args.lr / 10)
    checkpoint = args.out / CHECKPOINT
    rows: list[dict] = []
    if args.checkpoint is not None:
        rows = restore_checkpoint(args.checkpoint, transformer, optimizer, schedule)
        say(f"resuming after iteration {len(rows) - 1} from {checkpoint}")
    elif checkpoint.exists() and ranks.leader:
        say(f"a new run: removing the previous run's {checkpoint} (--resume goes on with it)")
        checkpoint.unlink()
    saved = len(rows)  # iterations in the checkpoint on disk
    early = None if args.prune_at is None else EarlyTermination(client, reward, model_path, args)
    staleness = 1 if args.async_ else 0
    upcoming = None  # async: the next rollout, streaming in the pool's thread while this one trains

    def roll_out(iteration: int, bar: tqdm, pushed: int | None) -> tuple[Rollout, PolicyUpdate, int, float]:
        """The server's part of an iteration: push the trainer's policy (unless rank 0 ``pushed``
        it), and roll out this rank's share (async: take the rollout that streamed during the last
        iteration, then push). Safe to try again."""
        nonlocal upcoming
        bar.reset()
        update = PolicyUpdate(transformer, args)
        pending, upcoming = upcoming, None
        if pending is not None:
            rollout = pending.result()
        push_start = time.perf_counter()
        version = pusher.push() if pushed is None else pushed
        push_seconds = time.perf_counter() - push_start
        bar.update(1)
        if pending is None:
            on_step = functools.partial(
                step_arrived, bar=bar, update=update if args.score_while_streaming else None, early=early
            )
            request = ranks.share(rollout_request(args, iteration, version), max_samples)
            rollout = stream(client, request, args.stall_timeout, on_step)
        return rollout, update, version, push_seconds

    def push_from_rank_0(iteration: int) -> int | None:
        """With several ranks: rank 0 pushes (tried again as a rollout is) and every rank learns the
        version; alone, the rollout phase pushes."""
        if ranks.world == 1:
            return None
        what = f"iteration {iteration}: the push"
        return ranks.agree(
            retrying(what, pusher.push, args.retries, client.address) if ranks.leader else None
        )

    metrics_path = args.out / "metrics.csv" if ranks.leader else Path(os.devnull)  # rank 0 writes the run
    with open(metrics_path, "w", newline="") as metrics, ThreadPoolExecutor(1) as pool:
        writer = csv.DictWriter(metrics, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        for iteration in range(len(rows), args.iterations):
            start = time.perf_counter()
            bar = tqdm(
                total=args.steps + 2,
                desc=f"iter {iteration:>4}",
                dynamic_ncols=True,
                disable=not ranks.leader,
            )
            try:
                pushed = push_from_rank_0(iteration)
                rollout, update, version, push_seconds = retrying(
                    f"iteration {iteration}",
                    functools.partial(roll_out, iteration, bar, pushed),
                    args.retries,
                    client.address,
                )
            except ServerFailure as failure:
                bar.close()
                if not rows:
                    raise ServerFailure(f"{failure}; no iteration had finished") from failure
                if saved < len(rows) and ranks.leader:
                    save_checkpoint(checkpoint, args, transformer, optimizer, schedule, rows)
                raise ServerFailure(
                    f"{failure}; iterations 0-{len(rows) - 1} are in {checkpoint}: run again with --resume"
                ) from failure
            bar.update(args.steps + 1 - bar.n)
            if args.async_ and iteration + 1 < args.iterations:
                # Streams while this iteration trains, on the policy just pushed: one behind the next.
                request = rollout_request(args, iteration + 1, version)
                upcoming = pool.submit(stream, client, request, args.stall_timeout)
            if not 0 <= version - rollout.policy_version <= staleness:
                raise RuntimeError(
                    f"iteration {iteration} ran on policy {rollout.policy_version}, not {version}"
                )

            result, eval_seconds = None, math.nan
            if args.eval_every and iteration % args.eval_every == 0 and ranks.leader:
                eval_start = time.perf_counter()
                result = evaluate(client, args)  # the policy that rolled this iteration out
                eval_seconds = time.perf_counter() - eval_start
                if iteration == 0:
                    record_eval(args.out / "eval.json", "before", result.table)
                    eval_grid(result, args.out / "samples" / "eval-before.png")

            trajectories = rollout.trajectories
            rewards = reward([t.image() for t in trajectories], [t.prompt for t in trajectories])
            train_start = time.perf_counter()
            if args.tree:
                optimizer.zero_grad(set_to_none=True)
                update.finish_tree(trajectories, tree_advantages(trajectories, rewards, args.tree_advantages))
                optimizer.step()
                loss = update.loss
            elif args.algorithm == "nft":
                advantages = group_advantages(rewards, torch.tensor([t.prompt_index for t in trajectories]))
                loss = nft_update(transformer, optimizer, trajectories, advantages, args, iteration)
            else:
                advantages = group_advantages(rewards, torch.tensor([t.prompt_index for t in trajectories]))
                optimizer.zero_grad(set_to_none=True)
                update.finish(rollout.collector, advantages)
                ranks.average_gradients(parameters)
                optimizer.step()
                loss = update.loss
            schedule.step()
            bar.update(1)
            # Over every rank's share: all rewards, the mean of the ranks' losses, the largest deviation.
            shares = ranks.gather((rewards, loss, update.ratio_max_dev))
            all_rewards = torch.cat([share[0] for share in shares])
            row = {
                "iteration": iteration,
                "policy_version": rollout.policy_version,
                "pushed_version": version,
                "reward_mean": all_rewards.mean().item(),
                "reward_std": all_rewards.std(correction=0).item(),
                "loss": sum(share[1] for share in shares) / ranks.world,
                "ratio_max_dev": math.nan if args.algorithm == "nft" else max(share[2] for share in shares),
                "kl": update.kl if args.kl_beta > 0 else math.nan,
                "scored_steps": ""
                if args.algorithm == "nft"
                else " ".join(map(str, stochastic_steps(rollout.collector))),
                "rollout_seconds": rollout.seconds,
                "train_seconds": time.perf_counter() - train_start,
                "update_seconds": push_seconds,
                "iteration_seconds": time.perf_counter() - start,
                "eval_accuracy": math.nan if result is None else result.accuracy,
                "transformer_rows": rollout.collector.finished.message.transformer_rows,
                "pruned_leaves": sum(
                    leaf.id in rollout.collector.pruned for leaf in rollout.collector.tree.leaves
                )
                if args.tree
                else 0,
                "prune_asked": rollout.prune_asked,
                "prune_stopped": rollout.prune_stopped,
                "eval_seconds": eval_seconds,
            }
            writer.writerow(row)
            metrics.flush()
            rows.append(row)
            bar.set_postfix(reward=f"{row['reward_mean']:.5f}", ratio_dev=f"{row['ratio_max_dev']:.1e}")
            bar.close()
            if not ranks.leader:
                continue
            if iteration in (0, args.iterations - 1):
                save_images(trajectories, args.out / "samples" / f"iter-{iteration:04d}")
            if len(rows) % args.checkpoint_every == 0 or len(rows) == args.iterations:
                save_checkpoint(checkpoint, args, transformer, optimizer, schedule, rows)
                saved = len(rows)
                say(f"checkpoint: iterations 0-{iteration} in {checkpoint}")
    if not ranks.leader:
        return rows
    saved_policy = save_policy(transformer, lora_config, args.out)
    plot_rewards(rows, args.reward, args.out / "reward.png")
    # The server ends on the final policy, for whoever samples from it next.
    try:
        retrying("the final push", pusher.push, args.retries, client.address)
        if args.eval_every:
            final = evaluate(client, args)
    except ServerFailure as failure:
        raise ServerFailure(f"{failure}; the run is complete, its policy in {saved_policy}") from failure
    finally:
        pusher.close()
    if args.eval_every:
        record_eval(args.out / "eval.json", "after", final.table)
        eval_grid(final, args.out / "samples" / "eval-after.png")
        plot_accuracy(rows, (args.iterations, final.accuracy), args.out / "accuracy.png")
        say(f"eval accuracy after {args.iterations} iterations: {final.accuracy:.3f}")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ranks = Ranks.start(args.device)
    if torch.device(args.device).type == "cuda" and ranks.world > 1:
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    if args.server is None and ranks.leader:
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
            rows = train(args, client, model_path, ranks)
            seconds = time.perf_counter() - started
    except ServerFailure as failure:
        raise SystemExit(f"train_grpo.py: stopped: {failure}") from None
    finally:
        if server is not None:
            server.stop()
        ranks.close()
    first, last = rows[0]["reward_mean"], rows[-1]["reward_mean"]
    on_policy = (
        ""
        if args.algorithm == "nft"
        else f", max ratio deviation {max(r['ratio_max_dev'] for r in rows):.1e}"
    )
    if not ranks.leader:
        return rows
    print(
        f"{len(rows)} iterations in {seconds:.0f} s ({'async' if args.async_ else 'sync'}, "
        f"{args.algorithm}): reward {first:.5f} -> {last:.5f}{on_policy}; results in {args.out}/"
    )
    return rows


if __name__ == "__main__":
    main()
