"""The HTTP server protocol kvgate runs: uvicorn's httptools protocol with a deadline for each
request's line and headers.

uvicorn times a connection only while it is idle between requests (the keep-alive timeout);
a client that opens a connection and sends its request line and headers slowly, or never
finishes them, would hold the connection and its buffers for as long as it likes. Here each
request's headers must be complete within `header_timeout` seconds of the request's first
byte (or of the connection being opened), or the connection is closed.

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

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvgate.asgi import ABORT, ON_DISCONNECT


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` closing connections whose headers do not arrive in time, and calling
    a request's disconnect hook when its client leaves before the response is complete."""

    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[ON_DISCONNECT] = None  # type: ignore[literal-required]
        self.scope[ABORT] = self._abort  # type: ignore[literal-required]
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
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


def use_header_timeout(seconds: float) -> None:
    """Set the header deadline of this process's connections (each worker process sets its
    own from the config it loads; the class is passed to uvicorn by reference)."""
    HeaderDeadlineProtocol.header_timeout = seconds
