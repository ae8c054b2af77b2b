"""The HTTP front end's connections: uvicorn's h11 protocol, with bounds on what a silent peer may hold.

* **Reading.** A request, its headers and its body, must arrive whole within ``read_seconds`` of the
  connection's opening or of the previous answer's end; a connection whose request is not in by then
  is closed (a request whose body was being read sees its client gone). uvicorn arms no timer at all
  before a connection's first request, so a peer that never sent a byte held its connection for good.
  Its keep-alive timeout (5 s) still closes a connection idle between requests sooner.
* **Writing.** An answer the peer does not take: once the connection's write buffer has stayed above
  its high-water mark (64 KiB) for ``write_seconds`` (the server's --stall-seconds), the peer took too
  little of it for that long and the connection is dropped. It is aborted, not closed: a close waits
  for the buffer to drain, which a peer that does not read never lets happen.
"""

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("rollout_server.http")
# The states in which the peer is still sending its request: idle (nothing, or part of the headers)
# or in its body.
_READING = (h11.IDLE, h11.SEND_BODY)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request, and one on a write the peer does
    not take (see the module docstring). Pass it to uvicorn as
    ``functools.partial(BoundedH11Protocol, read_seconds=..., write_seconds=...)``."""

    def __init__(self, *args, read_seconds: float, write_seconds: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_seconds = read_seconds
        self.write_seconds = write_seconds
        self._read_deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._read_deadline, self._write_deadline):
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
