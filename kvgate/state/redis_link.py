"""One guarded way to talk to Redis: short timeouts, a bounded pool and a breaker, so a slow or
lost Redis costs each caller at most one timeout before it falls back to local state, and after
a few failed attempts in a row no caller waits on it at all."""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvgate.state.redis_pool import IdleClosingPool

log = logging.getLogger("kvgate.state")
T = TypeVar("T")


class RedisUnavailable(Exception):
    """Redis is unreachable, slow or its breaker is open: use the local fallback."""


# Upper bounds (seconds) of the call-duration histogram: from a loopback round trip to past
# any op_timeout worth configuring.
DURATION_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(slots=True)
class LinkStats:
    calls: int = 0
    failures: int = 0
    rejected_while_open: int = 0
    breaker_opened: int = 0
    # Calls (failed ones included) per DURATION_BOUNDS bucket, not cumulative; the last
    # counts those above the highest bound.
    durations: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BOUNDS) + 1))
    duration_sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.durations[bisect.bisect_left(DURATION_BOUNDS, seconds)] += 1
        self.duration_sum += seconds


class RedisBreaker:
    """Opens after `threshold` consecutive failures; stays open for a back-off that doubles up
    to `max_open` seconds; then lets one probe through (half-open).

    Failures are counted as health checks count failed probes: one per attempt made after the
    previous failure was seen. Calls that were already in flight when a failure was counted
    and then fail too (one stall of the event loop or of Redis times out every call waiting at
    that moment) are the same episode and count once."""

    def __init__(
        self,
        threshold: int = 3,
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
        self.last_failure = float("-inf")

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

    def failure(self, started: float) -> bool:
        """Record the failure of a call started at `started` (this breaker's clock); True when
        this opened the breaker, or opened it again after a failed probe (`failures` is then
        past `threshold`)."""
        if started < self.last_failure:
            return False
        self.last_failure = self.clock()
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
    """A Redis client used only through `call`, which bounds each operation by `timeout`.

    Its pool holds at most `max_connections` connections; a call that finds them all busy
    waits for one within the same `timeout`, then fails like any other slow call (the caller
    falls back). `close_idle` closes the connections a burst left idle."""

    def __init__(
        self,
        url: str,
        timeout: float,
        *,
        max_connections: int,
        keep_idle: int,
        blocking_read: float = 0.0,
        purpose: str = "redis calls",
    ) -> None:
        self.timeout = timeout
        # What the link is for, in its log lines (a process has two links; each logs its own
        # loss and recovery).
        self.purpose = purpose
        self.pool = IdleClosingPool.from_url(
            url,
            keep_idle=keep_idle,
            max_connections=max_connections,
            timeout=timeout,
            socket_timeout=timeout + blocking_read,
            socket_connect_timeout=timeout,
            decode_responses=False,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self.client: aioredis.Redis = aioredis.Redis.from_pool(self.pool)
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
        started = self.breaker.clock()
        try:
            async with asyncio.timeout(self.timeout if limit is None else limit):
                result = await operation(self.client)
        except (RedisError, OSError, TimeoutError) as exc:
            _reraise_cancellation()
            self.stats.failures += 1
            self.stats.observe(self.breaker.clock() - started)
            breaker = self.breaker
            if breaker.failure(started):
                self.stats.breaker_opened += 1
                if breaker.failures == breaker.threshold:  # an outage begins: one line
                    log.warning(
                        "redis unreachable for %s (%s); serving on local state",
                        self.purpose,
                        type(exc).__name__,
                    )
            raise RedisUnavailable(str(exc) or type(exc).__name__) from None
        _reraise_cancellation()
        self.stats.observe(self.breaker.clock() - started)
        if self.breaker.success():
            log.warning("redis reachable again for %s; resyncing shared state", self.purpose)
            if self.on_recovered is not None:
                self.on_recovered()
        return result

    async def close_idle(self, idle_for: float) -> int:
        """Close the pool's connections idle for more than `idle_for` seconds (beyond the few
        kept); returns how many were closed."""
        return await self.pool.close_idle(idle_for)

    async def close(self) -> None:
        await self.client.aclose()


def _reraise_cancellation() -> None:
    """redis-py can turn a cancellation into a connection error or a normal return; a
    cancelled task must still stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
