"""The data-path HTTP client: POST a request to an engine over a pooled HTTP/1.1 connection and
hand back its answer as it arrives (the `/v1/responses/{id}` routes also GET and others).

Why its own client on httptools and not a general one: the data path needs exactly one thing
(a POST with a body in memory, an answer streamed back, keep-alive) and pays for every layer
on every request. Measured on the 2-core CI machine: httpx/httpcore spent 1.2 to 3.1 ms of CPU
per proxied request (pure-Python parsing, anyio layers, a pool that polls every idle
connection), aiohttp about 0.23 ms, this client about 0.06 ms in isolation (the C parser
uvicorn serves with, one write per request, no per-request timeout contexts). httpx stays for
the control plane (health checks, discovery, telemetry). The wire work is in
kvgate/upstream/h1_connection.py, the pool in kvgate/upstream/connection_pool.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

from kvgate.config import UpstreamConfig
from kvgate.types import Headers
from kvgate.upstream.connection_pool import ConnectionPool, Origin
from kvgate.upstream.h1_connection import (
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    H1Connection,
    PoolExhausted,
    TransportError,
)

__all__ = [
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionLost",
    "PoolExhausted",
    "TransportError",
    "UpstreamResponse",
    "UpstreamTransport",
]

_DEFAULT_PORTS = {"http": 80, "https": 443}
# Parsed POST targets kept: endpoints x inference paths, and a cancel's path per response
# cancelled, which the bound clears now and then (a target costs microseconds to parse again).
_MAX_TARGETS = 4096


class UpstreamResponse:
    """An engine's answer whose body is read on demand. `close()` must be called on every
    path: before the body is fully read it closes the connection, which aborts generation on
    the engine; after, it returns the connection to the pool."""

    __slots__ = ("_conn", "_pool")

    def __init__(self, conn: H1Connection, pool: ConnectionPool) -> None:
        self._conn: H1Connection | None = conn
        self._pool = pool

    @property
    def status(self) -> int:
        assert self._conn is not None
        return self._conn.status

    @property
    def headers(self) -> Mapping[str, str]:
        """Lower-case names."""
        assert self._conn is not None
        return self._conn.headers

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, undecoded."""
        assert self._conn is not None
        while (chunk := await self._conn.next_chunk()) is not None:
            yield chunk

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body, or its first `limit` bytes."""
        assert self._conn is not None
        parts = []
        size = 0
        while limit is None or size < limit:
            chunk = await self._conn.next_chunk()
            if chunk is None:
                break
            parts.append(chunk)
            size += len(chunk)
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        return body if limit is None else body[:limit]

    def close(self) -> None:
        if self._conn is not None:
            self._pool.release(self._conn)
            self._conn = None


class UpstreamTransport:
    """Keep-alive pool to every engine, bounded by `max_connections`. Only connect (and pool
    wait) is timed here; first-token, stall and total deadlines belong to the relay."""

    def __init__(self, config: UpstreamConfig, connect_timeout: float) -> None:
        self.config = config
        self.connect_timeout = connect_timeout
        self._pool = ConnectionPool(config)
        self._targets: dict[str, tuple[Origin, bytes]] = {}

    async def open(
        self,
        url: str,
        headers: Headers,
        body: bytes,
        connect_timeout: float | None = None,
        method: bytes = b"POST",
    ) -> UpstreamResponse:
        """Send `body` with `method` (the `/v1/responses/{id}` routes send others than POST)
        and return once the response status and headers arrived."""
        if method == b"POST":
            target = self._targets.get(url) or self._parse(url)
        else:
            target = self._parse(url, method)
        origin, head_start = target
        head = b"".join(
            [
                head_start,
                b"content-length: %d\r\n" % len(body),
                *[name + b": " + value + b"\r\n" for name, value in headers],
                b"\r\n",
            ]
        )
        limit = self.connect_timeout if connect_timeout is None else connect_timeout
        conn = await self._pool.acquire(origin, limit)
        try:
            await conn.exchange(head, body)
        except BaseException:
            conn.close()  # cancelled (a deadline, the client left) or broken: never reused
            raise
        return UpstreamResponse(conn, self._pool)

    def _parse(self, url: str, method: bytes = b"POST") -> tuple[Origin, bytes]:
        """The engine's address and the request line and Host header for `method` on `url`
        (kept for a POST)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        name = f"[{host}]" if ":" in host else host  # an IPv6 literal keeps its brackets
        host_header = name if port == _DEFAULT_PORTS[parts.scheme] else f"{name}:{port}"
        line = f"{method.decode()} {path} HTTP/1.1\r\nhost: {host_header}\r\n".encode("latin-1")
        target = (Origin(parts.scheme, host, port), line)
        if method == b"POST":
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            self._targets[url] = target
        return target

    async def aclose(self) -> None:
        await self._pool.close()
