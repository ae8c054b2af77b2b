"""The RolloutService servicer: validation, admission, and the stream of one rollout."""

import asyncio
import logging
import threading
import time

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_server.engine import Overloaded, RolloutEngine
from rollout_server.parallel import RankFailure
from rollout_server.sampler import RolloutCancelled
from rollout_server.validation import InvalidRequest, ServingContext, resolve

log = logging.getLogger("rollout_server.service")
# Messages buffered between the worker and the network before the worker waits for the client.
STREAM_BUFFER = 8
_POLL_SECONDS = 0.25


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
        self, engine: RolloutEngine, serving: ServingContext, server_info: rollout_pb2.GetServerInfoResponse
    ):
        self.engine = engine
        self.serving = serving
        self.server_info = server_info
        self.shutting_down = False

    async def GetServerInfo(self, request, context):
        info = rollout_pb2.GetServerInfoResponse()
        info.CopyFrom(self.server_info)
        info.policy_version = self.engine.policy_version
        return info

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
