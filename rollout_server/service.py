"""The RolloutService servicer: validation, admission, the stream of one rollout, weight updates."""

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_core.transport import PREVIOUS_ATTEMPTS_HEADER, PREVIOUS_ATTEMPTS_TRAILER
from rollout_server.errors import (
    ForeignRollout,
    InvalidRequest,
    MemoryReleased,
    NonFiniteStep,
    NoWeightSyncGroup,
    Overloaded,
    PruneTooLate,
    RankFailure,
    ShuttingDown,
    StaleUpdate,
    UnknownRollout,
    UpdateAbandoned,
    UploadIdle,
    WeightSyncFailed,
)
from rollout_server.validation import ServingContext, quoted, read_images, resolve
from rollout_server.weights import files, group, upload

if TYPE_CHECKING:
    from rollout_server.engine import Engine, MemoryChange
    from rollout_server.metrics import ServerMetrics
    from rollout_server.weights.update import WeightUpdate

log = logging.getLogger("rollout_server.service")
# What a handler receives in place of a request whose bytes do not parse (see server.py).
NOT_A_PROTOBUF = "the message is not a valid protobuf of the method's request type"
# How long a rollout refused while the weights' memory is released is told to wait before it retries:
# gRPC's own retries honour the pushback (gRFC A6), other clients read google.rpc.RetryInfo.
RELEASED_RETRY_SECONDS = 5
RETRY_PUSHBACK_TRAILER = "grpc-retry-pushback-ms"


class StreamStalled(Exception):
    """The client read nothing for the server's stall limit; ``write`` is the message still pending.
    (Cancelling it would leave gRPC unable to send the call's status, which must follow it.)"""

    def __init__(self, message: str, write: asyncio.Future):
        super().__init__(message)
        self.write = write


class CallerLeft(Exception):
    """A message could not be written: the caller cancelled or disconnected."""


@dataclasses.dataclass(frozen=True)
class CallStatus(grpc.Status):
    """A call's final status without rich details."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple = ()


class Refused(Exception):
    """A call refused before its work was queued; ``status`` ends it. ``error`` is the InvalidRequest
    behind an INVALID_ARGUMENT status (the HTTP front end names its fields)."""

    def __init__(self, status: grpc.Status, error: InvalidRequest | None = None):
        super().__init__(status.details)
        self.status = status
        self.error = error


def end_call(context, status: grpc.Status) -> None:
    """Have the call end with ``status`` when its handler returns.

    Rollout ends its calls this way, not with ``context.abort``: gRPC keeps the exception that abort
    raises on the call, and its traceback holds the handler's frames with the request in their
    locals. Such a cycle lives until Python's cyclic collector runs, which may take hundreds of calls
    in a server that makes few Python objects, while one request can parse to tens of MB (a million
    empty prompts)."""
    context.set_code(status.code)
    context.set_details(status.details)
    context.set_trailing_metadata((*(context.trailing_metadata() or ()), *status.trailing_metadata))


def report_previous_attempts(context) -> None:
    """Return the count of a retried call's earlier attempts in its trailer, since gRPC tells the
    client nothing of its own retries (a first attempt has no count; a malformed one is dropped)."""
    value = dict(context.invocation_metadata() or ()).get(PREVIOUS_ATTEMPTS_HEADER, "")
    if value.isascii() and value.isdigit() and len(value) <= 2:
        context.set_trailing_metadata(((PREVIOUS_ATTEMPTS_TRAILER, value),))


# How expected failures of a rollout or a weight update reach the caller. InvalidRequest becomes
# INVALID_ARGUMENT with BadRequest details; anything else is INTERNAL, with the traceback in the log.
FAILURES = (
    (StreamStalled, grpc.StatusCode.ABORTED),
    (NonFiniteStep, grpc.StatusCode.INTERNAL),
    (RankFailure, grpc.StatusCode.UNAVAILABLE),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (StaleUpdate, grpc.StatusCode.FAILED_PRECONDITION),
    (UploadIdle, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (FileNotFoundError, grpc.StatusCode.NOT_FOUND),
    (UnknownRollout, grpc.StatusCode.NOT_FOUND),
    (ForeignRollout, grpc.StatusCode.PERMISSION_DENIED),
    (PruneTooLate, grpc.StatusCode.FAILED_PRECONDITION),
    (WeightSyncFailed, grpc.StatusCode.UNAVAILABLE),
    (NoWeightSyncGroup, grpc.StatusCode.FAILED_PRECONDITION),
    (UpdateAbandoned, grpc.StatusCode.ABORTED),
    (MemoryReleased, grpc.StatusCode.FAILED_PRECONDITION),  # a weight update (a rollout: released_status)
)


def failure_status(what: str, error: Exception) -> tuple[str, grpc.Status]:
    """(status name for the log, the call's status) for ``what`` (e.g. "request <id>") failing with
    ``error``; unexpected failures are logged with their traceback."""
    if isinstance(error, InvalidRequest):
        log.info("%s rejected: %s", what, error)
        return "INVALID_ARGUMENT", rpc_status.to_status(bad_request_status(error))
    code = next((code for kind, code in FAILURES if isinstance(error, kind)), None)
    if code is None:
        log.error("%s failed", what, exc_info=error)
        code, error = grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
    else:
        log.info("%s ended: %s", what, error)
    status = status_pb2.Status(code=code.value[0], message=f"{what}: {error}")
    return code.name, rpc_status.to_status(status)


def released_status(error: MemoryReleased) -> CallStatus:
    """A rollout refused while the weights' memory is released: UNAVAILABLE, with when to retry."""
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=RELEASED_RETRY_SECONDS))
    packed = any_pb2.Any()
    packed.Pack(retry)
    status = rpc_status.to_status(
        status_pb2.Status(code=code_pb2.UNAVAILABLE, message=str(error), details=[packed])
    )
    pushback = (RETRY_PUSHBACK_TRAILER, str(RELEASED_RETRY_SECONDS * 1000))
    return CallStatus(status.code, status.details, (*status.trailing_metadata, pushback))


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


async def _next_within(messages: AsyncIterator, seconds: float):
    """The stream's next message; None if it ends, or sends nothing for ``seconds``."""
    try:
        return await asyncio.wait_for(anext(messages, None), seconds)
    except TimeoutError:
        return None


async def _first_of(ready: asyncio.Future, work: asyncio.Future) -> None:
    """Return once ``ready`` is set; raise ``work``'s failure if it ends first."""
    await asyncio.wait({ready, work}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        work.result()


async def _parsed(messages: AsyncIterator) -> AsyncIterator:
    """A client stream's messages; InvalidRequest at the first one that did not parse."""
    async for message in messages:
        if message is None:
            raise InvalidRequest([("request", NOT_A_PROTOBUF)])
        yield message


def _ends_refused(handler):
    """A weight RPC whose Refused (shutting down, another update running) ends its call with the
    refusal's status."""

    @functools.wraps(handler)
    async def ending(self, request, context):
        try:
            return await handler(self, request, context)
        except Refused as refusal:
            await context.abort_with_status(refusal.status)

    return ending


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        engine: "Engine",
        metrics: "ServerMetrics",
        serving: ServingContext,
        server_info: rollout_pb2.GetServerInfoResponse,
        weights_root: Path | None = None,
        upload_idle_seconds: float = 30.0,
    ):
        self.engine = engine
        self.metrics = metrics
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
        self._waiting = 0  # requests waiting for their min_policy_version
        self._waiting_image_bytes = 0  # the pixels of their conditioning images

    async def GetServerInfo(self, request, context):
        if request is None:
            await self._reject(context, "-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        info = rollout_pb2.GetServerInfoResponse()
        info.CopyFrom(self.server_info)
        status = self.engine.status()
        for target, adapter in status.lora_adapters.items():
            info.lora_adapters[target].CopyFrom(adapter)
        if "transformer" in status.lora_adapters:
            info.lora_adapter.CopyFrom(status.lora_adapters["transformer"])
        info.policy_version = status.policy_version
        info.weights_checksum = status.weights_checksum
        info.memory_released = status.memory_released
        if status.weight_sync is not None:
            info.weight_sync.CopyFrom(group.group_proto(status.weight_sync, self.server_info.sp_degree))
        return info

    async def PruneRollout(self, request, context):
        if request is None:
            await self._reject(context, "-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        request_id = quoted(request.request_id)
        try:
            # Answered once the worker has applied it: what it stopped, not what it might.
            answer = self.engine.prune(request.request_id, request.control_token, list(request.nodes))
            pruned = await asyncio.wrap_future(answer)
        except Exception as error:  # noqa: BLE001 - each failure becomes the call's status
            _, status = failure_status(f"prune of request {request_id}", error)
            await context.abort_with_status(status)
        log.info("rollout id=%s: %d nodes pruned from step %d", request_id, len(pruned.nodes), pruned.step)
        return rollout_pb2.PruneRolloutResponse(nodes=pruned.nodes, step=pruned.step)

    @_ends_refused
    async def UpdateWeights(self, request_iterator, context):
        def received() -> Awaitable["WeightUpdate"]:
            return upload.receive(
                _parsed(request_iterator),
                lambda: self.engine.status().policy_version,
                self.server_info.limits.max_update_bytes,
                self.upload_idle_seconds,
            )

        applied = await self._updating(context, self.update_weights(received))
        return rollout_pb2.UpdateWeightsResponse(**applied)

    async def update_weights(self, receive: Callable[[], Awaitable["WeightUpdate"]]) -> dict:
        """A weight update, whatever its transport: ``receive()`` is awaited once the update slot is
        held (so one update's bytes are held at a time), and what it returns is checked and applied.
        The answer's fields, or Refused (shutting down, another update running), or the update's
        failure (see ``update_failure``)."""
        started_at = time.perf_counter()
        self._refuse_when_shutting_down()
        async with self._update_slot():
            update = await receive()
            await self._apply(update)
        return self._applied(update, started_at)

    async def tensor_sha256(self, target: str, names: Iterable[str]) -> tuple[int, dict[str, str]]:
        """(the policy version, SGLang's SHA-256 of each of ``names`` that ``target`` serves:
        ``Engine.tensor_sha256``), computed on a thread while the update slot is held, so that no
        update changes the tensors it reads (Refused while one runs, while the weights are released, or
        at shutdown)."""
        self._refuse_when_shutting_down()
        async with self._update_slot():
            try:
                digests = await asyncio.to_thread(self.engine.tensor_sha256, target, names)
            except MemoryReleased as error:
                raise Refused(CallStatus(grpc.StatusCode.FAILED_PRECONDITION, str(error))) from None
            return self.engine.status().policy_version, digests

    @_ends_refused
    async def LoadWeights(self, request, context):
        if request is None:
            await self._reject(context, "-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        applied = await self._updating(context, self.load_weights(request))
        return rollout_pb2.LoadWeightsResponse(**applied)

    async def load_weights(self, request: rollout_pb2.LoadWeightsRequest) -> dict:
        """LoadWeights without its transport: the answer's fields, or Refused (shutting down, disabled,
        another update running), or the update's failure (see ``update_failure``)."""
        self._refuse_when_shutting_down()
        if self.weights_root is None:
            raise Refused(
                CallStatus(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "LoadWeights is disabled: the server was started without --weights-root",
                )
            )
        return await self.update_weights(
            lambda: asyncio.to_thread(
                files.read_update,
                self.weights_root,
                request,
                self.engine.status().policy_version,
                self.server_info.limits.max_update_bytes,
                self.engine.transformers,
            )
        )

    @_ends_refused
    async def InitWeightSync(self, request, context):
        if request is None:
            await self._reject(context, "-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        self._refuse_when_shutting_down()
        try:
            options = self.engine.check_weight_sync(request)
        except InvalidRequest as error:
            await self._reject(context, "-", error)
        async with self._update_slot():
            await self._updating(context, asyncio.wrap_future(self.engine.join_weight_sync(options)))
        log.info("joined weight-sync group %r at rank %d", options.group_name, options.rank_offset)
        joined = group.group_proto(options, self.server_info.sp_degree)
        return rollout_pb2.InitWeightSyncResponse(group=joined)

    @_ends_refused
    async def DestroyWeightSync(self, request, context):
        if request is None:
            await self._reject(context, "-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        async with self._update_slot():
            left = await self._updating(context, asyncio.wrap_future(self.engine.leave_weight_sync()))
        return rollout_pb2.DestroyWeightSyncResponse(left=left)

    @_ends_refused
    async def UpdateWeightsFromGroup(self, request_iterator, context):
        started_at = time.perf_counter()
        self._refuse_when_shutting_down()
        requests = aiter(_parsed(request_iterator))
        first = await self._updating(context, _next_within(requests, self.upload_idle_seconds))
        if first is None or first.WhichOneof("message") != "manifest":
            error = InvalidRequest([("manifest", "the first message must carry the manifest")])
            await self._reject(context, "-", error)
        async with self._update_slot():
            check = asyncio.to_thread(self.engine.check_group_update, first.manifest)
            manifest = await self._updating(context, check)
            # The group it was checked in (a new one needs the update slot, held here).
            timeout = self.engine.status().weight_sync.timeout_seconds
            loop = asyncio.get_running_loop()
            ready, start = loop.create_future(), Future()
            work = self.engine.update_from_group(
                manifest, lambda: loop.call_soon_threadsafe(ready.set_result, None), start
            )
            work.add_done_callback(lambda _: loop.call_soon_threadsafe(self._policy_advanced))
            done = asyncio.wrap_future(work)
            try:
                await self._updating(context, _first_of(ready, done))
                ready_message = rollout_pb2.GroupUpdateReady(
                    bytes=manifest.wire_bytes, buckets=len(manifest.buckets)
                )
                await context.write(rollout_pb2.UpdateWeightsFromGroupResponse(ready=ready_message))
                following = await self._updating(context, _next_within(requests, timeout))
                start.set_result(following is not None and following.WhichOneof("message") == "start")
                received = await self._updating(context, done)
            finally:
                if not start.done():  # the caller left, or the update failed first
                    start.set_result(False)
                done.add_done_callback(lambda ended: ended.cancelled() or ended.exception())  # read
        applied = rollout_pb2.GroupUpdateApplied(
            total_tensors=received.total_tensors,
            transfer_seconds=received.transfer_seconds,
            rank_checksums=received.rank_checksums,
            **self._applied(manifest.update, started_at),
        )
        await context.write(rollout_pb2.UpdateWeightsFromGroupResponse(applied=applied))

    @_ends_refused
    async def ReleaseMemory(self, request, context):
        if request is None:
            await self._reject(context, "-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        residency = await self._updating(context, self.change_memory(self.engine.release_memory))
        return rollout_pb2.ReleaseMemoryResponse(residency=residency)

    @_ends_refused
    async def ResumeMemory(self, request, context):
        if request is None:
            await self._reject(context, "-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        residency = await self._updating(context, self.change_memory(self.engine.resume_memory))
        return rollout_pb2.ResumeMemoryResponse(residency=residency)

    async def change_memory(
        self, change: "Callable[[], Future[MemoryChange]]"
    ) -> rollout_pb2.MemoryResidency:
        """ReleaseMemory or ResumeMemory (``change``: the engine's) without its transport: what it did,
        or Refused (shutting down, another weight change running), or its failure. Once queued, the
        change goes through even if its caller leaves: rollouts stay refused until a resume."""
        started_at = time.perf_counter()
        self._refuse_when_shutting_down()
        async with self._update_slot():
            work = asyncio.wrap_future(change())
            work.add_done_callback(lambda done: done.cancelled() or done.exception())  # read, if left
            moved = await asyncio.shield(work)
        seconds = time.perf_counter() - started_at
        status = self.engine.status()
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

    def _refuse_when_shutting_down(self) -> None:
        if self.shutting_down:
            self.metrics.reject("shutting_down")
            raise Refused(CallStatus(grpc.StatusCode.UNAVAILABLE, "server is shutting down"))

    @contextlib.asynccontextmanager
    async def _update_slot(self) -> AsyncIterator[None]:
        """Hold the one weight-update slot for the body (released however it ends, the caller's
        cancel included); Refused (RESOURCE_EXHAUSTED) at once while another update holds it."""
        if self._update_in_progress:
            raise Refused(
                CallStatus(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "another weight update is in progress (or a release or resume of the weights' "
                    "memory); the server takes one at a time, retry after it",
                )
            )
        self._update_in_progress = True
        try:
            yield
        finally:
            self._update_in_progress = False

    async def _apply(self, update: "WeightUpdate") -> None:
        """Check ``update`` (off the event loop: a LoRA check builds an empty model), then queue it
        behind the rollouts already queued and wait until it is applied."""
        await asyncio.to_thread(self.engine.check_update, update)
        work = self.engine.update_weights(update)
        loop = asyncio.get_running_loop()
        # Wake waiting rollouts even when this caller has gone away before the job ended.
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self._policy_advanced))
        await asyncio.wrap_future(work)

    def _policy_advanced(self) -> None:
        self._policy_changed.set()
        self._policy_changed = asyncio.Event()

    def begin_shutdown(self) -> None:
        """Refuse new calls from now on, and end the ones waiting for a policy version."""
        self.shutting_down = True
        self._policy_advanced()

    async def _wait_for_policy(self, resolved: rollout_pb2.RolloutRequest, image_bytes: int) -> None:
        """Return once the engine runs ``resolved.min_policy_version`` or later. Waiting requests hold
        no rollout slot: they have a bounded list of their own, and hold at most
        ``max_queued_image_bytes`` of conditioning pixels together (``image_bytes`` this one's; Refused
        beyond either bound, or at shutdown). The call's deadline bounds the wait."""
        version = resolved.min_policy_version
        if self.engine.status().policy_version >= version:
            return
        limits = self.serving.limits
        full = None
        if self._waiting >= (most := limits.max_waiting_requests):
            full = f"{self._waiting} requests already wait for a policy version (limit {most})"
        elif image_bytes and self._waiting_image_bytes + image_bytes > limits.max_queued_image_bytes:
            full = (
                f"requests waiting for a policy version hold {self._waiting_image_bytes} bytes of "
                f"conditioning images; this one's {image_bytes} would pass the limit of "
                f"{limits.max_queued_image_bytes}"
            )
        if full is not None:
            self.metrics.reject("overloaded")
            raise Refused(CallStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, full))
        self._waiting += 1
        self._waiting_image_bytes += image_bytes
        log.info("rollout id=%s waits for policy version %d", resolved.request_id, version)
        try:
            while True:
                changed = self._policy_changed  # taken before the check, so no update is missed
                if self.engine.status().policy_version >= version:
                    return
                if self.shutting_down:
                    raise Refused(CallStatus(grpc.StatusCode.UNAVAILABLE, "server is shutting down"))
                await changed.wait()
        except asyncio.CancelledError:  # the deadline passed, or the caller left
            log.info("rollout id=%s gave up waiting for policy version %d", resolved.request_id, version)
            raise
        finally:
            self._waiting -= 1
            self._waiting_image_bytes -= image_bytes

    def _applied(self, update: "WeightUpdate", started_at: float) -> dict:
        """The fields UpdateWeightsResponse and LoadWeightsResponse share."""
        seconds = time.perf_counter() - started_at
        self.metrics.weight_update(update.nbytes, seconds)
        log.info("weights %s: %d bytes in %.3f s, status=OK", update.describe(), update.nbytes, seconds)
        return {
            "policy_version": update.policy_version,
            "tensors": len(update.tensors),
            "bytes": update.nbytes,
            "seconds": seconds,
            "weights_checksum": self.engine.status().weights_checksum,
        }

    async def _updating(self, context, stage: Awaitable):
        """Await one stage of a weight update, turning its failures into the call's status (Refused
        is left to ``_ends_refused``)."""
        try:
            return await stage
        except Refused:
            raise
        except Exception as error:  # noqa: BLE001 - each failure becomes the call's status
            await context.abort_with_status(self.update_failure(error))

    def update_failure(self, error: Exception) -> grpc.Status:
        """The status a weight update's failure ends its call with (a rejection is counted)."""
        outcome, status = failure_status("weight update", error)
        if outcome == "INVALID_ARGUMENT":
            self.metrics.reject("invalid_argument")
        return status

    async def Rollout(self, request, context):
        report_previous_attempts(context)
        try:
            resolved, stream = await self.admit(request)
        except Refused as refusal:
            end_call(context, refusal.status)
            return

        request_id = resolved.request_id
        submitted_at = time.perf_counter()
        outcome, failure, unsent = "OK", None, None
        try:
            async for message in stream:
                await self._write(context, message)
        except asyncio.CancelledError:
            outcome = "CANCELLED"  # the caller left or its deadline passed
            raise
        except CallerLeft:
            # A write failed because the call is over: the handler ends quietly. gRPC's closing
            # status then fails as a cancelled call's does, which it ignores; raising would have it
            # log an unexpected error and a failed error status.
            outcome = "CANCELLED"
        except StreamStalled as error:
            outcome, failure = failure_status(f"request {request_id}", error)
            unsent = error.write
        except Exception as error:  # noqa: BLE001 - each failure becomes the call's status
            outcome, failure = failure_status(f"request {request_id}", error)
        finally:
            stream.close()  # the engine drops the rollout if it still runs
            self.rollout_ended(resolved, submitted_at, outcome)
        if unsent is not None:
            # The work is freed already; the status goes out once the client takes the pending message.
            try:
                await unsent
            except Exception:  # noqa: BLE001 - the caller left meanwhile: nobody to tell
                return
        if failure is not None:
            end_call(context, failure)

    async def admit(
        self,
        request: rollout_pb2.RolloutRequest | None,
        check: Callable[[rollout_pb2.RolloutRequest], None] | None = None,
    ):
        """Validate and queue a rollout: its resolved request and its stream, or Refused. ``check``
        sees the resolved request before it is queued, and may refuse it with InvalidRequest or
        Overloaded (the HTTP front end's own bounds); nothing is awaited between it and the queueing
        of a request without ``min_policy_version``."""
        if self.shutting_down:
            self.metrics.reject("shutting_down")
            raise Refused(CallStatus(grpc.StatusCode.UNAVAILABLE, "server is shutting down"))
        if request is None:
            raise self._refusal("-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        try:
            # Off the event loop: conditioning images are walked, then decoded.
            resolved, condition_images = await asyncio.to_thread(self._resolve, request)
        except InvalidRequest as error:
            raise self._refusal(quoted(request.request_id or "-"), error) from None
        try:
            if check is not None:
                check(resolved)
            if resolved.HasField("min_policy_version"):
                self.engine.check_fits(resolved)  # a rollout too large is refused at once, not after the wait
                await self._wait_for_policy(resolved, sum(image.nbytes for image in condition_images))
            return resolved, self.engine.open_stream(resolved, condition_images)
        except InvalidRequest as error:
            raise self._refusal(quoted(resolved.request_id), error) from None
        except Overloaded as error:
            self.metrics.reject("overloaded")
            raise Refused(CallStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))) from None
        except MemoryReleased as error:
            self.metrics.reject("memory_released")
            raise Refused(released_status(error)) from None

    def rollout_ended(self, resolved: rollout_pb2.RolloutRequest, submitted_at: float, outcome: str) -> None:
        """Count a rollout's outcome and write its one log line (every front end's rollouts alike)."""
        self.metrics.rollouts.labels(outcome).inc()
        log.info(
            "rollout id=%s samples=%d steps=%d seconds=%.3f status=%s",
            resolved.request_id,
            len(resolved.seeds),
            resolved.num_steps,
            time.perf_counter() - submitted_at,
            outcome,
        )

    def _resolve(self, request: rollout_pb2.RolloutRequest):
        """The resolved request, without its conditioning images' files, and those images decoded:
        each file is decoded here once, and the engine works from its pixels."""
        resolved = resolve(request, self.serving)
        condition_images = read_images(resolved, self.serving)
        resolved.ClearField("condition_images")
        return resolved, condition_images

    async def _write(self, context, message: rollout_pb2.RolloutResponse) -> None:
        """Send one message: StreamStalled if the client takes nothing for the stall limit, CallerLeft
        if the call ended."""
        stall_seconds = self.serving.limits.stall_seconds
        write = asyncio.ensure_future(context.write(message))
        try:
            if not (await asyncio.wait({write}, timeout=stall_seconds))[0]:
                raise StreamStalled(
                    f"the client read nothing for {stall_seconds:g} s (the server's --stall-seconds), "
                    "so the rollout was stopped",
                    write,
                )
            write.result()
        except StreamStalled:
            raise
        except asyncio.CancelledError:
            # The call is over (its deadline, a cancel, the shutdown): the pending write fails with it,
            # and its error is taken here, or asyncio would log it as a task exception never retrieved.
            write.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise
        except Exception as error:  # noqa: BLE001 - gRPC fails a write only once the call is over
            raise CallerLeft(f"the call ended: {error}") from error

    async def _reject(self, context, request_id: str, error: InvalidRequest) -> None:
        await context.abort_with_status(self._rejection(request_id, error))

    def _refusal(self, request_id: str, error: InvalidRequest) -> Refused:
        return Refused(self._rejection(request_id, error), error)

    def _rejection(self, request_id: str, error: InvalidRequest) -> grpc.Status:
        """The INVALID_ARGUMENT status of a rejected request (logged and counted)."""
        log.info("rejected request id=%s: %s", request_id, error)
        self.metrics.reject("invalid_argument")
        return rpc_status.to_status(bad_request_status(error))
