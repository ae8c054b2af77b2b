"""The interface every training algorithm implements, and the registry that names them.

An iteration of ``Trainer.train_step`` runs, for its algorithm:

1. ``start()``: a fresh update for the iteration's rollout;
2. ``on_step(rollout, step)`` as each step arrives (score it early, prune a tree);
3. ``update(rollout, rewards, iteration)``: advantages, losses and backward passes, each optimizer step
   taken through ``trainer.optimizer_step(loss)`` with that step's loss (which averages the gradients
   over the data-parallel ranks, stops the run on a non-finite loss or gradient, and clips them to
   ``max_grad_norm``, the same for every algorithm); returns the mean loss;
4. ``metrics(rollout)``: the algorithm's columns of the iteration's metrics row.

Every push of the policy the server rolls out with happens inside ``rollout_weights()`` (DiffusionNFT's
old policy swaps itself in there), and ``state()`` is checkpointed with the run.

``latents`` is what its requests ask the server to stream, ``preview_steps(config)`` the steps whose
previews (decoded x0_hat) they ask for, ``refusal(config, world)`` the configs it cannot train with
(``TrainConfig`` refuses them), and ``columns()`` the metrics columns it adds to ``metrics.COLUMNS``.
Register a new algorithm with ``@register("name")`` in a module of this package imported by its
``__init__``; ``--algorithm name`` then selects it. ``@register("name", options=SomeConfig)`` also
registers the algorithm's options (an ``Options`` dataclass, with its flags): every ``TrainConfig``
holds them as ``config.<SomeConfig.KEY>``.
"""

import contextlib
import math
from typing import TYPE_CHECKING, ClassVar

import torch

from rollout.v1 import rollout_pb2

if TYPE_CHECKING:
    from rollout_client import Step
    from rollout_client.train.config import TrainConfig
    from rollout_client.train.options import Options
    from rollout_client.train.rollouts import Rollout
    from rollout_client.train.trainer import Trainer

ALGORITHMS: dict[str, type["Algorithm"]] = {}
# The algorithms' options, by the name a TrainConfig holds them under (their KEY), in registration order.
OPTIONS: dict[str, type["Options"]] = {}


def register(name: str, options: type["Options"] | None = None):
    """Class decorator: the algorithm ``--algorithm name`` selects, with its ``options``."""

    def add(cls: type["Algorithm"]) -> type["Algorithm"]:
        cls.name = name
        ALGORITHMS[name] = cls
        if options is not None:
            OPTIONS[options.KEY] = options
        return cls

    return add


class Algorithm:
    name: ClassVar[str]
    latents: ClassVar[int] = rollout_pb2.LATENT_SELECTION_AROUND_STOCHASTIC
    max_grad_norm: ClassVar[float | None] = None  # None: the gradients are not clipped

    @classmethod
    def refusal(cls, config: "TrainConfig", world: int) -> str | None:
        """Why the algorithm cannot train with ``config`` on ``world`` trainer ranks (the config's
        error), or None."""
        return None

    @classmethod
    def preview_steps(cls, config: "TrainConfig") -> list[int]:
        """The steps whose previews its rollouts need (``RolloutRequest.preview_steps``), beside
        --prune-at's."""
        return []

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer
        self.config = trainer.config

    @property
    def own_rollout_policy(self) -> bool:
        """Whether ``rollout_weights()`` applies other weights than the trained ones."""
        return False

    def rollout_weights(self) -> contextlib.AbstractContextManager:
        """The weights the server rolls out with, applied for the block that pushes them: by default the
        trained ones themselves."""
        return contextlib.nullcontext()

    def state(self) -> dict:
        """What a checkpoint must keep of the algorithm beside the trained weights (an old policy)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore ``state()`` from a checkpoint."""

    def start(self) -> None:
        """A new iteration's rollout is about to stream."""

    def on_step(self, rollout: "Rollout", step: "Step") -> None:
        """Step ``step`` of the iteration's rollout has arrived."""

    def update(self, rollout: "Rollout", rewards: torch.Tensor, iteration: int) -> float:
        raise NotImplementedError

    @property
    def ratio_max_dev(self) -> float:
        """The largest |exp(logp_new - logp_old) - 1| of the update (NaN where no step is scored)."""
        return math.nan

    def columns(self) -> list[str]:
        """The metrics columns its rows add to ``metrics.COLUMNS`` (the run's, the same every row)."""
        return []

    def metrics(self, rollout: "Rollout") -> dict:
        """The algorithm's columns of the metrics row: ``kl``, ``scored_steps``, ``pruned_leaves``,
        ``policy_grad_norm`` and ``anchor_grad_norm``."""
        return {
            "kl": math.nan,
            "scored_steps": "",
            "pruned_leaves": 0,
            "policy_grad_norm": math.nan,
            "anchor_grad_norm": math.nan,
        }
