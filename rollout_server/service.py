"""The RolloutService servicer: validation, admission, the stream of one rollout, weight updates."""

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_server import weights
from rollout_server.engine import Overloaded, RolloutEngine
from rollout_server.parallel import RankFailure
from rollout_server.sampler import RolloutCancelled
from rollout_server.validation import InvalidRequest, ServingContext, resolve

log = logging.getLogger("rollout_server.service")
# Messages buffered between the worker and the network before the worker waits for the client.
STREAM_BUFFER = 8
_POLL_SECONDS = 0.25
# How a weight update's expected failures reach the caller (InvalidRequest: INVALID_ARGUMENT with
# BadRequest details); anything else is INTERNAL.
UPDATE_FAILURES = (
    (weights.StaleUpdate, grpc.StatusCode.FAILED_PRECONDITION),
    (weights.UploadIdle, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (FileNotFoundError, grpc.StatusCode.NOT_FOUND),
    (RankFailure, grpc.StatusCode.UNAVAILABLE),
)


def bad_request_status(error: InvalidRequest) -> status_pb2.Status:
    details = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
            for field, description in error.violations
        ]
    )
    packed = any_pb2.Any()
    packed.Pack(details)
    return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(error), details=[packed])


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        engine: RolloutEngine,
        serving: ServingContext,
        server_info: rollout_pb2.GetServerInfoResponse,
        weights_root: Path | None = None,
        upload_idle_seconds: float = 30.0,
    ):
        self.engine = engine
        self.serving = serving
        self.server_info = server_info
        self.weights_root = weights_root
        self.upload_idle_seconds = upload_idle_seconds
        # One weight update (UpdateWeights or LoadWeights) at a time: each may hold a model's worth
        # of memory until it is applied.
        self._update_in_progress = False
        self.shutting_down = False
        # Set, and replaced by a fresh one, whenever a weight update job ends (see _wait_for_policy).
        self._policy_changed = asyncio.Event()

    async def GetServerInfo(self, request, context):
        info = rollout_pb2.GetServerInfoResponse()
        info.CopyFrom(self.server_info)
        lora_adapter = self.engine.lora_adapter
        info.policy_version = self.engine.policy_version
        if lora_adapter is not None:
            info.lora_adapter.CopyFrom(lora_adapter)
        return info

    async def UpdateWeights(self, request_iterator, context):
        started_at = time.perf_counter()
        if self.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        max_bytes = self.server_info.limits.max_update_bytes
        async with self._update_slot(context):
            received = weights.receive(
                request_iterator, lambda: self.engine.policy_version, max_bytes, self.upload_idle_seconds
            )
            update = await self._updating(context, received)
            await self._updating(context, self._apply(update))
        return rollout_pb2.UpdateWeightsResponse(**self._applied(update, started_at))

    async def LoadWeights(self, request, context):
        started_at = time.perf_counter()
        if self.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self.weights_root is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "LoadWeights is disabled: the server was started without --weights-root",
            )
        async with self._update_slot(context):
            read = asyncio.to_thread(
                weights.read_update, self.weights_root, request, self.engine.policy_version
            )
            update = await self._updating(context, read)
            await self._updating(context, self._apply(update))
        return rollout_pb2.LoadWeightsResponse(**self._applied(update, started_at))

    @contextlib.asynccontextmanager
    async def _update_slot(self, context) -> AsyncIterator[None]:
        """Hold the one weight-update slot for the body (released however it ends, the caller's
        cancel included); RESOURCE_EXHAUSTED at once while another update holds it."""
        if self._update_in_progress:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "another weight update is in progress; the server takes one at a time, retry after it",
            )
        self._update_in_progress = True
        try:
            yield
        finally:
            self._update_in_progress = False

    async def _apply(self, update: weights.WeightUpdate) -> None:
        """Check ``update`` (off the event loop: a LoRA check builds an empty model), then queue it
        behind the rollouts already queued and wait until it is applied."""
        await asyncio.to_thread(self.engine.check_update, update)
        work = self.engine.submit_update(update)
        loop = asyncio.get_running_loop()
        # Wake waiting rollouts even when this caller has gone away before the job ended.
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self._policy_advanced))
        await asyncio.wrap_future(work)

    def _policy_advanced(self) -> None:
        self._policy_changed.set()
        self._policy_changed = asyncio.Event()

    async def _wait_for_policy(self, version: int) -> None:
        """Return once the engine runs ``version`` or later; the call's deadline cancels the wait."""
        while True:
            changed = self._policy_changed  # taken before the check, so no update is missed
            if self.engine.policy_version >= version:
                return
            await changed.wait()

    @staticmethod
    def _applied(update: weights.WeightUpdate, started_at: float) -> dict:
        """The fields UpdateWeightsResponse and LoadWeightsResponse share."""
        seconds = time.perf_counter() - started_at
        log.info("weights %s: %d bytes in %.3f s, status=OK", update.describe(), update.nbytes, seconds)
        return {
            "policy_version": update.policy_version,
            "tensors": len(update.tensors),
            "bytes": update.nbytes,
            "seconds": seconds,
        }

    async def _updating(self, context, stage: Awaitable):
        """Await one stage of a weight update, turning its failures into the call's status."""
        try:
            return await stage
        except InvalidRequest as error:
            log.info("rejected weight update: %s", error)
            await context.abort_with_status(rpc_status.to_status(bad_request_status(error)))
        except tuple(kind for kind, _ in UPDATE_FAILURES) as error:
            log.info("refused weight update: %s", error)
            code = next(code for kind, code in UPDATE_FAILURES if isinstance(error, kind))
            await context.abort(code, str(error))
        except Exception as error:  # noqa: BLE001 - every unexpected failure becomes INTERNAL
            log.exception("weight update failed")
            await context.abort(
                grpc.StatusCode.INTERNAL, f"weight update failed: {type(error).__name__}: {error}"
            )

    async def Rollout(self, request, context):
        if self.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        try:
            resolved = resolve(request, self.serving)
        except InvalidRequest as error:
            log.info("rejected request id=%s: %s", request.request_id or "-", error)
            await context.abort_with_status(rpc_status.to_status(bad_request_status(error)))
        try:
            self.engine.admit()
        except Overloaded as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

        request_id = resolved.request_id
        admitted_at = time.perf_counter()
        if resolved.HasField("min_policy_version"):
            try:
                await self._wait_for_policy(resolved.min_policy_version)
            except asyncio.CancelledError:  # the deadline passed, or the caller left
                self.engine.release()
                log.info(
                    "rollout id=%s gave up waiting for policy version %d",
                    request_id,
                    resolved.min_policy_version,
                )
                raise
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_BUFFER)
        cancel = threading.Event()

        def emit(message: rollout_pb2.RolloutResponse) -> None:
            """Hand a message to the stream; once the caller is gone, drop it (the sampler stops at
            its next step, on every rank at once)."""
            future = asyncio.run_coroutine_threadsafe(queue.put(message), loop)
            while True:
                try:
                    return future.result(timeout=_POLL_SECONDS)
                except TimeoutError:
                    if cancel.is_set():
                        future.cancel()
                        return

        work = asyncio.wrap_future(self.engine.submit(resolved, emit, cancel.is_set, admitted_at))

        def finished(future: asyncio.Future) -> None:
            self.engine.release()
            # Once the caller has gone, nobody awaits the work: retrieve its outcome here, so that the
            # expected RolloutCancelled is not logged as "Future exception was never retrieved".
            if cancel.is_set() and not future.cancelled():
                error = future.exception()
                if error is not None and not isinstance(error, RolloutCancelled):
                    log.error("rollout %s failed after its caller left", request_id, exc_info=error)

        work.add_done_callback(finished)
        samples, steps = len(resolved.seeds), resolved.num_steps
        outcome = "OK"
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, work}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                while not queue.empty():
                    yield queue.get_nowait()
                work.result()
                break
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "CANCELLED"
            cancel.set()
            raise
        except RolloutCancelled:
            outcome = "CANCELLED"
        except InvalidRequest as error:  # found once the prompts are encoded, e.g. an unsplittable length
            outcome = "INVALID_ARGUMENT"
            await context.abort_with_status(rpc_status.to_status(bad_request_status(error)))
        except RankFailure as error:
            outcome = "UNAVAILABLE"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {request_id}: {error}")
        except Exception as error:  # noqa: BLE001 - every unexpected failure becomes INTERNAL with the id
            outcome = "INTERNAL"
            log.exception("rollout %s failed", request_id)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"request {request_id}: internal error: {type(error).__name__}: {error}",
            )
        finally:
            cancel.set()
            log.info(
                "rollout id=%s samples=%d steps=%d seconds=%.3f status=%s",
                request_id,
                samples,
                steps,
                time.perf_counter() - admitted_at,
                outcome,
            )
