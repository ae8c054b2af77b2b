"""The engine as every front end calls it, whatever its wire: rollouts (open a resolved one, prune it),
the policy served (status, weight updates one at a time, the weights' memory) and the shutdown.

Awaitable methods run on the event loop; the engine's own work runs on its worker thread.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from rollout.v1 import rollout_pb2
from rollout_server.admission import Refused, failure
from rollout_server.errors import InvalidRequest, MemoryReleased
from rollout_server.weights import files

if TYPE_CHECKING:
    from rollout_server.engine import Engine, EngineStatus, EventsFactory, Outbox
    from rollout_server.images import ConditionImage
    from rollout_server.memory import SampleSizes
    from rollout_server.metrics import ServerMetrics
    from rollout_server.weights.update import WeightUpdate

log = logging.getLogger("rollout_server.engine_client")


class EngineClient:
    """One engine's front-end API. ``weights_root``: where LoadWeights reads (None disables it);
    ``max_update_bytes``: the largest weight update taken."""

    def __init__(
        self, engine: "Engine", metrics: "ServerMetrics", weights_root: Path | None, max_update_bytes: int
    ):
        self.engine = engine
        self.metrics = metrics
        self.weights_root = weights_root
        self.max_update_bytes = max_update_bytes
        self.transformers = engine.transformers  # the pipeline components an update may target
        # One weight update (UpdateWeights or LoadWeights) at a time: each may hold a model's worth
        # of memory until it is applied.
        self._update_in_progress = False
        self.shutting_down = False
        # Set, and replaced by a fresh one, whenever a weight update job ends (see wait_for_policy).
        self._policy_changed = asyncio.Event()

    def status(self) -> "EngineStatus":
        return self.engine.status()

    def module_names(self, target: str) -> list[str]:
        return self.engine.module_names(target)

    def sample_sizes(self, resolved: rollout_pb2.RolloutRequest) -> "SampleSizes":
        return self.engine.sample_sizes(resolved)

    def check_fits(self, resolved: rollout_pb2.RolloutRequest) -> None:
        self.engine.check_fits(resolved)

    def open(
        self,
        resolved: rollout_pb2.RolloutRequest,
        condition_images: "list[ConditionImage]",
        events: "EventsFactory | None" = None,
    ) -> "Outbox":
        """Queue a resolved rollout: its stream (``Engine.open_stream``)."""
        return self.engine.open_stream(resolved, condition_images, events)

    def prune(self, request_id: str, control_token: str, nodes: list[int]) -> Future:
        return self.engine.prune(request_id, control_token, nodes)

    def refuse_when_shutting_down(self) -> None:
        if self.shutting_down:
            self.metrics.reject("shutting_down")
            raise Refused(grpc.StatusCode.UNAVAILABLE, "server is shutting down")

    def begin_shutdown(self) -> None:
        """Refuse new calls from now on, and end the ones waiting for a policy version."""
        self.shutting_down = True
        self.policy_advanced()

    async def close(self) -> None:
        """Stop the engine (off the event loop, which must keep running meanwhile)."""
        await asyncio.to_thread(self.engine.close)

    def policy_advanced(self) -> None:
        """A weight update job ended: wake the requests waiting for a policy version."""
        self._policy_changed.set()
        self._policy_changed = asyncio.Event()

    async def wait_for_policy(self, version: int) -> None:
        """Return once the engine runs policy ``version`` or later; Refused at shutdown."""
        while True:
            changed = self._policy_changed  # taken before the check, so no update is missed
            if self.status().policy_version >= version:
                return
            if self.shutting_down:
                raise Refused(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            await changed.wait()

    @contextlib.asynccontextmanager
    async def update_slot(self) -> AsyncIterator[None]:
        """Hold the one weight-update slot for the body (released however it ends, the caller's
        cancel included); Refused (RESOURCE_EXHAUSTED) at once while another update holds it."""
        if self._update_in_progress:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "another weight update is in progress (or a release or resume of the weights' "
                "memory); the server takes one at a time, retry after it",
            )
        self._update_in_progress = True
        try:
            yield
        finally:
            self._update_in_progress = False

    async def update_weights(self, receive: Callable[[], Awaitable["WeightUpdate"]]) -> dict:
        """A weight update, whatever its transport: ``receive()`` is awaited once the update slot is
        held (so one update's bytes are held at a time), and what it returns is checked and applied.
        The answer's fields, or Refused (shutting down, another update running), or the update's
        failure (see ``update_failed``)."""
        started_at = time.perf_counter()
        self.refuse_when_shutting_down()
        async with self.update_slot():
            update = await receive()
            await self._apply(update)
        return self.applied(update, started_at)

    async def load_weights(self, request: rollout_pb2.LoadWeightsRequest) -> dict:
        """LoadWeights without its transport: the answer's fields, or Refused (shutting down, disabled,
        another update running), or the update's failure (see ``update_failed``)."""
        self.refuse_when_shutting_down()
        if self.weights_root is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "LoadWeights is disabled: the server was started without --weights-root",
            )
        return await self.update_weights(
            lambda: asyncio.to_thread(
                files.read_update,
                self.weights_root,
                request,
                self.status().policy_version,
                self.max_update_bytes,
                self.transformers,
            )
        )

    async def tensor_sha256(self, target: str, names: Iterable[str]) -> tuple[int, dict[str, str]]:
        """(the policy version, SGLang's SHA-256 of each of ``names`` that ``target`` serves:
        ``Engine.tensor_sha256``), computed on a thread while the update slot is held, so that no
        update changes the tensors it reads (Refused while one runs, while the weights are released, or
        at shutdown)."""
        self.refuse_when_shutting_down()
        async with self.update_slot():
            try:
                digests = await asyncio.to_thread(self.engine.tensor_sha256, target, names)
            except MemoryReleased as error:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None
            return self.status().policy_version, digests

    async def change_memory(self, release: bool) -> rollout_pb2.MemoryResidency:
        """ReleaseMemory (``release``) or ResumeMemory without its transport: what it did, or Refused
        (shutting down, another weight change running), or its failure. Once queued, the change goes
        through even if its caller leaves: rollouts stay refused until a resume."""
        started_at = time.perf_counter()
        self.refuse_when_shutting_down()
        change = self.engine.release_memory if release else self.engine.resume_memory
        async with self.update_slot():
            work = asyncio.wrap_future(change())
            work.add_done_callback(lambda done: done.cancelled() or done.exception())  # read, if left
            moved = await asyncio.shield(work)
        seconds = time.perf_counter() - started_at
        status = self.status()
        what = ("released" if moved.released else "resumed") if moved.changed else "unchanged"
        log.info("weights' memory %s: %d bytes in %.3f s", what, moved.bytes, seconds)
        return rollout_pb2.MemoryResidency(
            released=moved.released,
            changed=moved.changed,
            bytes=moved.bytes,
            seconds=seconds,
            policy_version=status.policy_version,
            weights_checksum=status.weights_checksum,
        )

    async def _apply(self, update: "WeightUpdate") -> None:
        """Check ``update`` (off the event loop: a LoRA check builds an empty model), then queue it
        behind the rollouts already queued and wait until it is applied."""
        await asyncio.to_thread(self.engine.check_update, update)
        work = self.engine.update_weights(update)
        self.wake_on_end(work)
        await asyncio.wrap_future(work)

    def wake_on_end(self, work: Future) -> None:
        """Wake the rollouts waiting for a policy version when ``work`` (a weight update job) ends,
        even when its caller has gone away before."""
        loop = asyncio.get_running_loop()
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self.policy_advanced))

    def applied(self, update: "WeightUpdate", started_at: float) -> dict:
        """The fields of an applied update's answer (UpdateWeightsResponse's and LoadWeightsResponse's)."""
        seconds = time.perf_counter() - started_at
        self.metrics.weight_update(update.nbytes, seconds)
        log.info("weights %s: %d bytes in %.3f s, status=OK", update.describe(), update.nbytes, seconds)
        return {
            "policy_version": update.policy_version,
            "tensors": len(update.tensors),
            "bytes": update.nbytes,
            "seconds": seconds,
            "weights_checksum": self.status().weights_checksum,
        }

    def update_failed(self, error: Exception) -> tuple[grpc.StatusCode, str]:
        """The code and message a weight update's failure ends its call with (a rejection is counted)."""
        code, message = failure("weight update", error)
        if isinstance(error, InvalidRequest):
            self.metrics.reject("invalid_argument")
        return code, message
