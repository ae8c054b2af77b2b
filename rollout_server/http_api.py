"""The HTTP front end: SGLang-Diffusion's rollout and weight endpoints, served by the same engine as
the gRPC service, on the same event loop (``rollout-server serve --http-port``).

* ``POST /rollout/generate``: SGLang's ``RolloutRequest`` (JSON, or msgpack with a msgpack content
  type), answered with a msgpack list of one ``RolloutResponse`` per sample (see ``sglang.py``); the
  fields it set that are accepted and not used, as SGLang accepts them, are named in the answer's
  ``X-Rollout-Ignored-Fields`` header and a log line.
* ``POST /update_weights_from_disk``: a folder under ``--weights-root``, as LoadWeights.
* ``POST /update_weights_from_tensor``: UpdateWeights with the tensors in the body as data
  (safetensors bytes, or SGLang's flattened bucket: ``weights/payload.py``); SGLang's own payloads
  are pickles, and network input is never unpickled here.
* ``POST /update_weights_from_tensor_checker``: each named tensor's SHA-256, as SGLang computes it,
  against the tensor served.
* ``POST /get_weights_checksum``: each transformer's checksum, by module name.
* ``POST /release_memory_occupation`` and ``/resume_memory_occupation``: the weights' memory, as gRPC
  ``ReleaseMemory`` and ``ResumeMemory``; rollouts get 503 with Retry-After while it is released.
* ``POST /abort_request``: stops the ``/rollout/generate`` rollouts of a ``rid`` (or all of them);
  each answers at once, with no output and SGLang's abort finish reason.
* ``GET /health`` and ``GET /health_generate`` (the latter runs a one-step rollout).

Every request passes the admission the gRPC front end's pass (``admission.py``): the same tokens
(``Authorization: Bearer``), validation and limits, the same queue, metrics and log line. The body is
bounded before it is read, the answer's size before any work (``--max-http-response-bytes``, held
until the answer has left), and a client that disconnects cancels its rollout. Requests, not
connections, are counted against what the server takes at once; the health probes are not counted,
and /health_generate's probes share one rollout. A connection's own bounds (reading a request, an
answer not taken, a half-close) are in ``http_connection.py``.
Errors are JSON, ``{"detail": ..., "violations": [{"field", "description"}]}``, with 400 for a bad
request (the field as the client named it), 401/403 for tokens, 429 and 503 with Retry-After for a
full server and a shutdown.
"""

import asyncio
import contextlib
import functools
import json
import logging
import math
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import grpc
import msgpack
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rollout.v1 import rollout_pb2
from rollout_server import sglang
from rollout_server.admission import Admission, Refused, failure
from rollout_server.auth import ServerTLS, TokenPolicy, method_path
from rollout_server.errors import InvalidRequest, Overloaded, StartupError
from rollout_server.http_connection import BoundedH11Protocol
from rollout_server.quoting import quoted
from rollout_server.weights import payload
from rollout_server.weights.spec import HEADER_ALLOWANCE_BYTES, check_target

if TYPE_CHECKING:
    from rollout_server.engine_client import EngineClient
    from rollout_server.weights.update import WeightUpdate

log = logging.getLogger("rollout_server.http")
MSGPACK = "application/msgpack"
_MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")
# Our gRPC status codes as HTTP statuses (SGLang answers a failed weight update with 400).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Seconds a client is told to wait (Retry-After) before it retries a refused request.
RETRY_AFTER = {429: "1", 503: "5"}
# The gRPC method whose token an endpoint needs.
_ROLLOUT, _INFO, _LOAD, _UPDATE, _RELEASE, _RESUME = (
    method_path(m)
    for m in ("Rollout", "GetServerInfo", "LoadWeights", "UpdateWeights", "ReleaseMemory", "ResumeMemory")
)
_ABORT = _UPDATE  # stopping other callers' rollouts takes the admin token, as the weight endpoints
_WEIGHT_BODY_BYTES = 64 * 1024  # the weight endpoints' bodies: a path and a few names
_NAMES_SHOWN = 5  # tensors named in a message, the rest counted
# Requests at once besides the health probes: what the queue and the wait list hold, and a few for the
# weight and checksum endpoints.
SPARE_REQUESTS = 8
_PROBES = frozenset({"/health", "/health_generate"})
# /health_generate's answer serves the probes of this many seconds after its rollout ended.
PROBE_REUSE_SECONDS = 5.0
# An answer is handed to its connection this much at a time (see _Answer).
_ANSWER_CHUNK_BYTES = 256 * 1024


class HttpError(Exception):
    """An answer other than 200: its status and JSON body."""

    def __init__(
        self, status: int, detail: str, violations: list[dict[str, str]] = (), extra: dict | None = None
    ):
        super().__init__(detail)
        self.status = status
        self.body = {"detail": detail, "violations": list(violations), **(extra or {})}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER[self.status]} if self.status in RETRY_AFTER else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body, self.status, headers)


def _status_error(code: grpc.StatusCode, details: str, error: Exception | None = None) -> HttpError:
    """The HttpError of a rollout's status code (a 400 naming the client's fields for the
    InvalidRequest behind it)."""
    if isinstance(error, InvalidRequest):
        return _invalid(sglang.sglang_violations(error))
    return HttpError(HTTP_STATUS.get(code, 500), details)


def _refusal_error(refusal: Refused) -> HttpError:
    return _status_error(refusal.code, refusal.details, refusal.error)


def _weights_error(
    code: grpc.StatusCode,
    details: str,
    error: Exception | None,
    weights_field: str,
    body_fields: Iterable[str] = (),
) -> HttpError:
    """The HttpError of a failed weight update: its status code, or a 400 naming the fields of
    SGLang's body for the InvalidRequest behind it (``sglang.weight_violations``); SGLang's failure
    answer beside ours."""
    if isinstance(error, InvalidRequest):
        return _invalid(sglang.weight_violations(error, weights_field, body_fields), weights=True)
    return HttpError(HTTP_STATUS.get(code, 500), details, extra=_failed(details))


def _tensor_body_bytes(max_update_bytes: int) -> int:
    """The largest ``update_weights_from_tensor`` body: an update's bytes as base64 text, and room for
    the other fields."""
    return 4 * math.ceil(max_update_bytes / 3) + _WEIGHT_BODY_BYTES


def _verdict(actual: str | None, expected: str) -> str:
    return "missing" if actual is None else "match" if actual == expected else "mismatch"


def _some(names: list[str]) -> str:
    """The first few of ``names``, quoted, and how many more."""
    shown = ", ".join(quoted(name, 128) for name in names[:_NAMES_SHOWN])
    return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")


def _invalid(violations: list[dict[str, str]], weights: bool = False) -> HttpError:
    """A 400 for ``violations`` (named as the client named its fields); a weight endpoint's carries
    SGLang's failure answer too."""
    detail = "invalid request: " + "; ".join(f"{v['field']}: {v['description']}" for v in violations)
    return HttpError(400, detail, violations, _failed(detail) if weights else None)


def _failed(detail: str) -> dict:
    """SGLang's answer to a failed weight update, beside ours."""
    return {"success": False, "message": detail}


async def _read(request: Request, limit: int) -> bytearray:
    """The body's bytes, read only up to ``limit`` of them (413 beyond, from its length if it says)."""
    too_large = HttpError(413, f"the body is larger than the server's limit of {limit} bytes")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_large
    data = bytearray()  # grown in place: a body is held once, not as pieces and their join
    async for chunk in request.stream():
        if len(data) + len(chunk) > limit:
            raise too_large
        data += chunk
    return data


def _decoded(data: bytearray, request: Request) -> object:
    """A body's bytes decoded: JSON, or msgpack by content type; empty: an empty object. ``data`` is
    emptied as soon as it is decoded, so that a large body (a weight update's) is not held twice
    while it is parsed."""
    if not data:
        return {}
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if content_type in _MSGPACK_TYPES:
            return msgpack.unpackb(data, raw=False, strict_map_key=True)  # its limits follow len(data)
        text = data.decode(json.detect_encoding(data), "surrogatepass")  # as json.loads decodes bytes
        data.clear()  # before the text is parsed
        return json.loads(text)
    except (ValueError, RecursionError, msgpack.UnpackException) as error:  # a JSON or msgpack error
        kind = "msgpack" if content_type in _MSGPACK_TYPES else "JSON"
        reason = sglang.quoted_reason(error)
        raise HttpError(
            400, f"the body is not {kind}: {reason}", [{"field": "request", "description": reason}]
        ) from None
    finally:
        data.clear()


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return once the client has gone (its body already read, the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Answer(Response):
    """An answer handed to its connection a chunk at a time, and ``release`` called once it has left
    or its connection is gone. uvicorn's send waits while the connection's write buffer is above its
    high-water mark (64 KiB), so each chunk goes only once the client has taken those before it, and at
    the end at most that much of the answer is still in the process. A client that takes too little
    has its connection dropped after --stall-seconds (http_connection.py), which ends the wait."""

    def __init__(self, payload: bytes, release: Callable[[], None], headers: dict[str, str]):
        super().__init__(payload, media_type=MSGPACK, headers=headers)
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            for start in range(0, len(self.body), _ANSWER_CHUNK_BYTES):
                chunk = self.body[start : start + _ANSWER_CHUNK_BYTES]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.release()


class HttpFrontEnd:
    """The endpoints, over the admission and the engine client the gRPC front end uses too."""

    def __init__(
        self, admission: Admission, client: "EngineClient", tokens: TokenPolicy, max_response_bytes: int
    ):
        self.admission = admission
        self.client = client
        self.serving = admission.serving
        self.metrics = admission.metrics
        self.tokens = tokens
        self.max_response_bytes = max_response_bytes
        self.max_body_bytes = self.serving.max_request_bytes
        limits = self.serving.limits
        self.max_requests = limits.max_queued_requests + limits.max_waiting_requests + SPARE_REQUESTS
        self._requests = 0  # requests in progress, the health probes aside
        self._answer_bytes = 0  # the bounds of the answers being built or sent
        self._probe: asyncio.Future | None = None  # /health_generate's rollout: running, or its answer
        self._probe_ended_at = 0.0
        # The /rollout/generate rollouts running, by request id: /abort_request sets their events.
        self._aborts: dict[str, set[asyncio.Event]] = {}

    def app(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        """The ASGI application: the endpoints, at most ``max_requests`` requests at once besides the
        health probes (429 beyond: each holds a body, and the answer built or sent for it)."""
        routes = [
            Route("/rollout/generate", self._endpoint(self.generate, _ROLLOUT), methods=["POST"]),
            Route(
                "/update_weights_from_disk", self._endpoint(self.update_from_disk, _LOAD), methods=["POST"]
            ),
            Route(
                "/update_weights_from_tensor",
                self._endpoint(self.update_from_tensor, _UPDATE),
                methods=["POST"],
            ),
            Route(
                "/update_weights_from_tensor_checker",
                self._endpoint(self.check_tensors, _INFO),
                methods=["POST"],
            ),
            Route("/get_weights_checksum", self._endpoint(self.weights_checksum, _INFO), methods=["POST"]),
            Route(
                "/release_memory_occupation",
                self._endpoint(functools.partial(self.change_memory, release=True), _RELEASE),
                methods=["POST"],
            ),
            Route(
                "/resume_memory_occupation",
                self._endpoint(functools.partial(self.change_memory, release=False), _RESUME),
                methods=["POST"],
            ),
            Route("/abort_request", self._endpoint(self.abort, _ABORT), methods=["POST"]),
            Route("/health", self._endpoint(self.health, None), methods=["GET"]),
            Route("/health_generate", self._endpoint(self.health_generate, None), methods=["GET"]),
        ]
        endpoints = Starlette(routes=routes)

        async def bounded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] in _PROBES:
                return await endpoints(scope, receive, send)
            if self._requests >= self.max_requests:
                self.metrics.reject("overloaded")
                full = HttpError(
                    429,
                    f"{self._requests} HTTP requests are in progress, the server's limit "
                    "(--max-queued + --max-waiting + 8)",
                )
                return await full.response()(scope, receive, send)
            self._requests += 1
            try:
                await endpoints(scope, receive, send)
            finally:
                self._requests -= 1

        return bounded

    def _endpoint(self, handler, method: str | None):
        """``handler`` behind the token ``method`` needs, with every HttpError answered as JSON."""

        async def endpoint(request: Request) -> Response:
            try:
                if method is not None:
                    self._authorize(method, request.headers.get("authorization"))
                return await handler(request)
            except HttpError as error:
                return error.response()
            except ClientDisconnect:  # gone before its body was in (or closed for taking too long)
                return Response(status_code=499)  # nobody reads it

        return endpoint

    def _authorize(self, method: str, authorization: str | None) -> None:
        refusal = self.tokens.check(method, authorization)
        if refusal is not None:
            code, message = refusal
            log.info("refused %s over HTTP: %s", method, code.name)
            self.metrics.reject(code.name.lower())
            raise HttpError(HTTP_STATUS[code], message)

    def _rejected(self, error: InvalidRequest, weights: bool = False) -> HttpError:
        """The 400 of a body the front end itself refuses (its fields are SGLang's), counted and
        logged in one line as the service's rejections are."""
        rejection = _invalid(sglang.sglang_violations(error), weights)
        log.info("rejected over HTTP: %s", rejection.body["detail"])
        self.metrics.reject("invalid_argument")
        return rejection

    async def _body(self, request: Request, limit: int) -> object:
        """The decoded body (see ``_decoded``), read only up to ``limit`` bytes."""
        return _decoded(await _read(request, limit), request)

    async def generate(self, request: Request) -> Response:
        body = await self._body(request, self.max_body_bytes)
        try:
            typed = sglang.read_request(body, self.serving.limits.max_samples)
        except InvalidRequest as error:
            raise self._rejected(error) from None

        bound = 0

        def check(resolved: rollout_pb2.RolloutRequest) -> None:
            nonlocal bound
            bound = sglang.response_bound(typed, resolved, self.client.sample_sizes(resolved))
            if bound > self.max_response_bytes:
                reason = (
                    f"the answer would take up to {bound} bytes, above the server's "
                    f"--max-http-response-bytes of {self.max_response_bytes}: ask for fewer samples, "
                    "fewer returned steps (rollout_return_step_indices) or no debug tensors"
                )
                raise InvalidRequest([("samples_per_prompt", reason)])
            if self._answer_bytes + bound > self.max_response_bytes:
                raise Overloaded(
                    f"the HTTP answers in flight may take {self._answer_bytes} bytes; this one's "
                    f"{bound} would pass --max-http-response-bytes ({self.max_response_bytes})"
                )

        try:
            rid = sglang.rollout_id(typed.rid, self.serving.limits.max_request_id_chars)
            ours, ignored = sglang.to_rollout_request(typed, rid, self.serving)
            resolved, stream = await self.admission.admit(ours, check, sglang.RolloutAnswer)
        except InvalidRequest as error:
            raise self._rejected(error) from None
        except Refused as refusal:
            raise _refusal_error(refusal) from None
        headers = {}
        if ignored:  # accepted as SGLang accepts them, and said so
            summary = headers[sglang.IGNORED_HEADER] = sglang.ignored_summary(ignored)
            log.info("rollout id=%s over HTTP ignored %s", resolved.request_id, summary)
        # Held from here until the answer has left, or its client has.
        self._answer_bytes += bound
        release = functools.partial(self._release, bound)
        aborted = asyncio.Event()
        self._aborts.setdefault(resolved.request_id, set()).add(aborted)
        try:
            payload = await self._answer(request, typed, resolved, stream, aborted)
        except BaseException:
            release()
            raise
        finally:
            self._aborts[resolved.request_id].discard(aborted)
            if not self._aborts[resolved.request_id]:
                del self._aborts[resolved.request_id]
        if payload is None:  # the client left: nobody reads an answer
            release()
            return Response(status_code=499)
        return _Answer(payload, release, headers)

    def _release(self, nbytes: int) -> None:
        self._answer_bytes -= nbytes

    async def _answer(self, request, typed, resolved, stream, aborted: asyncio.Event) -> bytes | None:
        """Run the admitted rollout to its end, then encode its answer; None if its client left first,
        the aborted answer if ``aborted`` is set first."""
        submitted_at = time.perf_counter()
        outcome = "OK"
        collecting = asyncio.ensure_future(anext(stream))
        watching = asyncio.ensure_future(_disconnected(request.receive))
        aborting = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait({collecting, watching, aborting}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done() and aborting.done():
                outcome = "ABORTED"  # its rollout stops with the stream, which frees its place at once
                answers = sglang.aborted_responses(typed, resolved, time.perf_counter() - submitted_at)
                return msgpack.packb(answers, use_bin_type=True)
            if not collecting.done():
                outcome = "CANCELLED"  # the client left: its rollout stops with the stream
                return None
            answer = collecting.result()  # the one item: the rollout's events, once it has finished
        except asyncio.CancelledError:
            outcome = "CANCELLED"
            raise
        except Exception as error:  # noqa: BLE001 - each failure becomes the answer's status
            code, details = failure(f"request {resolved.request_id}", error)
            outcome = code.name
            raise _status_error(code, details, error) from None
        finally:
            for task in (collecting, watching, aborting):
                task.cancel()
            stream.close()  # the engine drops the rollout if it still runs
            self.admission.rollout_ended(resolved, submitted_at, outcome)
        seconds = time.perf_counter() - submitted_at
        answers = await asyncio.to_thread(sglang.responses, answer, typed, seconds)
        return await asyncio.to_thread(msgpack.packb, answers, use_bin_type=True)

    async def update_from_disk(self, request: Request) -> Response:
        body = await self._body(request, _WEIGHT_BODY_BYTES)
        try:
            load = sglang.load_weights_request(body, self.client.status().policy_version)
        except InvalidRequest as error:
            raise self._rejected(error, weights=True) from None
        return await self._updated(self.client.load_weights(load), "loaded", "model_path")

    async def update_from_tensor(self, request: Request) -> Response:
        """The tensors of the body (``sglang.tensor_update``), read once the update slot is held and
        decoded off the event loop, then checked and applied as an UpdateWeights stream's are. The
        fields read and not used are named in the answer's header and a log line."""
        client = self.client
        max_bytes = client.max_update_bytes
        ignored: list[str] = []

        def update_of(data: bytearray) -> "WeightUpdate":
            update, unused = sglang.tensor_update(
                _decoded(data, request),
                client.status().policy_version,
                max_bytes,
                client.transformers,
                client.module_names,
            )
            ignored.extend(unused)
            return update

        async def received() -> "WeightUpdate":
            return await asyncio.to_thread(update_of, await _read(request, _tensor_body_bytes(max_bytes)))

        fields = (payload.FIELD, sglang.TENSOR_UPDATE_FIELDS)
        answer = await self._updated(self.client.update_weights(received), "updated", *fields)
        if ignored:  # accepted as SGLang accepts them, and said so
            summary = answer.headers[sglang.IGNORED_HEADER] = sglang.ignored_summary(ignored)
            log.info("weight update over HTTP ignored %s", summary)
        return answer

    async def _updated(
        self, work: Awaitable[dict], verb: str, weights_field: str, body_fields: Iterable[str] = ()
    ) -> Response:
        """SGLang's answer to a weight update once ``work`` has applied it, or the 4xx of its failure,
        naming the fields of the body (``sglang.weight_violations``)."""
        try:
            applied = await work
        except (HttpError, ClientDisconnect):  # the body's own: answered by _endpoint
            raise
        except Refused as refusal:
            raise _weights_error(
                refusal.code, refusal.details, refusal.error, weights_field, body_fields
            ) from None
        except Exception as error:  # noqa: BLE001 - each failure becomes the answer's status
            code, details = self.client.update_failed(error)
            raise _weights_error(code, details, error, weights_field, body_fields) from None
        message = (
            f"{verb} {applied['tensors']} tensors ({applied['bytes']} bytes) as policy version "
            f"{applied['policy_version']}"
        )
        return JSONResponse({"success": True, "message": message, **applied})

    async def check_tensors(self, request: Request) -> Response:
        """SGLang's answer, ``success`` and ``message``, on whether the module serves each named tensor
        with the expected SHA-256 (``checksum.tensor_sha256``); beside it the verdict per tensor
        (match, mismatch, missing) and the policy version checked. 200 if all match, else 400."""
        body = await self._body(request, HEADER_ALLOWANCE_BYTES)
        try:
            target, expected = sglang.checker_request(body)
            check_target(target, self.client.transformers, "target_module")
        except InvalidRequest as error:
            raise self._rejected(error) from None
        try:
            version, actual = await self.client.tensor_sha256(target, expected)
        except Refused as refusal:
            raise _status_error(refusal.code, refusal.details) from None
        verdicts = {name: _verdict(actual.get(name), digest) for name, digest in expected.items()}
        wrong = {
            verdict: [name for name, given in verdicts.items() if given == verdict]
            for verdict in ("mismatch", "missing")
        }
        success = not any(wrong.values())
        module = f"{quoted(target)} at policy version {version}"
        if success:
            message = f"{module} serves the {len(expected)} tensors as expected"
        else:
            found = "; ".join(
                f"{len(names)} {verdict}: {_some(names)}" for verdict, names in wrong.items() if names
            )
            message = f"{module} does not serve the tensors expected: {found}"
        answer = {"success": success, "message": message, "tensors": verdicts, "policy_version": version}
        return JSONResponse(answer, 200 if success else 400)

    async def weights_checksum(self, request: Request) -> Response:
        body = await self._body(request, _WEIGHT_BODY_BYTES)
        try:
            names = sglang.checksum_modules(body)
        except InvalidRequest as error:
            raise self._rejected(error) from None
        served = self.client.status().transformer_checksums
        return JSONResponse({name: served.get(name, "not_found") for name in (names or served)})

    async def change_memory(self, request: Request, release: bool) -> Response:
        """SGLang's release and resume of the weights' memory; its answer (``success``, ``sleeping``,
        ``message``) with ours beside it (gRPC's MemoryResidency)."""
        body = await self._body(request, _WEIGHT_BODY_BYTES)
        try:
            sglang.memory_tags(body)  # checked: every tag moves the whole of the weights' memory
        except InvalidRequest as error:
            raise self._rejected(error, weights=True) from None
        try:
            residency = await self.client.change_memory(release)
        except Refused as refusal:
            raise _weights_error(refusal.code, refusal.details, refusal.error) from None
        except Exception as error:  # noqa: BLE001 - each failure becomes the answer's status
            code, details = self.client.update_failed(error)
            raise _weights_error(code, details, error) from None
        fields = {field.name: getattr(residency, field.name) for field in residency.DESCRIPTOR.fields}
        state = "released" if residency.released else "resident"
        message = f"the weights' memory is {state}" + ("" if residency.changed else " already")
        return JSONResponse({"success": True, "sleeping": residency.released, "message": message, **fields})

    async def abort(self, request: Request) -> Response:
        """SGLang's abort: every ``/rollout/generate`` rollout whose request id is ``rid`` (or every one,
        with ``abort_all``) stops and answers at once; 200 whatever matched, as SGLang answers."""
        body = await self._body(request, _WEIGHT_BODY_BYTES)
        try:
            rid, abort_all = sglang.abort_request(body, self.serving.limits.max_request_id_chars)
        except InvalidRequest as error:
            raise self._rejected(error) from None
        matched = [
            event
            for key, events in self._aborts.items()
            if abort_all or (rid and key == rid)
            for event in events
        ]
        for event in matched:
            event.set()
        named = "every rollout" if abort_all else f"rid {quoted(rid)}"
        log.info("abort of %s: %d HTTP rollouts", named, len(matched))
        return JSONResponse({"aborted": len(matched)})

    async def health(self, request: Request) -> Response:
        if self.client.shutting_down:
            raise HttpError(503, "server is shutting down")
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """Healthy once a one-step rollout of the smallest size has gone through the model. Probes
        share one such rollout: those that come while it runs wait for it, and its answer serves those
        of the next PROBE_REUSE_SECONDS. A flood of probes costs one small rollout per period and
        holds at most one queue place."""
        reusable = self._probe is not None and (
            not self._probe.done() or time.monotonic() - self._probe_ended_at <= PROBE_REUSE_SECONDS
        )
        if not reusable:
            self._probe = asyncio.ensure_future(self._probe_rollout())
        failure = await asyncio.shield(self._probe)  # a caller that leaves leaves it to the others
        return Response(status_code=200) if failure is None else failure.response()

    async def _probe_rollout(self) -> HttpError | None:
        """Run /health_generate's rollout: None if it went through, else the answer's error."""
        model = self.serving.model
        side = model.min_side  # the smallest size the model takes (LTX-2's decoder needs 2 x 2 latents)
        probe = rollout_pb2.RolloutRequest(
            prompts=["health"],
            num_steps=model.min_steps,
            height=side,
            width=side,
            sampler=rollout_pb2.SAMPLER_TYPE_ODE,
            latents=rollout_pb2.LATENT_SELECTION_NONE,
            images=False,
        )
        if model.max_frames > 1:
            probe.num_frames = 1
        try:
            try:
                resolved, stream = await self.admission.admit(probe)
            except Refused as refusal:
                return _refusal_error(refusal)
            submitted_at, outcome = time.perf_counter(), "OK"
            try:
                async for _ in stream:
                    pass
            except Exception as error:  # noqa: BLE001 - an unhealthy model is the answer
                code, details = failure("health_generate", error)
                outcome = code.name
                return _status_error(code, details)
            finally:
                stream.close()
                self.admission.rollout_ended(resolved, submitted_at, outcome)
            return None
        finally:
            self._probe_ended_at = time.monotonic()


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handlers: the rollout server owns SIGINT and SIGTERM."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """The HTTP front end on a port: ``await start()``, then ``await stop()``."""

    def __init__(
        self, front_end: HttpFrontEnd, host: str, port: int, tls: ServerTLS | None, read_seconds: float
    ):
        try:
            self._socket = socket.create_server((host.strip("[]"), port), family=_family(host), backlog=2048)
        except OSError as error:
            raise StartupError(f"cannot serve HTTP on {host}:{port}: {error.strerror or error}") from None
        self.port = self._socket.getsockname()[1]
        scheme = "https" if tls else "http"
        self.address = f"{scheme}://{host}:{self.port}"
        # No limit_concurrency: uvicorn would count idle connections against it and answer even
        # /health with 503; the front end counts requests instead, and each connection has a deadline
        # for its request and for an answer it does not take.
        protocol = functools.partial(
            BoundedH11Protocol,
            read_seconds=read_seconds,
            write_seconds=front_end.serving.limits.stall_seconds,
        )
        config = uvicorn.Config(
            front_end.app(),
            http=protocol,
            ws="none",
            interface="asgi3",
            log_config=None,
            log_level="warning",  # our own lines say what it serves; its errors still show
            access_log=False,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=2,
            h11_max_incomplete_event_size=64 * 1024,  # headers
            **(_tls_options(tls) if tls else {}),
        )
        self._server = _Server(config)
        self._task: asyncio.Future | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise StartupError(f"the HTTP server on port {self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Close the listener; open connections get uvicorn's graceful period to end."""
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tls_options(tls: ServerTLS) -> dict:
    """uvicorn's TLS settings from the files the gRPC server reads (mutual TLS with a client CA)."""
    options = {"ssl_certfile": str(tls.cert_path), "ssl_keyfile": str(tls.key_path)}
    if tls.client_ca_path is not None:
        options.update(ssl_ca_certs=str(tls.client_ca_path), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
