"""One guarded way to talk to Redis: short timeouts and a breaker, so a slow or lost Redis costs
at most one timeout before every caller falls back to local state."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("kvgate.state")
T = TypeVar("T")


class RedisUnavailable(Exception):
    """Redis is unreachable, slow or its breaker is open: use the local fallback."""


@dataclass(slots=True)
class LinkStats:
    calls: int = 0
    failures: int = 0
    rejected_while_open: int = 0
    breaker_opened: int = 0


class RedisBreaker:
    """Opens after `threshold` consecutive failures; stays open for a back-off that doubles up
    to `max_open` seconds; then lets one probe through (half-open)."""

    def __init__(
        self,
        threshold: int = 2,
        base_open: float = 0.25,
        max_open: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.base_open = base_open
        self.max_open = max_open
        self.clock = clock
        self.failures = 0
        self.open_until = 0.0
        self.open_for = base_open
        self.probing = False

    @property
    def is_open(self) -> bool:
        return self.failures >= self.threshold and (self.probing or self.clock() < self.open_until)

    def admit(self) -> bool:
        if self.failures < self.threshold:
            return True
        if self.probing or self.clock() < self.open_until:
            return False
        self.probing = True
        return True

    def success(self) -> bool:
        """Record a success; True when this closed an open breaker (time to resync)."""
        was_open = self.failures >= self.threshold
        self.failures = 0
        self.open_for = self.base_open
        self.probing = False
        return was_open

    def failure(self) -> bool:
        """Record a failure; True when this opened the breaker."""
        self.failures += 1
        if self.failures < self.threshold:
            return False
        reopened = self.probing
        self.probing = False
        if reopened:
            self.open_for = min(self.max_open, self.open_for * 2)
        self.open_until = self.clock() + self.open_for
        return self.failures == self.threshold or reopened


class RedisLink:
    """A Redis client used only through `call`, which bounds each operation by `timeout`."""

    def __init__(self, url: str, timeout: float, *, blocking_read: float = 0.0) -> None:
        self.timeout = timeout
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout + blocking_read,
            socket_connect_timeout=timeout,
            decode_responses=False,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self.breaker = RedisBreaker()
        self.stats = LinkStats()
        self.on_recovered: Callable[[], None] | None = None

    async def call(
        self, operation: Callable[[aioredis.Redis], Awaitable[T]], limit: float | None = None
    ) -> T:
        """Run `operation` within `limit` seconds (default: the link's timeout); raise
        RedisUnavailable on any failure or while the breaker is open."""
        if not self.breaker.admit():
            self.stats.rejected_while_open += 1
            raise RedisUnavailable("redis breaker is open")
        self.stats.calls += 1
        try:
            async with asyncio.timeout(self.timeout if limit is None else limit):
                result = await operation(self.client)
        except (RedisError, OSError, TimeoutError) as exc:
            _reraise_cancellation()
            self.stats.failures += 1
            if self.breaker.failure():
                self.stats.breaker_opened += 1
                log.warning("redis unreachable (%s); serving on local state", type(exc).__name__)
            raise RedisUnavailable(str(exc) or type(exc).__name__) from None
        _reraise_cancellation()
        if self.breaker.success():
            log.warning("redis reachable again; resyncing shared state")
            if self.on_recovered is not None:
                self.on_recovered()
        return result

    async def close(self) -> None:
        await self.client.aclose()


def _reraise_cancellation() -> None:
    """redis-py can turn a cancellation into a connection error or a normal return; a
    cancelled task must still stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
