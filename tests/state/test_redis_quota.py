"""Shared quotas in a real Redis: atomic across processes, settled, and locally bounded when
Redis is lost."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest
import redis.asyncio

from kvgate.state.quotas import QuotaExceeded, QuotaLimits, QuotaTooSmall
from kvgate.state.redis_link import RedisLink
from kvgate.state.redis_quota import RedisQuotaStore

pytestmark = pytest.mark.timeout(60)


def _store(url: str, replicas: int = 1) -> RedisQuotaStore:
    return RedisQuotaStore(
        RedisLink(url, timeout=0.5, max_connections=32, keep_idle=2), "q", lambda: replicas
    )


async def _hammer(url: str, limits: QuotaLimits, seconds: float) -> int:
    store = _store(url)
    accepted = 0
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal accepted
        while time.monotonic() < deadline:
            try:
                await store.reserve("acme", limits, 1)
                accepted += 1
            except QuotaExceeded:
                await asyncio.sleep(0.005)

    await asyncio.gather(*(worker() for _ in range(8)))
    await store.link.close()
    return accepted


def _process(url: str, rpm: int, seconds: float, results: multiprocessing.Queue) -> None:
    results.put(asyncio.run(_hammer(url, QuotaLimits(requests_per_minute=rpm), seconds)))


def test_three_processes_hammering_one_tenant_never_overshoot(redis_server):
    rpm, seconds = 600, 3.0
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    procs = [
        context.Process(target=_process, args=(redis_server.url, rpm, seconds, results))
        for _ in range(3)
    ]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    counts = [results.get(timeout=45) for _ in procs]
    elapsed = time.monotonic() - started
    for proc in procs:
        proc.join(timeout=10)
    allowed = rpm + rpm / 60 * elapsed
    assert sum(counts) <= allowed * 1.01
    assert sum(counts) >= rpm
    assert all(c > 0 for c in counts)


async def test_reserve_settle_release_and_retry_after(redis_server):
    store = _store(redis_server.url)
    store.start()
    try:
        limits = QuotaLimits(requests_per_minute=2, tokens_per_minute=600)
        first = await store.reserve("t", limits, 500)
        with pytest.raises(QuotaExceeded) as info:
            await store.reserve("t", limits, 200)
        assert info.value.limit == "tokens_per_minute"
        assert 9 < info.value.retry_after < 11
        with pytest.raises(QuotaTooSmall):
            await store.reserve("t", limits, 601)
        assert store.outstanding() == (1, 500)
        store.settle(first, used_tokens=100)
        store.settle(first, used_tokens=100)
        assert store.outstanding() == (0, 0)
        deadline = time.monotonic() + 5
        while True:
            try:
                second = await store.reserve("t", limits, 450)
                break
            except QuotaExceeded:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
        store.release(second)
        with pytest.raises(QuotaExceeded) as info:
            await store.reserve("t", limits, 1)
            await store.reserve("t", limits, 1)
        assert info.value.limit == "requests_per_minute"
    finally:
        await store.stop()
        await store.link.close()


async def test_a_debt_outlives_the_buckets_expiry(redis_server):
    """A missing bucket is a full one, so a bucket in debt must not expire before it would be
    full again (a fixed two-minute expiry forgave a debt of five)."""
    store = _store(redis_server.url)
    store.start()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        limits = QuotaLimits(tokens_per_minute=600)
        taken = await store.reserve("debtor", limits, 500)
        store.settle(taken, used_tokens=3000)  # level 100 - 2,500: 3,000 tokens to refill
        tokens_key = store._keys("debtor")[1]
        deadline = time.monotonic() + 5
        while float((await client.hget(tokens_key, "level")) or 0) > -2000:
            assert time.monotonic() < deadline, "the settlement never reached Redis"
            await asyncio.sleep(0.02)
        refill = 3000 * 60 / 600  # seconds until full again
        assert (await client.pttl(tokens_key)) / 1000 > refill
        with pytest.raises(QuotaExceeded) as info:
            await store.reserve("debtor", limits, 1)
        assert info.value.retry_after > refill - 60
    finally:
        await client.aclose()
        await store.stop()
        await store.link.close()


async def test_redis_lost_falls_back_to_a_local_share(redis_server):
    store = _store(redis_server.url, replicas=3)
    limits = QuotaLimits(requests_per_minute=30)
    await store.reserve("t", limits, 0)
    assert store.stats.shared_reservations == 1
    redis_server.stop()
    taken = 0
    with pytest.raises(QuotaExceeded):
        for _ in range(100):
            await store.reserve("t", limits, 0)
            taken += 1
    assert taken == 10
    assert store.stats.local_fallbacks == 11
    await store.link.close()


async def test_a_request_within_the_limit_but_over_the_local_share_is_a_retryable_429(
    redis_server,
):
    """While Redis is lost a replica enforces its share (limit ÷ replicas): a request that fits
    the tenant's limit but not the share is told to retry (429, QuotaExceeded), never that it
    is too big for the quota (400, QuotaTooSmall); one over the whole limit still is."""
    store = _store(redis_server.url, replicas=2)
    limits = QuotaLimits(tokens_per_minute=3000)
    store.release(await store.reserve("t", limits, 2000))
    redis_server.stop()
    with pytest.raises(QuotaExceeded) as info:
        await store.reserve("t", limits, 2000)
    assert info.value.limit == "tokens_per_minute" and info.value.retry_after > 0
    with pytest.raises(QuotaTooSmall):
        await store.reserve("t", limits, 3001)
    assert store.stats.local_fallbacks == 1
    await store.link.close()
