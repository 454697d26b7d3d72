"""Keep-alive connections to the engines, shared by every request of the process.

At most `max_connections` sockets are open at once (in use, idle or connecting, all engines
together); a request that needs a new one beyond that closes an idle connection to another
engine if there is one, else waits for a connection to close. At most
`max_keepalive_connections` wait idle; an idle connection is reused newest first and never
after `keepalive_expiry` seconds (kept below the engines' own idle timeout, so the gateway
never writes to a connection the engine is closing), and one timer closes the expired ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from typing import NamedTuple

from kvgate.config import UpstreamConfig
from kvgate.upstream.h1_connection import (
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    H1Connection,
    PoolExhausted,
)

_CLOSE_GRACE = 1.0  # seconds `close` waits for the sockets it closed to be gone


class Origin(NamedTuple):
    scheme: str
    host: str
    port: int


class ConnectionPool:
    """`acquire` a connection, `release` it after its answer (closed when not reusable)."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._idle: dict[Origin, list[H1Connection]] = {}
        self._idle_count = 0
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._tls: ssl.SSLContext | None = None
        self._closed = False
        self._all_gone: asyncio.Future[None] | None = None

    async def acquire(self, origin: Origin, connect_timeout: float) -> H1Connection:
        """A live connection to `origin`: the newest idle one, or a new one within
        `connect_timeout` (connecting) and twice that (waiting for room, then connecting)."""
        conn = self._reuse(origin)
        if conn is not None:
            return conn
        waiting = False
        try:
            async with asyncio.timeout(connect_timeout * 2):
                while self._open >= self.config.max_connections:
                    waiting = True
                    self._evict_oldest()  # if one is idle, its place frees once it is gone
                    waiter = asyncio.get_running_loop().create_future()
                    self._waiters.append(waiter)
                    await waiter
                    conn = self._reuse(origin)
                    if conn is not None:
                        return conn
                waiting = False
                self._open += 1
                try:
                    async with asyncio.timeout(connect_timeout):
                        conn = await self._connect(origin)
                except BaseException:
                    self._open -= 1
                    self._wake_one()
                    raise
                conn.counted = True
                return conn
        except TimeoutError:
            if waiting:
                raise PoolExhausted(
                    f"all {self.config.max_connections} upstream connections stayed in use"
                ) from None
            raise ConnectTimeout("no upstream connection (new or pooled) in time") from None
        except OSError:
            raise ConnectFailed("could not connect to the engine") from None

    def _reuse(self, origin: Origin) -> H1Connection | None:
        if self._closed:
            raise ConnectionLost("the gateway is shutting down")
        idle = self._idle.get(origin)
        if not idle:
            return None
        fresh_since = asyncio.get_running_loop().time() - self.config.keepalive_expiry
        while idle:
            conn = idle.pop()
            self._idle_count -= 1
            conn.pooled = False
            if conn.idle_since > fresh_since:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin) -> H1Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        _, conn = await loop.create_connection(
            lambda: H1Connection(origin, self._forget),
            origin.host,
            origin.port,
            ssl=tls,
            server_hostname=origin.host if tls is not None else None,
        )
        return conn

    def release(self, conn: H1Connection) -> None:
        """Back to the pool after an answer read to its end, or closed if it cannot be kept."""
        if (
            not conn.reusable
            or self._closed
            or self._idle_count >= self.config.max_keepalive_connections
        ):
            conn.close()
            return
        loop = asyncio.get_running_loop()
        conn.idle_since = loop.time()
        conn.pooled = True
        self._idle.setdefault(conn.origin, []).append(conn)
        self._idle_count += 1
        self._wake_one()  # a request waiting for room may use it, or close it to make room
        if self._sweep is None:
            self._sweep = loop.call_later(self.config.keepalive_expiry, self._close_expired)

    def _forget(self, conn: H1Connection) -> None:
        """A socket is gone: its slot is free, and it is no longer idle."""
        if conn.pooled:
            self._evict(conn)
        if conn.counted:
            conn.counted = False
            self._open -= 1
            self._wake_one()
            if not self._open and self._all_gone is not None and not self._all_gone.done():
                self._all_gone.set_result(None)

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _evict(self, conn: H1Connection) -> None:
        """Out of the idle pool, and closed."""
        conn.pooled = False
        self._idle[conn.origin].remove(conn)
        self._idle_count -= 1
        conn.close()

    def _evict_oldest(self) -> None:
        """Close the longest idle connection (to any engine), if any."""
        oldest: H1Connection | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is not None:
            self._evict(oldest)

    def _close_expired(self) -> None:
        self._sweep = None
        loop = asyncio.get_running_loop()
        horizon = loop.time() - self.config.keepalive_expiry
        for conns in list(self._idle.values()):
            for conn in [c for c in conns if c.idle_since <= horizon]:
                self._evict(conn)
        if self._idle_count:
            self._sweep = loop.call_later(self.config.keepalive_expiry, self._close_expired)

    async def close(self) -> None:
        """Close every idle connection and wait (up to a second) until every socket is gone;
        a connection still in use closes when its answer does."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conns in list(self._idle.values()):
            for conn in list(conns):
                self._evict(conn)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionLost("the gateway is shutting down"))
        if self._open:
            self._all_gone = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CLOSE_GRACE):
                    await self._all_gone
