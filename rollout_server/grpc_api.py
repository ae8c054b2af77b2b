"""The gRPC front end's RolloutService: each call's messages translated to the resolved request or the
weight update, over the shared admission and engine client, and the engine's events to the stream."""

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_core.transport import PREVIOUS_ATTEMPTS_HEADER, PREVIOUS_ATTEMPTS_TRAILER
from rollout_server.admission import NOT_A_PROTOBUF, Admission, Refused, StreamStalled, failure
from rollout_server.errors import InvalidRequest
from rollout_server.quoting import quoted
from rollout_server.weights import group, upload

if TYPE_CHECKING:
    from rollout_server.engine_client import EngineClient
    from rollout_server.weights.update import WeightUpdate

log = logging.getLogger("rollout_server.grpc_api")
RETRY_PUSHBACK_TRAILER = "grpc-retry-pushback-ms"


class CallerLeft(Exception):
    """A message could not be written: the caller cancelled or disconnected."""


@dataclasses.dataclass(frozen=True)
class CallStatus(grpc.Status):
    """A call's final status without rich details."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple = ()


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


def status_of(code: grpc.StatusCode, details: str, error: Exception | None = None, retry_seconds: int = 0):
    """The call's status: BadRequest details for the InvalidRequest behind an INVALID_ARGUMENT;
    RetryInfo and gRPC's retry pushback (gRFC A6) for a refusal with retry advice."""
    if isinstance(error, InvalidRequest):
        return rpc_status.to_status(bad_request_status(error))
    if not retry_seconds:
        return CallStatus(code, details)
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry_seconds))
    packed = any_pb2.Any()
    packed.Pack(retry)
    status = rpc_status.to_status(status_pb2.Status(code=code.value[0], message=details, details=[packed]))
    pushback = (RETRY_PUSHBACK_TRAILER, str(retry_seconds * 1000))
    return CallStatus(status.code, status.details, (*status.trailing_metadata, pushback))


def refusal_status(refusal: Refused) -> grpc.Status:
    return status_of(refusal.code, refusal.details, refusal.error, refusal.retry_seconds)


def failure_status(what: str, error: Exception) -> tuple[str, grpc.Status]:
    """(status name for the log, the call's status) for ``what`` (e.g. "request <id>") failing with
    ``error`` (``admission.failure``)."""
    code, details = failure(what, error)
    return code.name, status_of(code, details, error)


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
            await context.abort_with_status(refusal_status(refusal))

    return ending


class RolloutService(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(
        self,
        admission: Admission,
        client: "EngineClient",
        server_info: rollout_pb2.GetServerInfoResponse,
        upload_idle_seconds: float = 30.0,
    ):
        self.admission = admission
        self.client = client
        self.server_info = server_info
        self.upload_idle_seconds = upload_idle_seconds

    async def GetServerInfo(self, request, context):
        if request is None:
            await self._reject(context, InvalidRequest([("request", NOT_A_PROTOBUF)]))
        info = rollout_pb2.GetServerInfoResponse()
        info.CopyFrom(self.server_info)
        status = self.client.status()
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
            await self._reject(context, InvalidRequest([("request", NOT_A_PROTOBUF)]))
        request_id = quoted(request.request_id)
        try:
            # Answered once the worker has applied it: what it stopped, not what it might.
            answer = self.client.prune(request.request_id, request.control_token, list(request.nodes))
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
                lambda: self.client.status().policy_version,
                self.client.max_update_bytes,
                self.upload_idle_seconds,
            )

        applied = await self._updating(context, self.client.update_weights(received))
        return rollout_pb2.UpdateWeightsResponse(**applied)

    @_ends_refused
    async def LoadWeights(self, request, context):
        if request is None:
            await self._reject(context, InvalidRequest([("request", NOT_A_PROTOBUF)]))
        applied = await self._updating(context, self.client.load_weights(request))
        return rollout_pb2.LoadWeightsResponse(**applied)

    @_ends_refused
    async def InitWeightSync(self, request, context):
        if request is None:
            await self._reject(context, InvalidRequest([("request", NOT_A_PROTOBUF)]))
        self.client.refuse_when_shutting_down()
        try:
            options = self.client.engine.check_weight_sync(request)
        except InvalidRequest as error:
            await self._reject(context, error)
        async with self.client.update_slot():
            await self._updating(context, asyncio.wrap_future(self.client.engine.join_weight_sync(options)))
        log.info("joined weight-sync group %r at rank %d", options.group_name, options.rank_offset)
        joined = group.group_proto(options, self.server_info.sp_degree)
        return rollout_pb2.InitWeightSyncResponse(group=joined)

    @_ends_refused
    async def DestroyWeightSync(self, request, context):
        if request is None:
            await self._reject(context, InvalidRequest([("request", NOT_A_PROTOBUF)]))
        async with self.client.update_slot():
            left = await self._updating(context, asyncio.wrap_future(self.client.engine.leave_weight_sync()))
        return rollout_pb2.DestroyWeightSyncResponse(left=left)

    @_ends_refused
    async def UpdateWeightsFromGroup(self, request_iterator, context):
        started_at = time.perf_counter()
        self.client.refuse_when_shutting_down()
        requests = aiter(_parsed(request_iterator))
        first = await self._updating(context, _next_within(requests, self.upload_idle_seconds))
        if first is None or first.WhichOneof("message") != "manifest":
            error = InvalidRequest([("manifest", "the first message must carry the manifest")])
            await self._reject(context, error)
        engine = self.client.engine
        async with self.client.update_slot():
            check = asyncio.to_thread(engine.check_group_update, first.manifest)
            manifest = await self._updating(context, check)
            # The group it was checked in (a new one needs the update slot, held here).
            timeout = engine.status().weight_sync.timeout_seconds
            loop = asyncio.get_running_loop()
            ready, start = loop.create_future(), Future()
            work = engine.update_from_group(
                manifest, lambda: loop.call_soon_threadsafe(ready.set_result, None), start
            )
            self.client.wake_on_end(work)
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
            **self.client.applied(manifest.update, started_at),
        )
        await context.write(rollout_pb2.UpdateWeightsFromGroupResponse(applied=applied))

    @_ends_refused
    async def ReleaseMemory(self, request, context):
        if request is None:
            await self._reject(context, InvalidRequest([("request", NOT_A_PROTOBUF)]))
        residency = await self._updating(context, self.client.change_memory(release=True))
        return rollout_pb2.ReleaseMemoryResponse(residency=residency)

    @_ends_refused
    async def ResumeMemory(self, request, context):
        if request is None:
            await self._reject(context, InvalidRequest([("request", NOT_A_PROTOBUF)]))
        residency = await self._updating(context, self.client.change_memory(release=False))
        return rollout_pb2.ResumeMemoryResponse(residency=residency)

    async def _updating(self, context, stage: Awaitable):
        """Await one stage of a weight update, turning its failures into the call's status (Refused
        is left to ``_ends_refused``)."""
        try:
            return await stage
        except Refused:
            raise
        except Exception as error:  # noqa: BLE001 - each failure becomes the call's status
            code, details = self.client.update_failed(error)
            await context.abort_with_status(status_of(code, details, error))

    async def Rollout(self, request, context):
        report_previous_attempts(context)
        try:
            resolved, stream = await self.admission.admit(request)
        except Refused as refusal:
            end_call(context, refusal_status(refusal))
            return

        request_id = resolved.request_id
        submitted_at = time.perf_counter()
        outcome, failed, unsent = "OK", None, None
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
            outcome, failed = failure_status(f"request {request_id}", error)
            unsent = error.write
        except Exception as error:  # noqa: BLE001 - each failure becomes the call's status
            outcome, failed = failure_status(f"request {request_id}", error)
        finally:
            stream.close()  # the engine drops the rollout if it still runs
            self.admission.rollout_ended(resolved, submitted_at, outcome)
        if unsent is not None:
            # The work is freed already; the status goes out once the client takes the pending message.
            try:
                await unsent
            except Exception:  # noqa: BLE001 - the caller left meanwhile: nobody to tell
                return
        if failed is not None:
            end_call(context, failed)

    async def _write(self, context, message: rollout_pb2.RolloutResponse) -> None:
        """Send one message: StreamStalled if the client takes nothing for the stall limit, CallerLeft
        if the call ended."""
        stall_seconds = self.admission.serving.limits.stall_seconds
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

    async def _reject(self, context, error: InvalidRequest) -> None:
        """End the call with the INVALID_ARGUMENT status of a rejected request (logged and counted)."""
        await context.abort_with_status(refusal_status(self.admission.rejected("-", error)))
