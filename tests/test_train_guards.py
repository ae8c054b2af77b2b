"""A trainer's config refuses every value no run can train with: from the command line with exit status
2 and a message naming the flag, and when built in code (``TrainConfig`` and its parts check themselves
on construction) with a ``ConfigError`` naming the field and its flag."""

import dataclasses
import math

import pytest

from rollout_client.train.config import ConfigError, parse_args, parse_flags

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
        parse_flags([*NEEDS.get(flag, []), flag, str(value)])
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
    with pytest.raises(ConfigError, match=r"^OptimConfig.clip_range must be a number, got None$"):
        dataclasses.replace(config.optim, clip_range=None)
