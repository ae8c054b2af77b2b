"""The HTTP front end's connections: uvicorn's h11 protocol, with bounds on what a silent peer may hold.

* **Reading.** A request, its headers and its body, must arrive whole within ``read_seconds`` of the
  connection's opening or of the previous answer's end; a connection whose request is not in by then
  is closed (a request whose body was being read sees its client gone). uvicorn arms no timer at all
  before a connection's first request, so a peer that never sent a byte held its connection for good.
  Its keep-alive timeout (5 s) still closes a connection idle between requests sooner.
"""

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# The states in which the peer is still sending its request: idle (nothing, or part of the headers)
# or in its body.
_READING = (h11.IDLE, h11.SEND_BODY)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request (see the module docstring). Pass
    it to uvicorn as ``functools.partial(BoundedH11Protocol, read_seconds=...)``."""

    def __init__(self, *args, read_seconds: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_seconds = read_seconds
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
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
