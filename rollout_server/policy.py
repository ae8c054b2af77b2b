"""The policy being served: its version, its LoRA adapter, and weight updates applied on every rank.

An update is checked against the current weights without touching them (``check``, safe from any
thread while rollouts run), then applied between rollouts by the engine's worker (the scheduler
makes an update a barrier). A single-rank server whose update fails while applying restores the
previous weights and keeps serving. Under sequence parallelism every rank applies the update and
the ranks then learn whether all of them did; ranks serving different weights would be worse than
no server, so any failure there is a ``RankFailure`` that takes the server down.
"""

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_server.errors import RankFailure
from rollout_server.weights import ranks, spec
from rollout_server.weights.apply import apply_update

if TYPE_CHECKING:
    from rollout_server.parallel import SequenceParallel
    from rollout_server.weights.update import WeightUpdate

log = logging.getLogger("rollout_server.policy")


class Policy:
    """The transformers' weights as served (one, or Wan 2.2's two experts, by pipeline component
    name): version 0 as loaded, then that of each applied update, whichever transformer it changed."""

    def __init__(self, experts: dict[str, torch.nn.Module], parallel: "SequenceParallel"):
        self.experts = experts
        self.parallel = parallel
        self.version = 0
        self.lora_adapters: dict[str, rollout_pb2.LoraAdapter] = {}
        self.specs = {
            name: spec.TransformerSpec.of(module, parallel.enabled) for name, module in experts.items()
        }

    @property
    def spec(self) -> spec.TransformerSpec:
        """The (first) transformer's: its size bounds an update's."""
        return self.specs["transformer"]

    @property
    def lora_adapter(self) -> rollout_pb2.LoraAdapter | None:
        return self.lora_adapters.get("transformer")

    def check(self, update: "WeightUpdate") -> None:
        """StaleUpdate or InvalidRequest unless ``update`` applies to the current weights. It changes
        nothing and reads no live tensor, so any thread may call it while rollouts run."""
        spec.check_target(update.target, self.experts)
        spec.check_version(update.policy_version, self.version)
        spec.check(self.specs[update.target], update)

    def apply(self, update: "WeightUpdate") -> None:
        """Rank 0: check ``update`` again (another update may have gone first), send it to the other
        ranks, and apply it on every rank."""
        self.check(update)
        if self.parallel.enabled:
            ranks.send(self.parallel, update)
        self._apply_on_every_rank(lambda: update)

    def follow(self, payload: bytes) -> None:
        """A non-leader rank: receive the update whose header rank 0 broadcast, and apply it."""
        update = ranks.receive(self.parallel, payload)

        def checked() -> "WeightUpdate":
            self.check(update)
            return update

        self._apply_on_every_rank(checked)

    def _apply_here(self, update: "WeightUpdate") -> None:
        started_at = time.perf_counter()
        # If this fails, the previous weights are back in place (apply_update restores them).
        target = update.target
        adapter = apply_update(self.experts[target], update, self.lora_adapters.get(target))
        self.lora_adapters.pop(target, None)
        if adapter is not None:
            self.lora_adapters[target] = adapter
        self.version = update.policy_version
        log.info("applied %s in %.3f s", update.describe(), time.perf_counter() - started_at)

    def _apply_on_every_rank(self, get_update: Callable[[], "WeightUpdate"]) -> None:
        """Apply the update here, then learn whether every rank did (see the module docstring)."""
        if not self.parallel.enabled:
            self._apply_here(get_update())
            return
        failure = None
        try:
            self._apply_here(get_update())
        except Exception as error:
            failure = error
        if not self.parallel.all_succeeded(failure is None):
            if failure is not None:
                raise RankFailure(
                    f"rank {self.parallel.rank} cannot apply the weight update: "
                    f"{type(failure).__name__}: {failure}"
                ) from failure
            raise RankFailure(
                f"another rank could not apply the weight update; {self.parallel.describe_failure()}"
            )
