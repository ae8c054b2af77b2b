"""Where an iteration's prompts come from: the fixed scene prompts, ``--prompt``'s, or the shapes
task's train prompts drawn per iteration."""

import argparse

import torch

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
