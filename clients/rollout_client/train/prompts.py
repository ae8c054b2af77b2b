"""Where an iteration's prompts come from: the fixed scene prompts, ``--prompt``'s, or the shapes
task's train prompts drawn per iteration."""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout_client.train.config import TrainConfig

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


def shapes_train_prompts() -> tuple[str, ...]:
    from rollout_core import scenes

    return scenes.train_prompts()


def prompt_pool(size: int) -> tuple[str, ...]:
    """The shapes train prompts an iteration draws from: all (``size`` 0), or the first ``size``."""
    return shapes_train_prompts()[: size or None]


def iteration_prompts(config: "TrainConfig", iteration: int) -> list[str]:
    """--prompt's, the fixed scene prompts, or P distinct shapes train prompts drawn from the
    iteration's seed."""
    if config.rollout.fixed_prompts:
        return list(config.rollout.fixed_prompts)
    if config.rollout.prompt_set == "scenes":
        return PROMPTS[: config.rollout.prompts]
    pool = prompt_pool(config.rollout.prompt_pool)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + iteration)
    return [
        pool[k] for k in torch.randperm(len(pool), generator=generator)[: config.rollout.prompts].tolist()
    ]
