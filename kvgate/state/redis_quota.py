"""Per-tenant quotas shared by every replica: the same token buckets as the in-memory
`QuotaStore`, kept in Redis and changed only by Lua scripts, so reservations are atomic across
processes.

This is the one Redis call on the request path (`reserve`): it is bounded by the link's
timeout and breaker. While Redis is unreachable, reservations fall back to a local store whose
limits are this replica's share (limit ÷ live replicas), and each fallback is counted and
logged. Settlements never wait: they are queued and applied by a background task.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.background import OwnedTask
from kvgate.state.quotas import (
    InMemoryQuotaStore,
    QuotaExceeded,
    QuotaLimits,
    QuotaTooSmall,
    Reservation,
)
from kvgate.state.redis_link import RedisLink, RedisUnavailable

log = logging.getLogger("kvgate.state")

# A bucket is a hash {level, updated}; it refills capacity/60 per second up to capacity and may
# go negative (debt) when usage exceeds a reservation. A bucket expires a minute after it would
# be full again: a missing bucket is a full one, so it must outlive any debt it holds (a fixed
# expiry forgave a debt of minutes after two).
_LOAD_BUCKET = """
local function load(key, cap, now)
  local v = redis.call('HMGET', key, 'level', 'updated')
  local level, updated = tonumber(v[1]), tonumber(v[2])
  if level == nil then return cap end
  return math.min(cap, level + (now - updated) * cap / 60)
end
local function store(key, level, now, cap)
  redis.call('HSET', key, 'level', tostring(level), 'updated', tostring(now))
  redis.call('PEXPIRE', key, math.ceil(((cap - level) * 60 / cap + 60) * 1000))
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: requests bucket, tokens bucket. ARGV: rpm (0 = unlimited), tpm (0 = unlimited), tokens.
# Returns {1} when taken, else {0, wait_requests, wait_tokens} (seconds, as strings).
_RESERVE = (
    _LOAD_BUCKET
    + """
local rpm, tpm, need = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rl, tl = 0, 0
local wait_r, wait_t = 0, 0
if rpm > 0 then
  rl = load(KEYS[1], rpm, now)
  if rl < 1 then wait_r = (1 - rl) * 60 / rpm end
end
if tpm > 0 then
  tl = load(KEYS[2], tpm, now)
  if tl < need then wait_t = (need - tl) * 60 / tpm end
end
if wait_r > 0 or wait_t > 0 then return {0, tostring(wait_r), tostring(wait_t)} end
if rpm > 0 then store(KEYS[1], rl - 1, now, rpm) end
if tpm > 0 then store(KEYS[2], tl - need, now, tpm) end
return {1}
"""
)

# KEYS: bucket. ARGV: capacity, amount to give back (negative: take more).
_ADJUST = (
    _LOAD_BUCKET
    + """
local cap, amount = tonumber(ARGV[1]), tonumber(ARGV[2])
store(KEYS[1], math.min(cap, load(KEYS[1], cap, now) + amount), now, cap)
return 1
"""
)


@dataclass(slots=True)
class SharedReservation(Reservation):
    limits: QuotaLimits | None = None


@dataclass(slots=True)
class QuotaSyncStats:
    shared_reservations: int = 0
    local_fallbacks: int = 0
    adjustments_dropped: int = 0


class RedisQuotaStore:
    """A `QuotaStore` (kvgate.state.quotas) whose buckets live in Redis."""

    def __init__(
        self, link: RedisLink, prefix: str, replicas: Callable[[], int], max_pending: int = 100_000
    ) -> None:
        self.link = link
        self.prefix = prefix
        self.replicas = replicas
        self.max_pending = max_pending
        self.local = InMemoryQuotaStore()
        self.stats = QuotaSyncStats()
        self._reserve = link.client.register_script(_RESERVE)
        self._adjust = link.client.register_script(_ADJUST)
        self._pending: deque[tuple[str, int, int]] = deque()
        self._wake = asyncio.Event()
        self._outstanding = [0, 0]
        self._task = OwnedTask("kvgate-quota-settle")

    def _keys(self, tenant: str) -> tuple[str, str]:
        # One hash tag per tenant keeps both buckets in one Redis Cluster slot.
        tag = f"{self.prefix}:{{quota:{tenant}}}"
        return f"{tag}:requests", f"{tag}:tokens"

    async def reserve(self, tenant: str, limits: QuotaLimits, tokens: int) -> Reservation:
        tpm = limits.tokens_per_minute
        if tpm is not None and tokens > tpm:
            raise QuotaTooSmall(tokens, tpm)
        args = [limits.requests_per_minute or 0, tpm or 0, tokens]
        try:
            answer = await self.link.call(
                lambda r: self._reserve(keys=self._keys(tenant), args=args, client=r)
            )
        except RedisUnavailable:
            return await self._reserve_locally(tenant, limits, tokens)
        if int(answer[0]) != 1:
            wait_r, wait_t = float(answer[1]), float(answer[2])
            if wait_r >= wait_t:
                raise QuotaExceeded("requests_per_minute", wait_r)
            raise QuotaExceeded("tokens_per_minute", wait_t)
        self.stats.shared_reservations += 1
        self._outstanding[0] += 1
        self._outstanding[1] += tokens
        return SharedReservation(tenant, tokens, limits=limits)

    async def _reserve_locally(self, tenant: str, limits: QuotaLimits, tokens: int) -> Reservation:
        share = max(1, self.replicas())
        local_limits = QuotaLimits(
            _share(limits.requests_per_minute, share), _share(limits.tokens_per_minute, share)
        )
        self.stats.local_fallbacks += 1
        if self.stats.local_fallbacks == 1 or self.stats.local_fallbacks % 1000 == 0:
            log.warning(
                "quota for tenant %s enforced locally (1/%d of the limit): redis "
                "unavailable (%d fallbacks so far)",
                tenant,
                share,
                self.stats.local_fallbacks,
            )
        try:
            return await self.local.reserve(tenant, local_limits, tokens)
        except QuotaTooSmall:
            # Within the tenant's limit (checked above), over this replica's share of it: a
            # 429 the client retries once Redis is back (probed again within `max_open`), not
            # a 400 telling it to shrink a request the gateway will take then.
            raise QuotaExceeded("tokens_per_minute", self.link.breaker.max_open) from None

    def _close(self, reservation: Reservation) -> SharedReservation | None:
        if not isinstance(reservation, SharedReservation):
            return None
        if reservation.open:
            reservation.open = False
            self._outstanding[0] -= 1
            self._outstanding[1] -= reservation.tokens
            return reservation
        return None

    def settle(self, reservation: Reservation, used_tokens: int) -> None:
        if not isinstance(reservation, SharedReservation):
            self.local.settle(reservation, used_tokens)
            return
        closed = self._close(reservation)
        if closed is not None and closed.limits and closed.limits.tokens_per_minute:
            self._queue(
                closed.tenant, 1, closed.limits.tokens_per_minute, closed.tokens - used_tokens
            )

    def release(self, reservation: Reservation) -> None:
        if not isinstance(reservation, SharedReservation):
            self.local.release(reservation)
            return
        closed = self._close(reservation)
        if closed is None or closed.limits is None:
            return
        if closed.limits.requests_per_minute:
            self._queue(closed.tenant, 0, closed.limits.requests_per_minute, 1)
        if closed.limits.tokens_per_minute:
            self._queue(closed.tenant, 1, closed.limits.tokens_per_minute, closed.tokens)

    def outstanding(self) -> tuple[int, int]:
        local_requests, local_tokens = self.local.outstanding()
        return self._outstanding[0] + local_requests, self._outstanding[1] + local_tokens

    def _queue(self, tenant: str, bucket: int, capacity: int, amount: int) -> None:
        if amount == 0:
            return
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()
            self.stats.adjustments_dropped += 1
        self._pending.append((self._keys(tenant)[bucket], capacity, amount))
        self._wake.set()

    def start(self) -> None:
        self._task.start(self._apply_adjustments())

    async def stop(self) -> None:
        await self._task.stop()

    async def _apply_adjustments(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(256, len(self._pending)))]
                try:
                    await self.link.call(functools.partial(self._adjust_batch, batch=batch))
                except RedisUnavailable:
                    self._pending.extendleft(reversed(batch))
                    await asyncio.sleep(self.link.breaker.open_for)

    async def _adjust_batch(self, client: Any, batch: list[tuple[str, int, int]]) -> object:
        async with client.pipeline(transaction=False) as pipe:
            for key, capacity, amount in batch:
                await self._adjust(keys=[key], args=[capacity, amount], client=pipe)  # queues
            return await pipe.execute()


def _share(limit: int | None, replicas: int) -> int | None:
    return None if limit is None else max(1, limit // replicas)
