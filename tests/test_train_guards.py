"""A trainer's config refuses every value no run can train with: from the command line with exit status
2 and a message naming the flag, and when built in code (``TrainConfig`` and its parts check themselves
on construction) with a ``ConfigError`` naming the field and its flag."""

import dataclasses
import math
import re

import pytest
from support.servers import ROOT

from rollout_client.train.algorithms.awm import AWMConfig
from rollout_client.train.algorithms.nft import NFTConfig
from rollout_client.train.algorithms.tree_options import TreeConfig
from rollout_client.train.config import (
    ConfigError,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    flag_table,
    parse_args,
    parser,
)
from rollout_client.train.policy import load_policy
from rollout_client.train.rollouts import ServerFailure

JPEG = "rollout_client.rewards:jpeg_compressibility"

# (flag, value, the TrainConfig part holding its field ("" for the run's own), field, what it must be).
# Each was accepted by the command line before it checked these values.
NEWLY_REFUSED = [
    ("--lr", math.nan, "optim", "lr", "must be finite and above 0"),
    ("--lr", math.inf, "optim", "lr", "must be finite and above 0"),
    ("--lr", 0.0, "optim", "lr", "must be finite and above 0"),
    ("--lr", -0.01, "optim", "lr", "must be finite and above 0"),
    ("--clip-range", math.nan, "optim", "clip_range", "must be finite and above 0"),
    ("--clip-range", math.inf, "optim", "clip_range", "must be finite and above 0"),
    ("--clip-range", 0.0, "optim", "clip_range", "must be finite and above 0"),
    ("--kl-beta", math.nan, "optim", "kl_beta", "must be finite and at least 0"),
    ("--kl-beta", math.inf, "optim", "kl_beta", "must be finite and at least 0"),
    ("--kl-beta", -1.0, "optim", "kl_beta", "must be finite and at least 0"),
    ("--lora-alpha", 0.0, "optim", "lora_alpha", "must be finite and above 0 (the LoRA's output scale"),
    ("--lora-alpha", math.nan, "optim", "lora_alpha", "must be finite and above 0"),
    ("--lora-alpha", math.inf, "optim", "lora_alpha", "must be finite and above 0"),
    ("--lora-rank", 0, "optim", "lora_rank", "must be at least 1"),
    ("--threads", 0, "", "threads", "must be at least 1"),
    ("--seed", -1, "", "seed", "must be in [0, 2^32)"),
    ("--seed", 2**32, "", "seed", "must be in [0, 2^32)"),
    ("--eval-seed", -1, "eval", "seed", "must be in [0, 2^32)"),
    ("--reward", f"{JPEG}*nan", "", "reward", f"the weight of {JPEG} must be finite, got nan"),
    ("--reward", f"{JPEG},{JPEG}*inf", "", "reward", f"the weight of {JPEG} must be finite, got inf"),
    ("--steps", 0, "rollout", "steps", "must be at least 1"),
    ("--size", 0, "rollout", "size", "must be at least 1"),
    ("--noise-level", math.inf, "rollout", "noise_level", "must be finite and above 0"),
    ("--cfg", math.inf, "rollout", "cfg", "must be finite and at least 1"),
    ("--tree", "1:2:nan", "tree", "points", "'1:2:nan': its noise level must be finite and above 0"),
    ("--nft-beta", math.inf, "nft", "beta", "must be finite and above 0"),
    ("--awm-power", math.inf, "awm", "power", "must be finite and above 0"),
    ("--stall-timeout", math.inf, "server", "stall_timeout", "must be finite and above 0"),
]

# The flags a flag needs beside it, or the command line refuses it for that first.
NEEDS = {"--awm-power": ["--algorithm", "awm"]}

# The same rules, which the command line already applied: a config built in code now applies them too.
ALREADY_REFUSED_ON_THE_COMMAND_LINE = [
    ("--iterations", 0, "", "iterations", "must be at least 1"),
    ("--time-budget", math.nan, "", "time_budget", "must be finite and at least 0"),
    ("--ema-decay", 1.0, "", "ema_decay", "must be in [0, 1)"),
    ("--prompts", 0, "rollout", "prompts", "must be at least 1"),
    ("--prompt-pool", -1, "rollout", "prompt_pool", "must be at least 0"),
    ("--group-size", 0, "rollout", "group_size", "must be at least 1"),
    ("--noise-level", math.nan, "rollout", "noise_level", "must be finite and above 0"),
    ("--window", -1, "rollout", "window", "must be at least 0"),
    ("--cfg", math.nan, "rollout", "cfg", "must be finite and at least 1"),
    ("--prune-at", -1, "tree", "prune_at", "must be at least 0"),
    ("--prune-keep", 1, "tree", "prune_keep", "must be at least 2"),
    ("--micro-batch", 0, "optim", "micro_batch", "must be at least 1"),
    ("--nft-beta", 0.0, "nft", "beta", "must be finite and above 0"),
    ("--nft-draws", 0, "nft", "draws", "must be at least 1"),
    ("--nft-anchor", math.nan, "nft", "anchor", "must be finite and at least 0"),
    ("--nft-old-decay", 1.0, "nft", "old_decay", "must be in [0, 1)"),
    ("--nft-old-ramp", -1, "nft", "old_ramp", "must be at least 0"),
    ("--nft-min-level", math.nan, "nft", "min_level", "must be in [0, 1)"),
    ("--awm-power", 0.0, "awm", "power", "must be finite and above 0"),
    ("--awm-kl", math.inf, "awm", "kl", "must be finite and at least 0"),
    ("--stall-timeout", 0.0, "server", "stall_timeout", "must be finite and above 0"),
    ("--retries", -1, "server", "retries", "must be at least 0"),
    ("--checkpoint-every", 0, "checkpoint", "every", "must be at least 1"),
    ("--eval-every", -1, "eval", "every", "must be at least 0"),
    ("--eval-samples", 0, "eval", "samples", "must be at least 1"),
]


def case_id(case) -> str:
    flag, value = case[:2]
    return f"{flag}={value}"


@pytest.mark.parametrize("case", NEWLY_REFUSED, ids=case_id)
def test_the_command_line_refuses_a_value_that_cannot_train_naming_its_flag(case, capsys):
    flag, value, _, _, must = case
    with pytest.raises(SystemExit) as refused:
        parse_args([*NEEDS.get(flag, []), flag, str(value)])
    assert refused.value.code == 2
    assert f"error: argument {flag}: {must}" in capsys.readouterr().err


@pytest.mark.parametrize("case", NEWLY_REFUSED + ALREADY_REFUSED_ON_THE_COMMAND_LINE, ids=case_id)
def test_a_config_built_in_code_refuses_a_value_that_cannot_train_naming_its_field(case):
    flag, value, part_name, field, must = case
    config = parse_args([])
    part = getattr(config, part_name) if part_name else config
    with pytest.raises(ConfigError) as refused:
        dataclasses.replace(part, **{field: value})
    assert str(refused.value).startswith(f"{type(part).__name__}.{field} {must}")
    assert refused.value.flag == flag


def test_a_config_built_in_code_refuses_a_value_of_the_wrong_kind():
    """An integer field takes integers only: 2.5 iterations is no count, True no number."""
    config = parse_args([])
    with pytest.raises(ConfigError, match=r"^TrainConfig.iterations must be an integer, got 2.5$"):
        dataclasses.replace(config, iterations=2.5)
    with pytest.raises(ConfigError, match=r"^OptimConfig.lr must be a number, got True$"):
        dataclasses.replace(config.optim, lr=True)
    # None is a value only where the field's type has it.
    assert dataclasses.replace(config.rollout, cfg=None).cfg is None
    with pytest.raises(ConfigError, match=r"^OptimConfig.lora_rank must be an integer, got None$"):
        dataclasses.replace(config.optim, lora_rank=None)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--noise-level", "0", "must be finite and above 0 (at 0 the sampler is deterministic"),
        ("--noise-level", "nan", "must be finite and above 0"),
        ("--iterations", "0", "must be at least 1, got 0"),
        ("--group-size", "1", "must be at least 2 (advantages are standardised within a prompt's group"),
    ],
)
def test_arguments_that_cannot_train_are_refused(capsys, flag, value, message):
    with pytest.raises(SystemExit) as refused:
        parse_args([flag, value])
    assert refused.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tree", "1:2", "--window", "2"], "--window does not go with --tree"),
        (["--tree", "1:2", "--algorithm", "nft"], "--tree trains edges with FlowGRPO's loss"),
        (["--tree", "1:2", "--algorithm", "awm"], "it does not go with --algorithm awm"),
        (["--tree", "9:2", "--steps", "6"], "--tree: every branch step must be in [0, --steps)"),
        (["--tree", "1-2"], "--tree: not step:factor[:noise_level]: '1-2'"),
        (["--tree", "1:1", "--group-size", "1"], "argument --group-size: must be at least 2"),
        (["--tree", "1:0"], "--tree: every branch step must be in [0, --steps), every factor at least 1"),
        (["--prune-at", "1"], "--prune-at prunes a tree: it needs --tree"),
        (["--tree", "1:1", "--prune-at", "1"], "--prune-at prunes a tree: it needs --tree, with a factor"),
        (["--tree", "1:2", "--prune-at", "1", "--async"], "--prune-at prunes as the rollout streams"),
        (["--tree", "2:2", "--prune-at", "1"], "--prune-at 1 is before --tree's first fork at step 2"),
        (["--tree", "1:2", "--prune-at", "5", "--steps", "6"], "--prune-at must be below --steps - 1 (5)"),
        (["--tree", "1:2", "--prune-at", "1", "--prune-keep", "1000"], "--prune-keep 1000 prunes nothing"),
        (["--tree", "1:2", "--prune-keep", "4"], "--prune-keep is what --prune-at keeps: it needs"),
        (["--tree-advantages", "backed-up"], "--tree-advantages scores the nodes of a tree: it needs --tree"),
        (
            ["--algorithm", "step-grpo"],
            "--algorithm step-grpo compares the siblings of a fork: it needs --tree",
        ),
        (["--algorithm", "step-grpo", "--tree", "1:1"], "step-grpo compares the siblings of a fork"),
        (["--algorithm", "step-grpo", "--tree", "1:2", "--window", "2"], "--window does not go with --tree"),
        (
            ["--algorithm", "step-grpo", "--tree", "1:2", "--tree-advantages", "backed-up"],
            "--tree-advantages is --tree's rule: --algorithm step-grpo standardises",
        ),
        (
            ["--algorithm", "step-grpo", "--tree", "1:2", "--prune-at", "1"],
            "--prune-at does not go with --algorithm step-grpo",
        ),
    ],
)
def test_tree_flags_that_cannot_train_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit) as refused:
        parse_args(flags)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--grpo-guard", "--async"],
            "--grpo-guard takes the rollout policy's step means from the trainer's",
        ),
        (
            ["--algorithm", "nft", "--nft-anchor", "-1"],
            "argument --nft-anchor: must be finite and at least 0",
        ),
        (["--time-budget", "inf"], "argument --time-budget: must be finite and at least 0"),
        (["--ema-decay", "1"], "argument --ema-decay: must be in [0, 1)"),
        (["--algorithm", "nft", "--nft-old-decay", "-0.1"], "argument --nft-old-decay: must be in [0, 1)"),
        (["--algorithm", "awm", "--nft-min-level", "1"], "argument --nft-min-level: must be in [0, 1)"),
        (["--ema-decay", "0.9", "--async"], "--ema-decay's evals push the EMA between rollouts"),
        (["--async", "--colocate"], "--colocate releases the server's memory while the policy trains"),
        (["--algorithm", "awm", "--awm-kl", "1"], "--awm-kl pulls towards the EMA of the trained weights"),
        (["--nft-old-decay", "0.5"], "--nft-old-decay is for --algorithm nft"),
        (["--algorithm", "nft", "--awm-power", "1"], "--awm-power is for --algorithm awm"),
        (["--nft-min-level", "0.5"], "--nft-min-level is for --algorithm nft or awm"),
        (["--algorithm", "awm", "--window", "2"], "--window is for FlowGRPO: --algorithm awm scores no step"),
        (["--tree-sde", "forks"], "--tree-sde picks a tree's stochastic steps: it needs --tree"),
        (["--search", "2"], "--search evaluates with step-wise search: it needs --eval-every"),
        (["--search", "1"], "argument --search: must be 0 or at least 2, got 1"),
        (["--search-steps", "2,1"], "argument --search-steps: must be at least 0 and strictly increasing"),
        (
            ["--prompt-set", "shapes", "--eval-every", "1", "--search", "2", "--search-steps", "0,6"],
            "--search-steps must be below --steps (6)",
        ),
        (
            ["--algorithm", "nft", "--nft-anchor", "nan"],
            "argument --nft-anchor: must be finite and at least 0",
        ),
        (
            ["--algorithm", "nft", "--nft-anchor", "1", "--train", "full"],
            "--nft-anchor compares with the base",
        ),
    ],
)
def test_stabiliser_flags_that_cannot_train_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit) as refused:
        parse_args(flags)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


# A bad config built in code, beside the command line that asks for the same: (flags, the config's
# parts as code builds them).
BUILT_IN_CODE = [
    (["--lr", "-0.01"], lambda: TrainConfig(optim=OptimConfig(lr=-0.01))),
    (["--group-size", "1"], lambda: TrainConfig(rollout=RolloutConfig(group_size=1))),
    (
        ["--ema-decay", "0.9", "--async"],
        lambda: TrainConfig(ema_decay=0.9, rollout=RolloutConfig(async_=True)),
    ),
    (
        ["--train", "full", "--kl-beta", "0.1"],
        lambda: TrainConfig(optim=OptimConfig(train="full", kl_beta=0.1)),
    ),
    (
        ["--algorithm", "nft", "--window", "2"],
        lambda: TrainConfig(algorithm="nft", rollout=RolloutConfig(window=2)),
    ),
    (
        ["--prompt", "a fox", "--prompt-pool", "3"],
        lambda: RolloutConfig(fixed_prompts=["a fox"], prompt_pool=3),
    ),
    (["--nft-old-decay", "0.5"], lambda: TrainConfig(options={"nft": NFTConfig(old_decay=0.5)})),
    (
        ["--algorithm", "awm", "--awm-kl", "1"],
        lambda: TrainConfig(algorithm="awm", options={"awm": AWMConfig(kl=1.0)}),
    ),
    (
        ["--tree", "1:2", "--prune-at", "1", "--prune-keep", "1000"],
        lambda: TrainConfig(options={"tree": TreeConfig(points="1:2", prune_at=1, prune_keep=1000)}),
    ),
    (["--tree-sde", "forks"], lambda: TreeConfig(sde="forks")),
    (["--algorithm", "step-grpo"], lambda: TrainConfig(algorithm="step-grpo")),
    (
        ["--algorithm", "step-grpo", "--tree", "1:2", "--tree-advantages", "branch-mean"],
        lambda: TrainConfig(
            algorithm="step-grpo", options={"tree": TreeConfig(points="1:2", advantages="branch-mean")}
        ),
    ),
]


@pytest.mark.parametrize("flags, build", BUILT_IN_CODE, ids=[" ".join(flags) for flags, _ in BUILT_IN_CODE])
def test_a_train_config_built_in_code_is_refused_with_the_command_lines_message(flags, build, capsys):
    """``TrainConfig(...)`` (or the part that holds the fault) runs every rule the command line runs,
    the rules between parts included, and its ``ConfigError.usage`` is the command line's error, word
    for word."""
    with pytest.raises(SystemExit) as refused:
        parse_args(flags)
    assert refused.value.code == 2
    cli = capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(ConfigError) as built:
        build()
    assert cli.split(": error: ", 1)[1] == built.value.usage


def test_a_train_config_built_in_code_takes_the_command_lines_defaults():
    """With no argument, code and command line build the same run; a default that depends on another
    flag resolves alike (--async's clip range)."""
    assert TrainConfig() == parse_args([])
    assert TrainConfig().settings() == parse_args([]).settings()
    async_run = TrainConfig(rollout=RolloutConfig(async_=True))
    assert async_run.clip_range == parse_args(["--async"]).clip_range == 1e-2
    assert TrainConfig().nft == NFTConfig() and TrainConfig().tree.points == ""


def test_the_documented_flags_are_the_generated_flags():
    """docs/training.md's flag table is the one the config's fields generate (``flag_table``), and
    every flag the parser takes is in it."""
    text = (ROOT / "docs" / "training.md").read_text()
    documented = text.split("<!-- flags: generated by flag_table() -->\n", 1)[1].split("\n\n", 1)[0]
    assert documented.strip() == flag_table().strip()
    taken = {option for action in parser()._actions for option in action.option_strings} - {"-h", "--help"}
    assert taken == set(re.findall(r"^\| `(--[a-z-]+)", documented, re.MULTILINE))


def test_the_lora_goes_on_the_servers_default_targets_unless_the_flag_names_its_own(tiny_flux_folder):
    """The trainer holds no table of targets: a server that lists none needs --lora-targets."""
    served = ["to_k", "to_q"]
    _, config = load_policy(tiny_flux_folder, parse_args([]), served)
    assert sorted(config.target_modules) == served
    _, config = load_policy(tiny_flux_folder, parse_args(["--lora-targets", "to_v,proj_out"]), served)
    assert config.target_modules == {"to_v", "proj_out"}
    with pytest.raises(ServerFailure, match="the server names no default LoRA targets: pass --lora-targets"):
        load_policy(tiny_flux_folder, parse_args([]), [])
