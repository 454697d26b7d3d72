"""One HTTP/1.1 connection to an engine: the request written in one go, the answer parsed by
httptools (the C parser uvicorn serves with) as its bytes arrive.

A connection carries one exchange at a time: `exchange` writes the request and returns once
the status line and headers arrived; `next_chunk` then hands out the body (de-chunked or
content-length framed, or delimited by the close) in the pieces it arrived in. Reading pauses
while more than `_HIGH_WATER` bytes wait for the consumer, so a slow client holds back the
engine's socket rather than the gateway's memory.

Its failures are `TransportError`s, worded for clients (no library names):

    TransportError                the engine could not be reached or the connection broke
    ├── ConnectFailed             refused, unreachable, DNS, TLS handshake
    ├── ConnectTimeout            no connection (new or pooled) in time
    └── ConnectionLost            the connection closed or broke while sending or reading
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import httptools

_HIGH_WATER = 256 * 1024
# The names engines send (uvicorn writes them in lower case), as one shared string each: no
# decoding per answer, no copy per held stream.
_NAMES = {
    name.encode(): name
    for name in (
        "content-type",
        "content-length",
        "transfer-encoding",
        "date",
        "server",
        "connection",
        "retry-after",
        "x-request-id",
    )
}


class TransportError(Exception):
    pass


class ConnectFailed(TransportError):
    pass


class ConnectTimeout(TransportError):
    pass


class PoolExhausted(TransportError):
    """Every one of the gateway's upstream connections (`upstream.max_connections`) stayed in
    use: the gateway's own limit, not the engine's failure."""


class ConnectionLost(TransportError):
    pass


class H1Connection(asyncio.Protocol):
    """The protocol of one pooled connection. `on_closed` is called once, when the socket is
    gone (whoever closed it)."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_failure",
        "_framed",
        "_head",
        "_informational",
        "_keep_alive",
        "_on_closed",
        "_parser",
        "_paused",
        "_transport",
        "_waiter",
        "closed",
        "counted",
        "headers",
        "idle_since",
        "origin",
        "pooled",
        "status",
    )

    def __init__(self, origin: Any, on_closed: Callable[[H1Connection], None]) -> None:
        self.origin = origin
        self.closed = False
        # The pool's bookkeeping: when it went idle, whether it is idle in the pool, whether
        # it holds one of the pool's `max_connections` places.
        self.idle_since = 0.0
        self.pooled = False
        self.counted = False
        self._on_closed = on_closed
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []  # not a deque: that allocates 0.7 KB per connection
        self._buffered = 0
        self._paused = False
        self._informational = False
        self._framed = False
        self._complete = False
        self._keep_alive = False
        # Why the exchange failed. Each reader gets a new ConnectionLost with it: an exception
        # kept here once raised would hold, through its traceback, the frames of the request
        # that read it (a reference cycle with this connection in it).
        self._failure: str | None = None
        self.status = 0
        self.headers: dict[str, str] = {}

    @property
    def reusable(self) -> bool:
        """The last answer was read to its end and the engine keeps the connection open."""
        return self._keep_alive and not self.closed

    def close(self) -> None:
        """Close the socket (the engine sees the client leave and stops generating)."""
        if self._transport is not None and not self.closed:
            self.closed = True
            self._transport.close()

    async def exchange(self, head: bytes, body: bytes) -> None:
        """Send one request; return once the answer's status and headers are in."""
        if self.closed or self._transport is None:
            raise ConnectionLost("the engine closed the connection")
        self._parser = httptools.HttpResponseParser(self)
        self._chunks.clear()
        self._buffered = 0
        self._complete = self._keep_alive = self._framed = self._informational = False
        self._failure = None
        self.status = 0
        self.headers = {}
        self._head = asyncio.get_running_loop().create_future()
        self._transport.writelines((head, body))
        await self._head
        if self._failure is not None and not self.status:
            raise ConnectionLost(self._failure)

    async def next_chunk(self) -> bytes | None:
        """The body bytes received since the last call (waiting for some if none), or None
        once the body is complete. Bytes that arrived before a failure come out first."""
        while not self._chunks:
            if self._failure is not None:
                raise ConnectionLost(self._failure)
            if self._complete:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        chunks = self._chunks
        chunk = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunk

    def _wake(self) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, reason: str) -> None:
        if self._failure is None and not self._complete:
            self._failure = reason
        self._wake()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's subclass no asyncio type

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._parser is not None and self.status and not self._framed:
            self._complete = True  # a body without length or chunking ends with the connection
        elif self.status:
            self._fail("the engine's answer was cut short")
        elif isinstance(exc, OSError) and exc.strerror:
            self._fail(exc.strerror.lower())
        else:
            self._fail("the engine closed the connection")
        self._wake()
        self._on_closed(self)

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self._complete:  # nothing asked: not an answer to us
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._fail("the engine's answer is not valid HTTP/1.1")
            self.close()
            return
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        key = _NAMES.get(name) or name.decode("latin-1").lower()
        text = value.decode("latin-1")
        known = self.headers.get(key)
        self.headers[key] = text if known is None else f"{known}, {text}"

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if status < 200:  # 100 Continue and friends: the answer proper follows
            self._informational = True
            self.headers = {}
            return
        self.status = status
        self._framed = "content-length" in self.headers or "chunked" in self.headers.get(
            "transfer-encoding", ""
        )
        if status in (204, 304):
            self._framed = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        assert self._parser is not None
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()  # reset once the call returns
        self._wake()
