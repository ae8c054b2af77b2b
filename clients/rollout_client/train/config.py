"""The trainer's configuration: one dataclass per concern, each field a flag with its help, default and
rule (``options``), every rule between flags in ``TrainConfig.__post_init__``, so a config built in
code is refused exactly as the command line refuses it; the command line is generated from the fields
(``parser``). Each algorithm's options live beside it (``algorithms``) and join every config."""

import argparse
import dataclasses
import math
import os
from pathlib import Path
from typing import Any, ClassVar

import torch

from rollout_client.train.algorithms import ALGORITHMS, OPTIONS, algorithm_name
from rollout_client.train.finite import non_finite_tensor
from rollout_client.train.lora import DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK
from rollout_client.train.options import (
    FRACTION,
    NOT_NEGATIVE,
    SEED,
    ConfigError,
    Options,
    at_least,
    number,
    option,
    parses,
    positive,
)
from rollout_client.train.prompts import PROMPT_SETS, PROMPTS, prompt_pool
from rollout_client.train.rewards import reward_terms

__all__ = ["CHECKPOINT", "ConfigError", "TrainConfig", "flag_table", "parse_args", "parser"]

TRAINED = ("lora", "full")  # --train
WEIGHT_SYNCS = ("auto", "grpc", "group")  # --weight-sync
REPORT_TO = ("none", "tensorboard", "wandb")  # --report-to
CHECKPOINT = "checkpoint.pt"
DESCRIPTION = "FlowGRPO (or DiffusionNFT) on the rollout stream: a small, real trainer to copy from."


@dataclasses.dataclass
class ServerConfig(Options):
    """The server: one the run starts, or one running elsewhere."""

    address: str | None = option(
        None, "address of a running server (default: start one on --model)", flag="--server", operational=True
    )
    model: str = option("tiny-flux", "preset or folder for the server we start")
    model_path: Path | None = option(None, "the model folder (default: the server's)", operational=True)
    token_file: Path | None = option(None, "admin token of a server started with tokens", operational=True)
    stall_timeout: float = option(
        120.0,
        "seconds the server may send nothing: between a rollout's events, or for a whole push or "
        "info call (above the slowest step of a rollout, queueing included)",
        rule=positive(),
        operational=True,
    )
    retries: int = option(
        8,
        "times a failed server phase is tried again, after pauses of 1, 2, 4 ... 30 s",
        rule=at_least(0),
        operational=True,
    )
    colocate: bool = option(
        False,
        "the server shares the trainer's devices: it releases its weights' memory while the policy "
        "trains, and resumes it before the next push",
        operational=True,
    )


@dataclasses.dataclass
class RolloutConfig(Options):
    """What each iteration rolls out: P prompts x G samples, their steps and size."""

    prompts: int = option(4, "prompts per iteration (P)", rule=at_least(1))
    prompt_set: str = option(
        "scenes",
        "the fixed scene prompts, or P of the shapes task's train prompts drawn per iteration",
        choices=PROMPT_SETS,
    )
    fixed_prompts: list[str] = option(
        help="train on this prompt every iteration (repeatable; instead of --prompt-set's prompts)",
        flag="--prompt",
        default_factory=list,
    )
    prompt_pool: int = option(
        0,
        "with --prompt-set shapes: draw from the first this many train prompts only (0: all)",
        rule=at_least(0),
    )
    cfg: float | None = option(
        None,
        "true CFG scale of the rollouts, Flux and Qwen-Image (default: the server's; shapes: 3)",
        rule=number("finite and at least 1", lambda value: 1 <= value < math.inf),
    )
    group_size: int = option(8, "samples per prompt (G); with --tree, the roots per prompt", rule=at_least(1))
    steps: int = option(6, "denoising steps", rule=at_least(1))
    size: int = option(128, "image height and width", rule=at_least(1))
    noise_level: float = option(
        1.0, rule=positive(" (at 0 the sampler is deterministic: no log-probs to train on)")
    )
    window: int = option(0, "Flow-GRPO-Fast: this many consecutive SDE steps (0: all)", rule=at_least(0))
    async_: bool = option(False, "one version stale rollouts", flag="--async")
    score_while_streaming: bool = option(
        False, "sync only: compute each step's log-probs as it arrives (holds their graphs until the end)"
    )

    def check(self) -> None:
        """--prompt sets P; otherwise P must be in the prompt set."""
        if self.fixed_prompts:
            if self.prompt_pool:
                raise ConfigError("--prompt-pool draws from a prompt set: it does not go with --prompt")
            self.prompts = len(self.fixed_prompts)
        elif self.prompt_set != "shapes" and self.prompt_pool:
            raise ConfigError("--prompt-pool is for the shapes task: it needs --prompt-set shapes")
        else:
            count = len(PROMPTS) if self.prompt_set == "scenes" else len(prompt_pool(self.prompt_pool))
            if not 1 <= self.prompts <= count:
                raise ConfigError(f"--prompts must be in [1, {count}] for --prompt-set {self.prompt_set}")
        if not 0 <= self.window <= self.steps:
            raise ConfigError("--window must be in [0, --steps]")


@dataclasses.dataclass
class OptimConfig(Options):
    """What trains, and its optimizer and loss."""

    lr: float = option(1e-2, "peak; a cosine takes it to lr / 10", rule=positive())
    clip_range: float | None = option(
        None,
        "PPO clip range (default 1e-4; 1e-2 with --async, whose one-version-stale ratios reach 1e-2)",
        rule=positive(),
    )
    kl_beta: float = option(0.0, "weight of the KL to the base model", rule=NOT_NEGATIVE)
    grpo_guard: bool = option(
        False,
        "FlowGRPO: GRPO-Guard's ratio, each step's log-ratio unbiased and rescaled by its noise std, "
        "its surrogate divided by dt (rollout_client.grpo.guarded_policy_loss)",
    )
    train: str = option(
        "lora",
        "what the optimizer trains: a LoRA of the transformer, or every parameter of it",
        choices=TRAINED,
    )
    lora_rank: int = option(DEFAULT_LORA_RANK, rule=at_least(1))
    lora_alpha: float = option(
        DEFAULT_LORA_ALPHA,
        "the LoRA's output scale is alpha / rank",
        rule=positive(" (the LoRA's output scale is alpha / rank: at 0 it trains nothing)"),
    )
    lora_targets: str = option(
        "",
        "comma-separated modules (default: the server's default targets, its model's attention and "
        "feed-forward layers)",
    )
    micro_batch: int = option(32, "rows per forward and backward", rule=at_least(1))


@dataclasses.dataclass
class SyncConfig(Options):
    """How the policy reaches the server."""

    FLAG_PREFIX: ClassVar[str] = "sync_"

    weight_sync: str = option(
        "auto",
        "how the policy reaches the server: UpdateWeights over gRPC, or broadcasts over a "
        "weight-sync group (auto: the group for --train full, gRPC for a LoRA)",
        flag="--weight-sync",
        choices=WEIGHT_SYNCS,
        operational=True,
    )
    address: str = option(
        "127.0.0.1",
        "with the weight-sync group: this host's address as the server reaches it",
        operational=True,
    )


@dataclasses.dataclass
class CheckpointConfig(Options):
    """Where the run writes, and what it goes on from."""

    FLAG_PREFIX: ClassVar[str] = "checkpoint_"

    out: Path = option(Path("train-output"), flag="--out", operational=True)
    every: int = option(10, "iterations between checkpoints", rule=at_least(1), operational=True)
    resume: bool = option(False, f"go on from --out's {CHECKPOINT}", flag="--resume", operational=True)
    state: dict | None = None  # the checkpoint a resumed run goes on from (TrainConfig loads it)


def parse_search_steps(text: str) -> list[int]:
    """--search-steps' steps; ValueError unless they are integers at least 0, strictly increasing."""
    try:
        steps = [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"not integers separated by commas: {text!r}") from None
    if steps[0] < 0 or any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise ValueError(f"must be at least 0 and strictly increasing, got {text!r}")
    return steps


@dataclasses.dataclass
class EvalConfig(Options):
    """The shapes task's eval of the policy."""

    FLAG_PREFIX: ClassVar[str] = "eval_"

    every: int = option(
        0,
        "with --prompt-set shapes: evaluate the policy on the eval prompts this often (0: never)",
        rule=at_least(0),
    )
    samples: int = option(
        4,
        "with --eval-every: images per eval prompt, from seeds --eval-seed + k (4: 256 images)",
        rule=at_least(1),
    )
    seed: int = option(
        2024,
        "the eval's first seed, the same for every run and checkpoint (its evals are paired)",
        rule=SEED,
    )
    prompts: int = option(
        0,
        "with --eval-every: evaluate on the first this many eval prompts only (0: all of them)",
        rule=at_least(0),
    )
    search: int = option(
        0,
        "with --eval-every: also evaluate with step-wise search, the best of K children by --reward on "
        "their previews at each --search-steps step, its forwards beside plain sampling's (0: none)",
        flag="--search",
        rule=number("0 or at least 2", lambda value: value == 0 or value >= 2, integer=True),
    )
    search_steps: str = option(
        "0,2,4",
        "with --search: the steps it branches at, strictly increasing, comma-separated",
        flag="--search-steps",
        rule=parses(parse_search_steps),
    )

    @property
    def searched_steps(self) -> list[int]:
        return parse_search_steps(self.search_steps)


@dataclasses.dataclass
class ReportConfig(Options):
    """Where the run reports besides metrics.csv and its plots

    ``rollout_client.train.report`` writes it."""

    report_to: str = option(
        "none",
        "also write the metrics, the eval accuracy and sample images for TensorBoard (in --out/tensorboard) "
        "or for W&B, offline (in --out/wandb; nothing leaves the machine)",
        choices=REPORT_TO,
        operational=True,
    )


# The run's parts, by the name a TrainConfig holds them under; the algorithms' options follow them.
PARTS: dict[str, type[Options]] = {
    "server": ServerConfig,
    "rollout": RolloutConfig,
    "optim": OptimConfig,
    "sync": SyncConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "report": ReportConfig,
}


@dataclasses.dataclass
class TrainConfig(Options):
    """A run, in parts: ``server``, ``rollout``, ``optim``, ``sync``, ``checkpoint``, ``eval``,
    ``report``, and each registered algorithm's options in ``options`` (read as ``config.nft``,
    ``config.tree`` ...; one left out takes its defaults). Each part checks its own fields on
    construction; this one checks the run's fields and every rule between parts, and with
    ``checkpoint.resume`` loads the checkpoint (``checkpoint.state``) and checks it."""

    algorithm: str = option(
        "flowgrpo",
        "FlowGRPO's clipped policy loss on the stochastic steps, DiffusionNFT's or AWM's on the "
        "final latents, or Step-GRPO's on --tree's edges, each with its own step's advantage",
        choices=lambda: [name for name in ALGORITHMS if name != "tree"],  # --tree selects that one
    )
    iterations: int = option(70, rule=at_least(1))
    seed: int = option(2024, rule=SEED)
    device: str = option("cpu", operational=True)
    threads: int = option(1, "torch threads of the trainer", rule=at_least(1), operational=True)
    reward: str = option(
        "rollout_client.rewards:jpeg_compressibility",
        "module:callable, or a weighted sum: module:callable*weight,... (rollout_client.train.rewards)",
        rule=parses(reward_terms),
    )
    time_budget: float = option(
        0.0,
        "seconds the whole run may take, its evals included: no iteration is started that would "
        "not end, with the final eval, inside it (0: no budget)",
        rule=NOT_NEGATIVE,
        operational=True,
    )
    ema_decay: float = option(
        0.0,
        "keep an EMA of the trained weights with this decay per iteration: the evals and the run's "
        "end push it, and AWM's KL pulls towards it (0: none)",
        rule=FRACTION,
    )
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    sync: SyncConfig = dataclasses.field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    report: ReportConfig = dataclasses.field(default_factory=ReportConfig)
    options: dict[str, Options] = dataclasses.field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        """An algorithm's options: ``config.nft`` is ``config.options["nft"]``."""
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def __post_init__(self) -> None:
        unknown = set(self.options) - set(OPTIONS)
        if unknown:
            raise ConfigError(f"no algorithm registers the options {sorted(unknown)}")
        self.options = {key: self.options.get(key) or part() for key, part in OPTIONS.items()}
        super().__post_init__()

    def check(self) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        problem = next(self.conflicts(world), None)
        if problem is not None:
            raise ConfigError(problem)
        if self.checkpoint.resume:
            self.check_resume()

    def conflicts(self, world: int):
        """The rules between parts, each a message in the order they are checked."""
        rollout, optim = self.rollout, self.optim
        if self.algorithm not in ALGORITHMS or self.algorithm == "tree":
            yield f"--algorithm {self.algorithm!r} is not a registered algorithm"
        if self.ema_decay and rollout.async_:
            yield "--ema-decay's evals push the EMA between rollouts: it needs sync mode"
        if optim.train == "full" and optim.kl_beta:
            yield "--kl-beta compares with the base model through the LoRA: it needs --train lora"
        if world > 1:
            # Ranks split each iteration's prompts and average their gradients before one optimizer step.
            for flag in rollout.flags_set("async_", "score_while_streaming"):
                yield f"{flag} runs on one trainer rank, not {world}"
            if rollout.prompts % world:
                yield f"--prompts {rollout.prompts} must split evenly over the {world} trainer ranks"
        if rollout.async_ and optim.grpo_guard:
            yield "--grpo-guard takes the rollout policy's step means from the trainer's: it needs sync mode"
        if rollout.async_ and rollout.score_while_streaming:
            yield "--score-while-streaming scores with the rollout's policy: it needs sync mode"
        if rollout.async_ and self.server.colocate:
            yield "--colocate releases the server's memory while the policy trains: it needs sync mode"
        if self.eval.every and rollout.prompt_set != "shapes":
            yield "--eval-every is for the shapes task: it needs --prompt-set shapes"
        if self.eval.search and not self.eval.every:
            yield "--search evaluates with step-wise search: it needs --eval-every"
        if self.eval.search and self.eval.searched_steps[-1] >= rollout.steps:
            yield f"--search-steps must be below --steps ({rollout.steps})"
        if rollout.group_size * self.tree.leaves_per_root() < 2:
            yield (
                "argument --group-size: must be at least 2 (advantages are standardised within a prompt's "
                "group: one sample has none), or 1 with a --tree that forks"
            )
        yield from filter(None, [ALGORITHMS[self.algorithm_name].refusal(self, world)])
        parts = [self, *(getattr(self, name) for name in PARTS), *self.options.values()]
        yield from filter(None, [part.off_algorithm(self.algorithm) for part in parts])
        yield from filter(None, [part.conflict(self, world) for part in self.options.values()])

    def check_resume(self) -> None:
        """--resume: the checkpoint is there, its weights finite, and this config computes its run."""
        out = self.checkpoint.out
        path = out / CHECKPOINT
        if self.checkpoint.state is None:
            if not path.is_file():
                raise ConfigError(f"--resume: no {CHECKPOINT} in {out}")
            self.checkpoint.state = torch.load(path, map_location="cpu", weights_only=True)
        weights = self.checkpoint.state["policy"].items()
        problem = non_finite_tensor((f"{path}'s weight {name}", tensor) for name, tensor in weights)
        if problem:
            raise ConfigError(f"--resume: {problem}: no run can go on from it")
        changed = [
            f"--{name.rstrip('_').replace('_', '-')} {value} (the checkpoint's run has {recorded})"
            for name, value in self.settings().items()
            if (recorded := self.checkpoint.state["settings"].get(name)) != value
        ]
        if changed:
            raise ConfigError(f"--resume: this command sets {', '.join(changed)}")

    @property
    def algorithm_name(self) -> str:
        """The registered algorithm the run trains with (``tree`` with --tree)."""
        return algorithm_name(self.tree.points, self.algorithm)

    @property
    def clip_range(self) -> float:
        """--clip-range, by default 1e-4, or 1e-2 with --async."""
        if self.optim.clip_range is not None:
            return self.optim.clip_range
        return 1e-2 if self.rollout.async_ else 1e-4

    @property
    def weight_sync(self) -> str:
        """ "grpc" or "group": --weight-sync, whose auto is the group for --train full."""
        if self.sync.weight_sync != "auto":
            return self.sync.weight_sync
        return "group" if self.optim.train == "full" else "grpc"

    def settings(self) -> dict[str, Any]:
        """The flags that decide what the run computes, as its checkpoints record them."""
        parts = [getattr(self, name) for name in PARTS] + list(self.options.values())
        settings = super().settings()
        for part in parts:
            settings |= part.settings()
        return settings | {"clip_range": self.clip_range}

    @classmethod
    def of_flags(cls, flags: argparse.Namespace, **others: Any) -> "TrainConfig":
        parts = {name: part.of_flags(flags) for name, part in PARTS.items()}
        options = {key: part.of_flags(flags) for key, part in OPTIONS.items()}
        return super().of_flags(flags, **parts, options=options, **others)


def sections() -> list[tuple[str, type[Options]]]:
    """The parts in the command line's order, each with its title: its docstring's first line."""
    parts = (*PARTS.values(), *OPTIONS.values())
    return [("The run", TrainConfig)] + [(part.__doc__.split("\n")[0].rstrip("."), part) for part in parts]


def parser() -> argparse.ArgumentParser:
    """The command line, generated from the parts' fields: one argument group per part."""
    result = argparse.ArgumentParser(description=DESCRIPTION)
    for title, part in sections():
        part.add_flags(result, title)
    return result


def flag_table() -> str:
    """Every flag as a markdown table (docs/training.md's), generated from the fields."""
    lines = ["| flag | default | what |", "|---|---|---|"]
    for title, part in sections():
        lines.append(f"| **{title}** | | |")
        lines += [f"| `{flag}` | {default} | {what} |" for flag, default, what in part.documented()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> TrainConfig:
    """The run's TrainConfig from its command line; an argument that cannot train exits with status 2
    and the message a TrainConfig built in code raises (``ConfigError.usage``)."""
    command_line = parser()
    flags = command_line.parse_args(argv)
    try:
        return TrainConfig.of_flags(flags)
    except ConfigError as error:
        command_line.error(error.usage)
