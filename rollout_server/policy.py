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
a weight-sync group, on every rank at once (``weights.group``): a broadcast that fails anywhere
leaves every rank's weights as they were and every rank out of the group. Joining a group is no
barrier: the ranks rendezvous on threads of their own while rollouts run (``start_join``), and
install the group between two rounds (``install_join``).
"""

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from peft import get_peft_model_state_dict

from rollout.v1 import rollout_pb2
from rollout_core import checksum
from rollout_server.errors import RankFailure, WeightSyncFailed
from rollout_server.parallel import (
    SYNC_INSTALL,
    SYNC_JOIN,
    SYNC_LEAVE,
    SYNC_UPDATE,
    PendingJoin,
    WeightSync,
    WeightSyncOptions,
)
from rollout_server.weights import group, ranks, spec
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
        self._pending_join: PendingJoin | None = None  # a weight-sync group being joined

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

    def start_join(self, options: WeightSyncOptions) -> PendingJoin:
        """Rank 0, between two rounds: every rank leaves its weight-sync group (and any join still
        pending) and starts joining the group ``options`` describes, each on a thread of its own, so
        rounds go on while the ranks rendezvous. Returns rank 0's join."""
        self.parallel.broadcast_command(SYNC_JOIN, json.dumps(dataclasses.asdict(options)).encode())
        return self._start_join_here(options)

    def follow_join(self, payload: bytes) -> None:
        self._start_join_here(WeightSyncOptions(**json.loads(payload)))

    def _start_join_here(self, options: WeightSyncOptions) -> PendingJoin:
        self._leave_here()
        self._pending_join = PendingJoin(options, options.rank_offset + self.parallel.rank, self.device)
        return self._pending_join

    def install_join(self, group_id: str) -> None:
        """Rank 0, between two rounds, once its own join ended or its deadline passed: every rank
        installs the group it joined, if all of them joined it; WeightSyncFailed, with no group left,
        otherwise. The ranks join at the same rendezvous, so when rank 0's join ended the others' have
        too (or end within their deadline); when rank 0's failed, they give theirs up at once."""
        pending = self._pending_join
        if pending is None or pending.options.group_id != group_id:
            raise WeightSyncFailed("the join was replaced by a later InitWeightSync or a DestroyWeightSync")
        self._pending_join = None
        try:
            joined, failure = pending.result(), None
        except WeightSyncFailed as error:
            joined, failure = None, error
        self.parallel.broadcast_command(SYNC_INSTALL, json.dumps(failure is None).encode())
        self._install_here(joined, failure)

    def follow_install(self, payload: bytes) -> None:
        # Commands arrive in rank 0's order: this rank's pending join is the one rank 0 installs.
        pending, self._pending_join = self._pending_join, None
        joined, failure = None, WeightSyncFailed("rank 0 of the server could not join the group")
        if pending is None:
            failure = WeightSyncFailed(f"rank {self.parallel.rank} has no join pending")
        elif json.loads(payload):
            try:
                joined, failure = pending.result(), None
            except WeightSyncFailed as error:
                failure = error
        else:
            pending.abandon()
        self._install_here(joined, failure)

    def _install_here(self, joined: WeightSync | None, failure: WeightSyncFailed | None) -> None:
        if not self.parallel.all_succeeded(failure is None):
            if joined is not None:
                joined.close()
            raise failure or WeightSyncFailed("another rank of the server could not join the group")
        self.parallel.weight_sync = joined

    def leave_sync(self) -> bool:
        """Rank 0: every rank leaves the weight-sync group; whether there was one."""
        self.parallel.broadcast_command(SYNC_LEAVE)
        return self._leave_here()

    def follow_leave(self, payload: bytes) -> None:
        self._leave_here()

    def _leave_here(self) -> bool:
        """Leave the group joined, and give up a join still pending; whether there was a group."""
        if self._pending_join is not None:
            self._pending_join.abandon()
            self._pending_join = None
        sync, self.parallel.weight_sync = self.parallel.weight_sync, None
        if sync is not None:
            sync.close()
        return sync is not None

    def apply_from_group(self, manifest: group.GroupManifest) -> float:
        """Rank 0, at the update's barrier, once the trainer started: every rank receives the
        broadcasts and applies them. Returns the seconds the broadcasts took."""
        self.parallel.broadcast_command(SYNC_UPDATE, manifest.message.SerializeToString())
        return self._receive_on_every_rank(manifest)

    def follow_update(self, payload: bytes) -> None:
        message = rollout_pb2.GroupUpdateManifest.FromString(payload)
        self._receive_on_every_rank(group.parse_manifest(message, self.spec.max_update_bytes))

    def _receive_on_every_rank(self, manifest: group.GroupManifest) -> float:
        started_at = time.perf_counter()
        received, failure = None, None
        try:
            served_as_received = self.parallel.weight_sync.device == self.device
            received = group.receive(self.parallel.weight_sync, manifest, served_as_received)
        except Exception as error:  # noqa: BLE001 - leaving the group below ends the trainer's broadcast
            failure = error
        if not self.parallel.all_succeeded(failure is None):
            self._leave_here()  # the group's state is unknown after a failed collective
            raise failure or WeightSyncFailed("the broadcast failed on another rank of the server")
        seconds = time.perf_counter() - started_at
        if received.non_finite is not None:  # alike on every rank: the same bytes arrived
            raise received.non_finite
        self._apply_on_every_rank(lambda: received.update, received.lines)
        return seconds

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
