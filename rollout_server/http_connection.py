"""The HTTP front end's connections: uvicorn's h11 protocol, with bounds on what a silent peer may hold,
and a half-close told apart from a disconnect.

* **Reading.** A request, its headers and its body, must arrive whole within ``read_seconds`` of the
  connection's opening or of the previous answer's end; a connection whose request is not in by then
  is closed (a request whose body was being read sees its client gone). uvicorn arms no timer at all
  before a connection's first request, so a peer that never sent a byte held its connection for good.
  Its keep-alive timeout (5 s) still closes a connection idle between requests sooner.
* **Writing.** An answer the peer does not take: once the connection's write buffer has stayed above
  its high-water mark (64 KiB) for ``write_seconds`` (the server's --stall-seconds), the peer took too
  little of it for that long and the connection is dropped. It is aborted, not closed: a close waits
  for the buffer to drain, which a peer that does not read never lets happen.
* **Half-close.** A peer that shuts down its sending side after its whole request (``shutdown(SHUT_WR)``)
  still gets its answer: the end of its input is not a disconnect. TCP tells a half-closed socket from a
  closed one only when the server writes to it (a closed one answers with a reset), so while the answer
  is pending the connection is probed with an interim ``100 Continue`` every ``PEER_PROBE_SECONDS``,
  which HTTP/1.1 clients skip: once the peer has reset the connection the next probe fails, the
  connection is lost, and the request sees its client gone (a rollout is cancelled). asyncio's TLS
  transport cannot half-close, so over TLS (and for HTTP/1.0 clients, which take no 1xx answer) the end
  of the input still ends the connection.
"""

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("rollout_server.http")
# How often a half-closed peer whose answer is pending is probed.
PEER_PROBE_SECONDS = 1.0
# The states in which the peer is still sending its request: idle (nothing, or part of the headers)
# or in its body.
_READING = (h11.IDLE, h11.SEND_BODY)
# The peer's states once its request is in whole.
_REQUEST_IN = (h11.DONE, h11.MUST_CLOSE)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request, one on a write the peer does not
    take, and half-closes served (see the module docstring). Pass it to uvicorn as
    ``functools.partial(BoundedH11Protocol, read_seconds=..., write_seconds=...)``."""

    def __init__(self, *args, read_seconds: float, write_seconds: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_seconds = read_seconds
        self.write_seconds = write_seconds
        self._read_deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None
        self._peer_probe: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._read_deadline, self._write_deadline, self._peer_probe):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()

    # Reading

    def _await_request(self) -> None:
        """The next request must be in whole within ``read_seconds`` from now."""
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        self._read_deadline = self.loop.call_later(self.read_seconds, self._request_overdue)

    def _request_overdue(self) -> None:
        self._read_deadline = None
        if self.conn.their_state in _READING and not self.transport.is_closing():
            self.transport.close()

    # Writing

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.write_seconds, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _write_stalled(self) -> None:
        self._write_deadline = None
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.info(
            "HTTP connection of %s dropped: it took too little of its answer for %g s (--stall-seconds)",
            peer,
            self.write_seconds,
        )
        self.transport.abort()

    # Half-close

    def eof_received(self) -> bool | None:
        """Keep the connection open for the answer (True) when the peer's request is in whole and its
        answer still to come, over plain HTTP/1.1; otherwise let the transport close (None)."""
        cycle = self.cycle
        if (
            cycle is None
            or cycle.response_complete
            or self.conn.their_state not in _REQUEST_IN
            or self.scheme != "http"
            or self.scope["http_version"] == "1.0"
        ):
            return super().eof_received()
        cycle.keep_alive = False  # the peer sends no further request
        self._probe_peer()
        return True

    def _probe_peer(self) -> None:
        """Write an interim 100 Continue while the answer has not started: to a peer that has closed
        its socket, the second such write fails and the connection is lost."""
        self._peer_probe = None
        if self.transport.is_closing() or self.cycle.response_started:
            return  # the answer's own writes tell from now on
        interim = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")
        self.transport.write(self.conn.send(interim))
        self._peer_probe = self.loop.call_later(PEER_PROBE_SECONDS, self._probe_peer)
