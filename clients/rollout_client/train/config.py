"""The trainer's command line: every flag, the rules between them, and what a resumed run must keep."""

import argparse
import dataclasses
import math
import numbers
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from rollout.v1 import rollout_pb2
from rollout_client.train.algorithms import ALGORITHMS, algorithm_name
from rollout_client.train.finite import non_finite_tensor
from rollout_client.train.lora import DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK
from rollout_client.train.prompts import PROMPT_SETS, PROMPTS, prompt_pool
from rollout_client.train.rewards import reward_terms
from rollout_client.train.rollouts import branch_points

TRAINED = ("lora", "full")  # --train


WEIGHT_SYNCS = ("auto", "grpc", "group")  # --weight-sync


TREE_ADVANTAGES = ("branch-mean", "branch-log-prob", "backed-up")  # the first is the default


TREE_SDE = ("all", "forks")  # --tree-sde; the first is the default


DEFAULT_PRUNE_KEEP = 4


# Flags of one algorithm's update, refused with the others.
ALGORITHM_FLAGS = {
    "nft_old_decay": ("nft",),
    "nft_old_ramp": ("nft",),
    "nft_min_level": ("nft", "awm"),
    "awm_power": ("awm",),
    "awm_kl": ("awm",),
}


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
    "colocate",
    "weight_sync",
    "sync_address",
    "time_budget",
}


# A config field's rule: why its value cannot train, or None. NaN fails every comparison, so every
# numeric rule refuses it.
Rule = Callable[[Any], str | None]


def number(must: str, holds: Callable[[Any], bool], integer: bool = False) -> Rule:
    """The rule of a number (an integer where ``integer``) that ``holds``; ``must`` says what it must be."""
    kind = numbers.Integral if integer else numbers.Real

    def problem(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"must be {'an integer' if integer else 'a number'}, got {value!r}"
        return None if holds(value) else f"must be {must}, got {value}"

    return problem


def at_least(minimum: int, why: str = "") -> Rule:
    return number(f"at least {minimum}{why}", lambda value: value >= minimum, integer=True)


def positive(why: str = "") -> Rule:
    return number(f"finite and above 0{why}", lambda value: 0 < value < math.inf)


def parses(parse: Callable[[str], Any]) -> Rule:
    """The rule of a text that ``parse`` takes: its ValueError says why not."""

    def problem(text: str) -> str | None:
        try:
            parse(text)
        except ValueError as error:
            return str(error)
        return None

    return problem


NOT_NEGATIVE = number("finite and at least 0", lambda value: 0 <= value < math.inf)
FRACTION = number("in [0, 1)", lambda value: 0 <= value < 1)
SEED = number("in [0, 2^32)", lambda value: 0 <= value < 2**32, integer=True)


class ConfigError(ValueError):
    """A config field set to a value no run can train with; the message names the field
    (``OptimConfig.lr``), ``flag`` is its command-line flag and ``problem`` what is wrong."""

    def __init__(self, part: type["Checked"], field: str, problem: str):
        super().__init__(f"{part.__name__}.{field} {problem}")
        self.flag = "--" + part.dest(field).rstrip("_").replace("_", "-")
        self.problem = problem


class Checked:
    """A part of a run's config that refuses, on construction, a value no run can train with
    (``ConfigError``): ``RULES`` holds each checked field's rule; None passes where the field's type
    allows it. A field's flag is ``FLAG_PREFIX`` + its name, unless ``FLAGS`` names another."""

    RULES: ClassVar[dict[str, Rule]] = {}
    FLAG_PREFIX: ClassVar[str] = ""
    FLAGS: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in self.RULES and not (value is None and type(None) in typing.get_args(field.type)):
                self.check(field.name, value)

    @classmethod
    def check(cls, field: str, value: Any) -> None:
        problem = cls.RULES[field](value)
        if problem is not None:
            raise ConfigError(cls, field, problem)

    @classmethod
    def dest(cls, field: str) -> str:
        """The argparse name of ``field``'s flag."""
        return cls.FLAGS.get(field, cls.FLAG_PREFIX + field)


def check_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag a config field takes, by that field's rule (before the rules between flags, which
    assume sane values); a flag left unset (None) is checked once its default is filled in."""
    for part in CONFIG_PARTS:
        for field in part.RULES:
            value = getattr(args, part.dest(field))
            if value is not None:
                try:
                    part.check(field, value)
                except ConfigError as error:
                    parser.error(f"argument {error.flag}: {error.problem}")


def parse_args(argv: list[str] | None) -> "TrainConfig":
    """The run's TrainConfig from its command line; an argument that cannot train exits with status 2
    and a message naming its flag."""
    return TrainConfig.of(parse_flags(argv))


def parse_flags(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="FlowGRPO (or DiffusionNFT) on the rollout stream: a small, real trainer to copy from."
    )
    parser.add_argument("--server", help="address of a running server (default: start one on --model)")
    parser.add_argument("--model", default="tiny-flux", help="preset or folder for the server we start")
    parser.add_argument("--model-path", type=Path, help="the model folder (default: the server's)")
    parser.add_argument("--token-file", type=Path, help="admin token of a server started with tokens")
    parser.add_argument("--iterations", type=int, default=70)
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
        type=int,
        default=0,
        help="with --prompt-set shapes: draw from the first this many train prompts only (0: all)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="with --prompt-set shapes: evaluate the policy on the eval prompts this often (0: never)",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=4,
        help="with --eval-every: images per eval prompt, from seeds --eval-seed + k (4: 256 images)",
    )
    parser.add_argument(
        "--eval-seed",
        type=int,
        default=2024,
        help="the eval's first seed, the same for every run and checkpoint (its evals are paired)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds the whole run may take, its evals included: no iteration is started that would "
        "not end, with the final eval, inside it (0: no budget)",
    )
    parser.add_argument(
        "--ema-decay",
        type=float,
        default=0.0,
        help="keep an EMA of the trained weights with this decay per iteration: the evals and the run's "
        "end push it, and AWM's KL pulls towards it (0: none)",
    )
    parser.add_argument(
        "--cfg",
        type=float,
        help="true CFG scale of the rollouts, Flux and Qwen-Image (default: the server's; shapes: 3)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=8,
        help="samples per prompt (G); with --tree, the roots per prompt",
    )
    parser.add_argument(
        "--tree",
        default="",
        help="tree rollouts: branch points step:factor[:noise_level], comma-separated (e.g. 0:2,3:2,6:2)",
    )
    parser.add_argument(
        "--tree-sde",
        choices=TREE_SDE,
        default=TREE_SDE[0],
        help="with --tree: every step stochastic, or only the branch steps (the others deterministic: "
        "a prompt's leaves differ only where they fork)",
    )
    parser.add_argument(
        "--prune-at",
        type=int,
        help="with --tree: when this step arrives, prune each prompt's middle nodes by predicted reward",
    )
    parser.add_argument(
        "--prune-keep",
        type=int,
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
        type=float,
        default=1.0,
    )
    parser.add_argument(
        "--window", type=int, default=0, help="Flow-GRPO-Fast: this many consecutive SDE steps (0: all)"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="peak; a cosine takes it to lr / 10")
    parser.add_argument(
        "--algorithm",
        choices=[name for name in ALGORITHMS if name != "tree"],  # --tree selects that one
        default="flowgrpo",
        help="FlowGRPO's clipped policy loss on the stochastic steps, or DiffusionNFT's or AWM's on the "
        "final latents",
    )
    parser.add_argument("--nft-beta", type=float, default=1.0, help="nft: the implicit policies' step beta")
    parser.add_argument(
        "--nft-loss",
        choices=("velocity", "x0"),
        default="velocity",
        help="nft: the loss on the velocities (rollout_client.nft.nft_loss), or the official scripts' on "
        "the predicted clean sample, each sample divided by its own mean absolute error (nft_x0_loss)",
    )
    parser.add_argument(
        "--nft-anchor",
        type=float,
        default=0.0,
        help="nft: weight of the squared velocity distance to the base model "
        "(rollout_client.nft.anchor_loss); its gradient norm and the policy term's are logged",
    )
    parser.add_argument(
        "--nft-old-decay",
        type=float,
        default=0.0,
        help="nft: roll out with an old policy that follows the trained one, old <- eta old + "
        "(1 - eta) theta after each iteration, eta ramping up to this (0: roll out with the trained one)",
    )
    parser.add_argument(
        "--nft-old-ramp",
        type=int,
        default=20,
        help="nft: the iterations over which the old policy's eta ramps from 0 to --nft-old-decay",
    )
    parser.add_argument(
        "--nft-draws",
        type=int,
        default=4,
        help="nft and awm: optimizer steps per iteration, each on a fresh noise and level of every sample",
    )
    parser.add_argument(
        "--nft-min-level",
        type=float,
        default=0.0,
        help="nft and awm: draw the noise levels in [this, 1) only (0.5: the high-noise half)",
    )
    parser.add_argument(
        "--awm-power",
        type=float,
        default=0.25,
        help="awm: the power p of the robust weighting (t / p) ((l + 1e-3)^p - 1e-3^p) of each "
        "sample's flow-matching error l (1: the plain error, times t)",
    )
    parser.add_argument(
        "--awm-kl",
        type=float,
        default=0.0,
        help="awm: weight of the squared velocity distance to the EMA of --ema-decay (0: none)",
    )
    parser.add_argument(
        "--clip-range",
        type=float,
        help="PPO clip range (default 1e-4; 1e-2 with --async, whose one-version-stale ratios reach 1e-2)",
    )
    parser.add_argument("--kl-beta", type=float, default=0.0, help="weight of the KL to the base model")
    parser.add_argument(
        "--grpo-guard",
        action="store_true",
        help="FlowGRPO: GRPO-Guard's ratio, each step's log-ratio unbiased and rescaled by its noise std, "
        "its surrogate divided by dt (rollout_client.grpo.guarded_policy_loss)",
    )
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
    parser.add_argument("--lora-rank", type=int, default=DEFAULT_LORA_RANK)
    parser.add_argument(
        "--lora-alpha", type=float, default=DEFAULT_LORA_ALPHA, help="the LoRA's output scale is alpha / rank"
    )
    parser.add_argument(
        "--lora-targets",
        default="",
        help="comma-separated modules (default: the server's default targets, its model's attention and "
        "feed-forward layers)",
    )
    parser.add_argument("--micro-batch", type=int, default=32, help="rows per forward and backward")
    parser.add_argument(
        "--reward",
        default="rollout_client.rewards:jpeg_compressibility",
        help="module:callable, or a weighted sum: module:callable*weight,... (rollout_client.train.rewards)",
    )
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
    parser.add_argument("--checkpoint-every", type=int, default=10, help="iterations between checkpoints")
    parser.add_argument("--resume", action="store_true", help=f"go on from --out's {CHECKPOINT}")
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="seconds the server may send nothing: between a rollout's events, or for a whole push or "
        "info call (above the slowest step of a rollout, queueing included)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=8,
        help="times a failed server phase is tried again, after pauses of 1, 2, 4 ... 30 s",
    )
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="the server shares the trainer's devices: it releases its weights' memory while the policy "
        "trains, and resumes it before the next push",
    )
    args = parser.parse_args(argv)
    check_values(parser, args)
    if args.weight_sync == "auto":
        args.weight_sync = "group" if args.train == "full" else "grpc"
    if args.ema_decay and args.async_:
        parser.error("--ema-decay's evals push the EMA between rollouts: it needs sync mode")
    if args.awm_kl and not args.ema_decay:
        parser.error("--awm-kl pulls towards the EMA of the trained weights: it needs --ema-decay")
    if args.train == "full" and args.nft_anchor:
        parser.error("--nft-anchor compares with the base model through the LoRA: it needs --train lora")
    if args.train == "full" and args.kl_beta:
        parser.error("--kl-beta compares with the base model through the LoRA: it needs --train lora")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        # Ranks split each iteration's prompts and average their gradients before one optimizer step.
        for flag in ("async_", "tree", "prune_at", "score_while_streaming"):
            if getattr(args, flag) not in (None, False, ""):
                parser.error(f"--{flag.rstrip('_').replace('_', '-')} runs on one trainer rank, not {world}")
        if args.prompts % world:
            parser.error(f"--prompts {args.prompts} must split evenly over the {world} trainer ranks")
    if args.clip_range is None:
        args.clip_range = 1e-2 if args.async_ else 1e-4
    if args.async_ and args.grpo_guard:
        parser.error(
            "--grpo-guard takes the rollout policy's step means from the trainer's: it needs sync mode"
        )
    if args.async_ and args.score_while_streaming:
        parser.error("--score-while-streaming scores with the rollout's policy: it needs sync mode")
    if args.async_ and args.colocate:
        parser.error("--colocate releases the server's memory while the policy trains: it needs sync mode")
    if args.prompt:
        if args.prompt_pool:
            parser.error("--prompt-pool draws from a prompt set: it does not go with --prompt")
        args.prompts = len(args.prompt)
    prompt_count = len(PROMPTS) if args.prompt_set == "scenes" else len(prompt_pool(args.prompt_pool))
    if not args.prompt and not 1 <= args.prompts <= prompt_count:
        parser.error(f"--prompts must be in [1, {prompt_count}] for --prompt-set {args.prompt_set}")
    branches = branch_points(args.tree)
    if any(not 0 <= branch.step < args.steps or branch.factor < 1 for branch in branches):
        parser.error("--tree: every branch step must be in [0, --steps), every factor at least 1")
    leaves_per_prompt = args.group_size * math.prod(branch.factor for branch in branches)
    if leaves_per_prompt < 2:
        parser.error(
            "argument --group-size: must be at least 2 (advantages are standardised within a prompt's "
            "group: one sample has none), or 1 with a --tree that forks"
        )
    problem = ALGORITHMS[algorithm_name(args.tree, args.algorithm)].refusal(args, world)
    if problem:
        parser.error(problem)
    for flag, algorithms in ALGORITHM_FLAGS.items():
        if getattr(args, flag) != parser.get_default(flag) and args.algorithm not in algorithms:
            parser.error(f"--{flag.replace('_', '-')} is for --algorithm {' or '.join(algorithms)}")
    if not args.tree and args.tree_advantages is not None:
        parser.error("--tree-advantages scores the nodes of a tree: it needs --tree")
    args.tree_advantages = args.tree_advantages or TREE_ADVANTAGES[0]
    if args.prune_keep is None:
        args.prune_keep = DEFAULT_PRUNE_KEEP
    elif args.prune_at is None:
        parser.error("--prune-keep is what --prune-at keeps: it needs --prune-at")
    if args.prune_at is not None:
        check_prune_flags(parser, args, branches)
    if not args.tree and args.tree_sde != TREE_SDE[0]:
        parser.error("--tree-sde picks a tree's stochastic steps: it needs --tree")
    for flag in ("prompt_pool", "eval_every"):
        if getattr(args, flag) and args.prompt_set != "shapes":
            parser.error(f"--{flag.replace('_', '-')} is for the shapes task: it needs --prompt-set shapes")
    if not 0 <= args.window <= args.steps:
        parser.error("--window must be in [0, --steps]")
    args.checkpoint = None
    if args.resume:
        path = args.out / CHECKPOINT
        if not path.is_file():
            parser.error(f"--resume: no {CHECKPOINT} in {args.out}")
        args.checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        weights = args.checkpoint["policy"].items()
        problem = non_finite_tensor((f"{path}'s weight {name}", tensor) for name, tensor in weights)
        if problem:
            parser.error(f"--resume: {problem}: no run can go on from it")
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


def run_settings(args: argparse.Namespace) -> dict:
    """The flags that decide what a run computes, as its checkpoints record them."""
    ignored = OPERATIONAL_FLAGS | {"checkpoint"}
    return {name: value for name, value in vars(args).items() if name not in ignored}


@dataclass
class ServerConfig(Checked):
    RULES = {"stall_timeout": positive(), "retries": at_least(0)}

    address: str | None  # --server; None: the run starts one on ``model``
    model: str
    model_path: Path | None
    token_file: Path | None
    stall_timeout: float
    retries: int
    colocate: bool  # the server releases its weights' memory while the policy trains


@dataclass
class RolloutConfig(Checked):
    RULES = {
        "prompts": at_least(1),
        "prompt_pool": at_least(0),
        "group_size": at_least(1),
        "steps": at_least(1),
        "size": at_least(1),
        "noise_level": positive(" (at 0 the sampler is deterministic: no log-probs to train on)"),
        "window": at_least(0),
        "cfg": number("finite and at least 1", lambda value: 1 <= value < math.inf),
    }

    prompts: int  # P
    prompt_set: str
    fixed_prompts: list[str]  # --prompt
    prompt_pool: int
    group_size: int  # G, or a tree's roots per prompt
    steps: int
    size: int
    noise_level: float
    window: int
    cfg: float | None
    async_: bool
    score_while_streaming: bool


@dataclass
class TreeConfig(Checked):
    RULES = {
        "points": parses(branch_points),
        "prune_at": at_least(0),
        "prune_keep": at_least(2, " (a prompt's advantages compare at least two of its nodes)"),
    }
    FLAGS = {"points": "tree"}

    points: str  # --tree's branch points ("" for flat groups)
    prune_at: int | None
    prune_keep: int
    advantages: str
    sde: str  # "all": every step stochastic; "forks": the branch steps only


@dataclass
class OptimConfig(Checked):
    RULES = {
        "lr": positive(),
        "clip_range": positive(),
        "kl_beta": NOT_NEGATIVE,
        "micro_batch": at_least(1),
        "lora_rank": at_least(1),
        "lora_alpha": positive(" (the LoRA's output scale is alpha / rank: at 0 it trains nothing)"),
    }

    lr: float
    clip_range: float
    kl_beta: float
    grpo_guard: bool  # GRPO-Guard's normalised ratio instead of PPO's
    micro_batch: int
    train: str  # "lora" or "full"
    lora_rank: int
    lora_alpha: float
    lora_targets: str  # comma-separated; "": the server's default targets (GetServerInfo.lora_targets)


@dataclass
class NFTConfig(Checked):
    RULES = {
        "beta": positive(),
        "draws": at_least(1),
        "anchor": NOT_NEGATIVE,
        "old_decay": FRACTION,
        "old_ramp": at_least(0),
        "min_level": FRACTION,
    }
    FLAG_PREFIX = "nft_"

    beta: float
    draws: int
    loss: str  # "velocity" or "x0"
    anchor: float  # weight of the anchor to the base model; 0: none
    old_decay: float  # the old policy's eta at most; 0: the rollouts are the trained policy's
    old_ramp: int  # iterations over which eta ramps up to old_decay
    min_level: float  # the noise levels are drawn in [min_level, 1)


@dataclass
class AWMConfig(Checked):
    RULES = {"power": positive(), "kl": NOT_NEGATIVE}
    FLAG_PREFIX = "awm_"

    power: float  # of the robust weighting
    kl: float  # weight of the distance to the EMA; 0: none


@dataclass
class SyncConfig:
    weight_sync: str  # "grpc" or "group"
    address: str


@dataclass
class CheckpointConfig(Checked):
    RULES = {"every": at_least(1)}
    FLAG_PREFIX = "checkpoint_"

    out: Path
    every: int
    resume: bool
    state: dict | None  # the checkpoint a resumed run goes on from


@dataclass
class EvalConfig(Checked):
    RULES = {"every": at_least(0), "samples": at_least(1), "seed": SEED}
    FLAG_PREFIX = "eval_"

    every: int
    samples: int  # images per eval prompt
    seed: int  # the eval's first seed


@dataclass
class TrainConfig(Checked):
    """A run, in small parts; ``settings`` is what its checkpoints record (``run_settings``). Each part
    checks its own fields on construction (``Checked``), this one the run's."""

    RULES = {
        "iterations": at_least(1),
        "seed": SEED,
        "threads": at_least(1),
        "reward": parses(reward_terms),
        "time_budget": NOT_NEGATIVE,
        "ema_decay": FRACTION,
    }

    algorithm: str
    iterations: int
    seed: int
    device: str
    threads: int
    reward: str
    time_budget: float  # seconds; 0: none
    ema_decay: float  # 0: no EMA
    server: ServerConfig
    rollout: RolloutConfig
    tree: TreeConfig
    optim: OptimConfig
    nft: NFTConfig
    awm: AWMConfig
    sync: SyncConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    settings: dict

    @classmethod
    def of(cls, flags: argparse.Namespace) -> "TrainConfig":
        """The config of checked flags (``parse_flags``)."""
        f = flags
        return cls(
            algorithm=f.algorithm,
            iterations=f.iterations,
            seed=f.seed,
            device=f.device,
            threads=f.threads,
            reward=f.reward,
            time_budget=f.time_budget,
            ema_decay=f.ema_decay,
            server=ServerConfig(
                f.server, f.model, f.model_path, f.token_file, f.stall_timeout, f.retries, f.colocate
            ),
            rollout=RolloutConfig(
                f.prompts,
                f.prompt_set,
                f.prompt,
                f.prompt_pool,
                f.group_size,
                f.steps,
                f.size,
                f.noise_level,
                f.window,
                f.cfg,
                f.async_,
                f.score_while_streaming,
            ),
            tree=TreeConfig(f.tree, f.prune_at, f.prune_keep, f.tree_advantages, f.tree_sde),
            optim=OptimConfig(
                f.lr,
                f.clip_range,
                f.kl_beta,
                f.grpo_guard,
                f.micro_batch,
                f.train,
                f.lora_rank,
                f.lora_alpha,
                f.lora_targets,
            ),
            nft=NFTConfig(
                f.nft_beta,
                f.nft_draws,
                f.nft_loss,
                f.nft_anchor,
                f.nft_old_decay,
                f.nft_old_ramp,
                f.nft_min_level,
            ),
            awm=AWMConfig(f.awm_power, f.awm_kl),
            sync=SyncConfig(f.weight_sync, f.sync_address),
            checkpoint=CheckpointConfig(f.out, f.checkpoint_every, f.resume, f.checkpoint),
            eval=EvalConfig(f.eval_every, f.eval_samples, f.eval_seed),
            settings=run_settings(f),
        )


# The parts whose flags ``check_values`` checks: the run's and each of its parts'.
CONFIG_PARTS = (
    TrainConfig,
    *(
        field.type
        for field in dataclasses.fields(TrainConfig)
        if isinstance(field.type, type) and issubclass(field.type, Checked)
    ),
)
