"""Admission: what every front end's rollout passes before it is queued, whatever its wire.

A request is resolved and checked (``validation.resolve``) off the event loop, waits for its
``min_policy_version`` in a bounded list of its own, and is queued on the engine; a refusal is counted
by its reason and ends as ``Refused``, which names a canonical status code (``grpc.StatusCode``, the
google.rpc codes): the gRPC front end sends it as the call's status, the HTTP one maps it to an HTTP
status. Each front end translates its wire to a ``RolloutRequest`` before, and the engine's events to
its wire after.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from rollout.v1 import rollout_pb2
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
from rollout_server.quoting import quoted
from rollout_server.validation import ServingContext, read_images, resolve

if TYPE_CHECKING:
    from rollout_server.engine import EventsFactory, Outbox
    from rollout_server.engine_client import EngineClient
    from rollout_server.metrics import ServerMetrics

log = logging.getLogger("rollout_server.admission")
# What a front end receives in place of a request whose bytes do not parse.
NOT_A_PROTOBUF = "the message is not a valid protobuf of the method's request type"
# How long a rollout refused while the weights' memory is released is told to wait before it retries.
RELEASED_RETRY_SECONDS = 5


class StreamStalled(Exception):
    """The client read nothing for the server's stall limit; ``write`` is the message still pending.
    (Cancelling it would leave gRPC unable to send the call's status, which must follow it.)"""

    def __init__(self, message: str, write: asyncio.Future):
        super().__init__(message)
        self.write = write


class Refused(Exception):
    """A call refused before its work was queued: ``code`` (a canonical status code) and ``details``.
    ``error`` is the InvalidRequest behind an INVALID_ARGUMENT refusal (a front end names its fields);
    ``retry_seconds`` how long the caller is told to wait before it retries (0: no advice)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        error: InvalidRequest | None = None,
        retry_seconds: int = 0,
    ):
        super().__init__(details)
        self.code = code
        self.details = details
        self.error = error
        self.retry_seconds = retry_seconds


# How expected failures of a rollout or a weight update reach the caller. InvalidRequest is
# INVALID_ARGUMENT; anything else is INTERNAL, with the traceback in the log.
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
    (MemoryReleased, grpc.StatusCode.FAILED_PRECONDITION),  # a weight update (a rollout: Refused)
)


def failure(what: str, error: Exception) -> tuple[grpc.StatusCode, str]:
    """(the code, the message) for ``what`` (e.g. "request <id>") failing with ``error``, logged;
    unexpected failures with their traceback, as INTERNAL."""
    if isinstance(error, InvalidRequest):
        log.info("%s rejected: %s", what, error)
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    code = next((code for kind, code in FAILURES if isinstance(error, kind)), None)
    if code is None:
        log.error("%s failed", what, exc_info=error)
        code, error = grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
    else:
        log.info("%s ended: %s", what, error)
    return code, f"{what}: {error}"


class Admission:
    """The one admission every front end's rollouts pass: validation, the bounds on requests waiting
    for a policy version (``max_waiting_requests`` of them, ``max_queued_image_bytes`` of their
    conditioning pixels), the engine's queue, and the count of each refusal by reason."""

    def __init__(self, client: "EngineClient", serving: ServingContext, metrics: "ServerMetrics"):
        self.client = client
        self.serving = serving
        self.metrics = metrics
        self._waiting = 0  # requests waiting for their min_policy_version
        self._waiting_image_bytes = 0  # the pixels of their conditioning images

    async def admit(
        self,
        request: rollout_pb2.RolloutRequest | None,
        check: Callable[[rollout_pb2.RolloutRequest], None] | None = None,
        events: "EventsFactory | None" = None,
    ) -> tuple[rollout_pb2.RolloutRequest, "Outbox"]:
        """Validate and queue a rollout: its resolved request and its stream (of what ``events``
        makes of its events: ``Engine.open_stream``), or Refused. ``check`` sees the resolved request
        before it is queued, and may refuse it with InvalidRequest or Overloaded (a front end's own
        bounds); nothing is awaited between it and the queueing of a request without
        ``min_policy_version``."""
        self.client.refuse_when_shutting_down()
        if request is None:
            raise self.rejected("-", InvalidRequest([("request", NOT_A_PROTOBUF)]))
        try:
            # Off the event loop: conditioning images are walked, then decoded.
            resolved, condition_images = await asyncio.to_thread(self._resolve, request)
        except InvalidRequest as error:
            raise self.rejected(quoted(request.request_id or "-"), error) from None
        try:
            if check is not None:
                check(resolved)
            if resolved.HasField("min_policy_version"):
                self.client.check_fits(resolved)  # a rollout too large is refused at once, not after the wait
                await self._wait_for_policy(resolved, sum(image.nbytes for image in condition_images))
            return resolved, self.client.open(resolved, condition_images, events)
        except InvalidRequest as error:
            raise self.rejected(quoted(resolved.request_id), error) from None
        except Overloaded as error:
            self.metrics.reject("overloaded")
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)) from None
        except MemoryReleased as error:
            self.metrics.reject("memory_released")
            raise Refused(
                grpc.StatusCode.UNAVAILABLE, str(error), retry_seconds=RELEASED_RETRY_SECONDS
            ) from None

    def rejected(self, request_id: str, error: InvalidRequest) -> Refused:
        """The INVALID_ARGUMENT refusal of a rejected request (logged and counted)."""
        log.info("rejected request id=%s: %s", request_id, error)
        self.metrics.reject("invalid_argument")
        return Refused(grpc.StatusCode.INVALID_ARGUMENT, str(error), error)

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

    async def _wait_for_policy(self, resolved: rollout_pb2.RolloutRequest, image_bytes: int) -> None:
        """Return once the engine runs ``resolved.min_policy_version`` or later. Waiting requests hold
        no rollout slot: they have a bounded list of their own, and hold at most
        ``max_queued_image_bytes`` of conditioning pixels together (``image_bytes`` this one's; Refused
        beyond either bound, or at shutdown). The call's deadline bounds the wait."""
        version = resolved.min_policy_version
        if self.client.status().policy_version >= version:
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
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, full)
        self._waiting += 1
        self._waiting_image_bytes += image_bytes
        log.info("rollout id=%s waits for policy version %d", resolved.request_id, version)
        try:
            await self.client.wait_for_policy(version)
        except asyncio.CancelledError:  # the deadline passed, or the caller left
            log.info("rollout id=%s gave up waiting for policy version %d", resolved.request_id, version)
            raise
        finally:
            self._waiting -= 1
            self._waiting_image_bytes -= image_bytes
