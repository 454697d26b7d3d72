"""Per-tenant rate quotas with reservation: requests/min and tokens/min as token buckets.

At admission a request reserves one request and `prompt + max_tokens` tokens, all or nothing.
When it ends, `settle` returns what it reserved but did not use (actual usage may also exceed
the reservation: the difference is taken, and the bucket may go into debt); a request that never
reached an engine is `release`d in full. Each bucket holds up to one minute's allowance and
refills continuously, so `Retry-After` is exactly the time until the missing amount refills.

`QuotaStore` is the seam for shared quotas across replicas (`RedisQuotaStore`): `reserve` is
async so a store may make one short network call; `settle` and `release` are called from
release callbacks and must not block (a remote store queues them). Limits are plain numbers
(`QuotaLimits`): state knows nothing of tenants' config.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


class QuotaExceeded(Exception):
    """Not enough allowance now; `retry_after` seconds until there will be, `limit` names
    which bucket ran dry."""

    def __init__(self, limit: str, retry_after: float) -> None:
        super().__init__(limit)
        self.limit = limit
        self.retry_after = retry_after


class QuotaTooSmall(Exception):
    """The request alone needs more tokens than a whole minute's allowance."""

    def __init__(self, needed: int, allowance: int) -> None:
        super().__init__(f"{needed} > {allowance}")
        self.needed = needed
        self.allowance = allowance


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """A tenant's rate limits; None is unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(slots=True)
class Reservation:
    tenant: str
    tokens: int
    open: bool = True


class QuotaStore(Protocol):
    async def reserve(self, tenant: str, limits: QuotaLimits, tokens: int) -> Reservation:
        """Take one request and `tokens` tokens, or raise QuotaExceeded / QuotaTooSmall."""
        ...

    def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """The request ran and used `used_tokens`; close the reservation (idempotent)."""
        ...

    def release(self, reservation: Reservation) -> None:
        """The request never ran; give everything back (idempotent)."""
        ...

    def outstanding(self) -> tuple[int, int]:
        """Open reservations of this process: (requests, tokens). Zero when idle."""
        ...


@dataclass(slots=True)
class _Bucket:
    capacity: float
    level: float
    updated: float

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        return max(0.0, (amount - self.level) / self.rate)

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass(slots=True)
class _TenantBuckets:
    requests: _Bucket | None
    tokens: _Bucket | None
    outstanding_requests: int = 0
    outstanding_tokens: int = 0


class InMemoryQuotaStore:
    """One process's quotas; exact under concurrency because the event loop serialises it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._tenants: dict[str, _TenantBuckets] = {}

    def adopt(self, old: InMemoryQuotaStore, limits: Mapping[str, QuotaLimits]) -> None:
        """Take over `old`'s buckets of the tenants that remain after a reload (`limits`: the
        limits of every tenant configured now), open reservations included: requests begun
        before the reload settle into the same buckets. A bucket takes its tenant's new limit
        and keeps what was used of it; the buckets of tenants no longer configured are
        dropped."""
        now = self.clock()
        for tenant, state in old._tenants.items():
            tenant_limits = limits.get(tenant)
            if tenant_limits is None:
                continue
            state.requests = _resized(state.requests, tenant_limits.requests_per_minute, now)
            state.tokens = _resized(state.tokens, tenant_limits.tokens_per_minute, now)
            self._tenants[tenant] = state

    def _buckets(self, tenant: str, limits: QuotaLimits, now: float) -> _TenantBuckets:
        state = self._tenants.get(tenant)
        if state is None:
            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            state = _TenantBuckets(
                requests=_Bucket(rpm, rpm, now) if rpm is not None else None,
                tokens=_Bucket(tpm, tpm, now) if tpm is not None else None,
            )
            self._tenants[tenant] = state
        return state

    async def reserve(self, tenant: str, limits: QuotaLimits, tokens: int) -> Reservation:
        now = self.clock()
        state = self._buckets(tenant, limits, now)
        requests, token_bucket = state.requests, state.tokens
        if token_bucket is not None and tokens > token_bucket.capacity:
            raise QuotaTooSmall(tokens, int(token_bucket.capacity))
        waits: list[tuple[float, str]] = []
        if requests is not None:
            requests.refill(now)
            if requests.level < 1:
                waits.append((requests.wait_for(1), "requests_per_minute"))
        if token_bucket is not None:
            token_bucket.refill(now)
            if token_bucket.level < tokens:
                waits.append((token_bucket.wait_for(tokens), "tokens_per_minute"))
        if waits:
            wait, limit = max(waits)
            raise QuotaExceeded(limit, wait)
        if requests is not None:
            requests.level -= 1
        if token_bucket is not None:
            token_bucket.level -= tokens
        state.outstanding_requests += 1
        state.outstanding_tokens += tokens
        return Reservation(tenant, tokens)

    def _close(self, reservation: Reservation) -> _TenantBuckets | None:
        if not reservation.open:
            return None
        reservation.open = False
        state = self._tenants[reservation.tenant]
        state.outstanding_requests -= 1
        state.outstanding_tokens -= reservation.tokens
        return state

    def settle(self, reservation: Reservation, used_tokens: int) -> None:
        state = self._close(reservation)
        if state is None or state.tokens is None:
            return
        state.tokens.refill(self.clock())
        state.tokens.give_back(reservation.tokens - used_tokens)

    def release(self, reservation: Reservation) -> None:
        state = self._close(reservation)
        if state is None:
            return
        now = self.clock()
        if state.requests is not None:
            state.requests.refill(now)
            state.requests.give_back(1)
        if state.tokens is not None:
            state.tokens.refill(now)
            state.tokens.give_back(reservation.tokens)

    def outstanding(self) -> tuple[int, int]:
        return (
            sum(s.outstanding_requests for s in self._tenants.values()),
            sum(s.outstanding_tokens for s in self._tenants.values()),
        )


def _resized(bucket: _Bucket | None, capacity: int | None, now: float) -> _Bucket | None:
    """`bucket` under a limit of `capacity` a minute (None: unlimited, no bucket)."""
    if capacity is None:
        return None
    if bucket is None:
        return _Bucket(capacity, capacity, now)
    bucket.refill(now)
    # What the tenant used stays used: the level moves with the limit.
    bucket.level = min(capacity, bucket.level + capacity - bucket.capacity)
    bucket.capacity = capacity
    return bucket
