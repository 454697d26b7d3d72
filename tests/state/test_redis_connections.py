"""Connections to a real Redis stay bounded: a burst of quota calls above the pool size never
opens more than the pool allows (counted by the server's CLIENT LIST) and loses no call;
connections a burst left idle are closed after `idle_timeout`; a call that finds every
connection busy waits within op_timeout and then falls back; and one stall that fails many
calls at once counts as one failure for the breaker."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
import redis.asyncio as aioredis

from kvgate.state.quotas import QuotaLimits
from kvgate.state.redis_link import RedisBreaker, RedisLink, RedisUnavailable
from kvgate.state.redis_store import RedisStore, RedisStoreSettings

pytestmark = pytest.mark.timeout(60)

# Exactly the burst's 300 requests a minute: every one must be taken in Redis, none refused.
LIMITS = QuotaLimits(requests_per_minute=300, tokens_per_minute=None)


def _store(url: str, **settings: float) -> RedisStore:
    return RedisStore(
        RedisStoreSettings(url=url, prefix="conns", heartbeat_interval=0.1, **settings)
    )


async def _clients(observer: aioredis.Redis) -> int:
    """Connections the server has open, the observer's own not counted."""
    return len(await observer.client_list()) - 1


async def _burst(store: RedisStore, calls: int, observer: aioredis.Redis) -> tuple[int, int]:
    """`calls` quota reservations at once; (reservations made, most server connections seen
    while they ran)."""
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, await _clients(observer))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    taken = await asyncio.gather(*(store.quotas.reserve("tenant", LIMITS, 0) for _ in range(calls)))
    done.set()
    await watcher
    return len(taken), peak


async def test_a_burst_above_the_pool_never_exceeds_it_and_loses_nothing(redis_server):
    observer = aioredis.Redis.from_url(redis_server.url)
    store = _store(redis_server.url, max_connections=4, op_timeout=5.0)
    await store.start()
    try:
        started = time.monotonic()
        taken, peak = await _burst(store, 300, observer)
        elapsed = time.monotonic() - started
        assert taken == 300
        assert store.quotas.stats.local_fallbacks == 0  # every one reserved in Redis
        assert store.link.stats.failures == 0
        # The link's 4 and the stream reader's 1; more than 1 shows the burst overlapped.
        assert 1 < peak <= 5
        # All 300 counted in the bucket: what is left is at most its refill (5 a second).
        level = await observer.hget("conns:{quota:tenant}:requests", "level")
        assert level is not None and float(level) <= 5 * (elapsed + 1)
    finally:
        await store.stop()
        await observer.aclose()


async def test_connections_a_burst_left_idle_are_closed_after_idle_timeout(redis_server):
    observer = aioredis.Redis.from_url(redis_server.url)
    store = _store(redis_server.url, max_connections=16, op_timeout=5.0, idle_timeout=0.5)
    await store.start()
    try:
        _, peak = await _burst(store, 300, observer)
        assert peak > 4
        deadline = time.monotonic() + 10
        # Two kept idle for the background loops (one may be in use) and the reader's one.
        while await _clients(observer) > 3:
            assert time.monotonic() < deadline, "idle connections were not closed"
            await asyncio.sleep(0.1)
        assert store.link.pool.open_connections <= 2
        await store.quotas.reserve("tenant", LIMITS, 0)  # and the link still works
        assert store.quotas.stats.local_fallbacks == 0
    finally:
        await store.stop()
        await observer.aclose()


async def test_a_call_finding_every_connection_busy_waits_op_timeout_then_fails(redis_server):
    link = RedisLink(redis_server.url, 0.2, max_connections=1, keep_idle=1)
    try:
        busy = await link.pool.get_connection()  # as a slow call in flight would hold it
        started = time.monotonic()
        with pytest.raises(RedisUnavailable):
            await link.call(lambda r: r.ping())
        assert time.monotonic() - started >= 0.2
        await link.pool.release(busy)
        assert await link.call(lambda r: r.ping())
        assert link.pool.open_connections == 1
    finally:
        await link.close()


def test_calls_failing_together_count_once_and_consecutive_attempts_open_the_breaker():
    now = [0.0]
    breaker = RedisBreaker(threshold=3, clock=lambda: now[0])
    now[0] = 1.1
    # Ten calls started at 1.0 time out together at 1.1 (one stall): one failure.
    assert not any(breaker.failure(1.0) for _ in range(10))
    assert breaker.failures == 1 and breaker.admit()
    now[0] = 1.2
    assert not breaker.failure(1.15)  # started after the first failure: the second
    now[0] = 1.3
    assert breaker.failure(1.25)  # the third attempt in a row opens it
    assert breaker.is_open and not breaker.admit()
    now[0] = 1.3 + breaker.open_for
    assert breaker.admit()  # the half-open probe
    assert breaker.success()
    assert breaker.failures == 0 and not breaker.is_open


async def test_an_outage_is_logged_once_not_at_every_failed_probe(caplog):
    """While Redis stays down, each half-open probe fails and opens the breaker again: one
    warning says the outage began, not one per probe (every second or two, per link)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nothing listens there once this socket closes
    link = RedisLink(f"redis://127.0.0.1:{closed}/0", 0.5, max_connections=2, keep_idle=1)
    now = [0.0]
    link.breaker = RedisBreaker(threshold=3, clock=lambda: now[0])
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.state"):
            for _ in range(12):
                now[0] += 10.0  # past any back-off: every call is let through, and fails
                with pytest.raises(RedisUnavailable):
                    await link.call(lambda r: r.ping())
        assert link.stats.breaker_opened == 10  # opened once, then again at each probe
        said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(said) == 1, said
    finally:
        await link.close()
