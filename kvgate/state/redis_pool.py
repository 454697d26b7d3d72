"""A bounded Redis connection pool that closes connections a burst left idle.

redis-py's `BlockingConnectionPool` caps the connections (callers wait for a free one) but
keeps every connection it ever opened, so a process holds as many sockets as its busiest
instant needed. This pool also remembers when each connection was last released and closes
those idle for longer than a given time, beyond the `keep_idle` most recently used.
"""

from __future__ import annotations

import contextlib
import time

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisError


class IdleClosingPool(aioredis.BlockingConnectionPool):
    """At most `max_connections` connections; `get_connection` waits up to `timeout` seconds
    for one to be free, then raises `redis.exceptions.ConnectionError`."""

    def __init__(self, *, keep_idle: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.keep_idle = keep_idle
        self._released_at: dict[AbstractConnection, float] = {}

    async def release(self, connection: AbstractConnection) -> None:
        self._released_at[connection] = time.monotonic()
        await super().release(connection)

    @property
    def open_connections(self) -> int:
        """Connections the pool holds, idle or in use (each may hold a socket)."""
        return len(self._available_connections) + len(self._in_use_connections)

    async def close_idle(self, idle_for: float) -> int:
        """Close and forget the idle connections last used more than `idle_for` seconds ago,
        except the `keep_idle` most recently used; returns how many were closed."""
        cutoff = time.monotonic() - idle_for
        # redis-py's idle list (a private attribute, the same in redis-py 5 to 8) is a stack:
        # the newest release on top, so the oldest come first. Taken out before any await, so
        # no caller can be handed one while it closes.
        idle = self._available_connections
        spare = idle[: max(0, len(idle) - self.keep_idle)]
        stale = [c for c in spare if self._released_at.get(c, 0.0) < cutoff]
        for connection in stale:
            idle.remove(connection)
            self._released_at.pop(connection, None)
        for connection in stale:
            with contextlib.suppress(RedisError, OSError):
                await connection.disconnect()
        return len(stale)
