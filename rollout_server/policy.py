"""The policy being served: its version, its LoRA adapter, its checksum, and weight updates applied
on every rank.

An update is checked against the current weights without touching them (``check``, safe from any
thread while rollouts run), then applied between rollouts by the engine's worker (the scheduler
makes an update a barrier). A single-rank server whose update fails while applying restores the
previous weights and keeps serving. Under sequence parallelism every rank applies the update and
the ranks then learn whether all of them did, and whether they all serve the same checksum; ranks
serving different weights would be worse than no server, so any failure there is a ``RankFailure``
that takes the server down.

An update arrives on rank 0 over gRPC (the other ranks get it from rank 0, ``weights.ranks``) or, from
a weight-sync group, on every rank at once (``rollout_server.weight_sync`` receives it, and joins and
leaves the group).
"""

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from peft import get_peft_model_state_dict

from rollout.v1 import rollout_pb2
from rollout_core import checksum
from rollout_server.errors import RankFailure
from rollout_server.weights import ranks, spec
from rollout_server.weights.apply import apply_update, peft_name
from rollout_server.weights.update import FULL, LORA

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
        self.device = next(experts["transformer"].parameters()).device
        # The checksum's line of every served tensor, by its name in the checksum (rollout_core.checksum).
        self._lines: dict[str, str] = {}
        for target in experts:
            self._digest(target, None)
        self._combine()
        self.rank_checksums = [self.checksum]  # as every rank computed it after the last update

    @property
    def spec(self) -> spec.TransformerSpec:
        """The (first) transformer's: its size bounds an update's."""
        return self.specs["transformer"]

    @property
    def lora_adapter(self) -> rollout_pb2.LoraAdapter | None:
        return self.lora_adapters.get("transformer")

    def check(self, update: "WeightUpdate", prefix: str = "") -> None:
        """StaleUpdate or InvalidRequest unless ``update`` applies to the current weights. It changes
        nothing and reads no live tensor, so any thread may call it while rollouts run. ``prefix``
        leads the names of the fields it blames (a group update's are inside its manifest)."""
        header = f"{prefix}header"
        spec.check_target(update.target, self.experts, f"{header}.target")
        spec.check_version(update.policy_version, self.version, f"{header}.policy_version")
        spec.check(self.specs[update.target], update, header, f"{prefix}tensors" if prefix else "data")

    def expected_tensors(self, update: "WeightUpdate") -> int:
        """How many tensors an update of this kind may hold: the target's, or its adapter layout's."""
        target_spec = self.specs[update.target]
        if update.kind == LORA:
            return len(spec.lora_layout(target_spec, update.lora_config_json))
        return len(target_spec.tensors)

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

    def apply_received(self, update: "WeightUpdate", lines: dict[str, str]) -> None:
        """Every rank: apply an update every rank received alike (over a weight-sync group, checked by
        rank 0); ``lines``: the checksum lines taken from its tensors as they arrived."""
        self._apply_on_every_rank(lambda: update, lines)

    def _apply_here(self, update: "WeightUpdate", lines: dict[str, str]) -> None:
        started_at = time.perf_counter()
        # If this fails, the previous weights are back in place (apply_update restores them).
        target = update.target
        adapter = apply_update(self.experts[target], update, self.lora_adapters.get(target))
        self.lora_adapters.pop(target, None)
        if adapter is not None:
            self.lora_adapters[target] = adapter
        self.version = update.policy_version
        changed = {FULL: None, LORA: []}.get(update.kind, list(update.tensors))  # SUBSET: its own
        self._digest(target, changed, lines)
        self._combine()
        log.info("applied %s in %.3f s", update.describe(), time.perf_counter() - started_at)

    def _combine(self) -> None:
        """The served checksum from the lines, and each transformer's own (its lines alone)."""
        self.checksum = checksum.combine(self._lines)
        self.transformer_checksums = {
            target: checksum.combine(
                {n: line for n, line in self._lines.items() if n.startswith(f"{target}/")}
            )
            for target in self.experts
        }

    def served_tensors(self, target: str) -> dict[str, torch.Tensor]:
        """``target``'s tensors as served: its base tensors under their checkpoint names, and its LoRA
        adapter's, if one is loaded, under PEFT's names (``<module>.lora_A.weight``)."""
        return {**checksum.base_tensors(self.experts[target]), **self._adapter_tensors(target)}

    def _adapter_tensors(self, target: str) -> dict[str, torch.Tensor]:
        adapter = self.lora_adapters.get(target)
        if adapter is None:
            return {}
        return get_peft_model_state_dict(self.experts[target], adapter_name=peft_name(adapter.policy_version))

    def _digest(self, target: str, names, known: dict[str, str] | None = None) -> None:
        """Recompute the checksum lines of ``target``'s base tensors ``names`` (None: all of them) and
        of its adapter, from the tensors served, where they are (on an accelerator, there); ``known``
        lines were taken from the served tensors as they arrived."""
        known = known or {}
        live = checksum.base_tensors(self.experts[target])
        names = live if names is None else names
        changed = {f"{target}/{n}": live[n] for n in names if f"{target}/{n}" not in known}
        self._lines.update(known)
        for name in [name for name in self._lines if name.startswith(f"{target}/lora/")]:
            del self._lines[name]
        changed.update({f"{target}/lora/{name}": t for name, t in self._adapter_tensors(target).items()})
        self._lines.update(checksum.digest_lines(changed))

    def _apply_on_every_rank(
        self, get_update: Callable[[], "WeightUpdate"], lines: dict[str, str] | None = None
    ) -> None:
        """Apply the update here, then learn whether every rank did and serves the same checksum (see
        the module docstring)."""
        if not self.parallel.enabled:
            self._apply_here(get_update(), lines or {})
            self.rank_checksums = [self.checksum]
            return
        failure = None
        try:
            self._apply_here(get_update(), lines or {})
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
        self.rank_checksums = self.parallel.gather_text(self.checksum)
        if len(set(self.rank_checksums)) > 1:
            raise RankFailure(f"the ranks serve different weights after the update: {self.rank_checksums}")
