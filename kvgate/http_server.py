"""The HTTP server protocol kvgate runs: uvicorn's httptools protocol with a deadline and a size
limit for each request's line and headers.

uvicorn times a connection only while it is idle between requests (the keep-alive timeout),
and bounds neither the time nor the bytes of a request's headers: a client that sends them
slowly, never finishes them, or sends hundreds of megabytes of them, would hold the
connection and fill the process's memory as it likes (no key is needed: headers come before
authentication). Here each request's headers must be complete within `header_timeout` seconds
of the request's first byte (or of the connection being opened), or the connection is closed;
and within `max_header_bytes`, or the client gets 431 and the connection is closed.

It also calls the request's `ON_DISCONNECT` hook (`kvgate/asgi.py`) when the connection is
lost before the response is complete, so the app learns that its client left without a task
per request waiting in `receive()`, and gives the app an `ABORT` hook to drop a connection
whose client stopped reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import cast

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvgate.asgi import ABORT, ON_DISCONNECT


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` closing connections whose headers do not arrive in time, and calling
    a request's disconnect hook when its client leaves before the response is complete."""

    header_timeout = 10.0
    max_header_bytes = 64 * 1024
    _header_timer: asyncio.TimerHandle | None = None
    # Bytes received since the current request began while its headers are incomplete (None:
    # between requests, or once they are complete).
    _header_bytes: int | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_bytes is None:
            return
        self._header_bytes += len(data)
        if self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._disarm()
            self.transport.write(_HEADERS_TOO_LARGE)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self.scope[ON_DISCONNECT] = None  # type: ignore[literal-required]
        self.scope[ABORT] = self._abort  # type: ignore[literal-required]
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._header_bytes = None
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # lost before the response was complete
            scope = cycle.scope
            hook = cast("Callable[[], None] | None", scope.get(ON_DISCONNECT))
            if hook is not None:
                scope[ON_DISCONNECT] = None  # type: ignore[literal-required]
                hook()

    def _abort(self) -> None:
        """Drop the connection now, with a reset: what the kernel still holds for a client
        that stopped reading is discarded, not trickled out to it."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if self.cycle is not None:
            self.cycle.disconnected = True  # the answer ends here, on purpose
        self.transport.abort()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def use_header_limits(seconds: float, max_bytes: int) -> None:
    """Set the header deadline and size limit of this process's connections (each worker
    process sets its own from the config it loads; the class is passed to uvicorn by
    reference)."""
    HeaderDeadlineProtocol.header_timeout = seconds
    HeaderDeadlineProtocol.max_header_bytes = max_bytes


_HEADERS_TOO_LARGE_BODY = orjson.dumps(
    {
        "error": {
            "message": "the request's headers are too large",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_header_fields_too_large",
        }
    }
)
_HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n"
    % len(_HEADERS_TOO_LARGE_BODY)
    + _HEADERS_TOO_LARGE_BODY
)
