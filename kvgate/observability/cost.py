"""What each request cost in dollars, from its pool's `price` (docs/observability.md, Cost).

Tokens charged for a request: the engine's `usage` when it reported one — uncached prompt
tokens at the input price, cached prompt tokens at the cached price, completion tokens at the
output price — plus the prompt tokens re-read to resume a broken stream, at the input price.
A stream cut short without `usage` is charged like its quota settlement: the estimated prompt
plus one completion token per data event relayed. Attempts that failed before their first
token report nothing and are charged nothing.

Per GPU-hour, a token costs the pool's dollars per second divided by the tokens per second its
engines processed over the last minute, read from their own counters (prompt tokens minus
prefix-cache hits, plus generation tokens, summed over the pool's endpoints as the telemetry
scraper last read them). Every gateway worker and replica reads the same counters, so their
charges add up to the pool's cost over the minute, idle time included, whoever sent the
tokens. Until the counters have been read over at least 5 s and show tokens processed (after
start, and after one of the pool's engines was first scraped, vanished or restarted), the price
is unknown and the request is charged nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvgate.config import PoolConfig, PriceConfig
from kvgate.routing.endpoints import Endpoint
from kvgate.types import RequestContext

# Seconds of engine counters a GPU-hour price is measured over, and the fewest that give a
# price: over shorter spans the counters of requests caught half-way through dominate.
THROUGHPUT_WINDOW = 60.0
MIN_THROUGHPUT_SPAN = 5.0
_PER_MTOK = 1e-6


@dataclass(frozen=True, slots=True)
class ChargedTokens:
    """The tokens a request is charged for: uncached input, cached input, output."""

    input: int
    cached: int
    output: int


def charged_tokens(ctx: RequestContext) -> ChargedTokens | None:
    """What `ctx` is charged for, or None when it reached no engine's output."""
    usage = ctx.usage
    overhead = ctx.resume_overhead_tokens
    if usage is not None:
        prompt = _count(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        cached = min(cached, prompt)
        output = _count(usage.get("completion_tokens"))
        return ChargedTokens(prompt - cached + overhead, cached, output)
    if ctx.relayed_events and ctx.intent is not None:
        return ChargedTokens(ctx.intent.prompt_tokens + overhead, 0, ctx.relayed_events)
    return None


def _count(value: object) -> int:
    return value if isinstance(value, int) and value > 0 else 0


class PoolThroughput:
    """Tokens per second a pool's engines processed over the last `THROUGHPUT_WINDOW`
    seconds, from samples of their counters taken whenever a price is asked for."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self.endpoints = endpoints
        self.samples: deque[tuple[float, float]] = deque()
        # Endpoints whose counters the samples add up: when one joins (its first scrape) or
        # leaves, the sums are not comparable and the measurement starts over.
        self.counted = 0

    def tokens_per_second(self) -> float | None:
        """None until samples `MIN_THROUGHPUT_SPAN` apart show tokens processed."""
        sample, counted = self._read()
        if sample is None:
            return None
        samples = self.samples
        if counted != self.counted or (samples and sample[1] < samples[-1][1]):
            samples.clear()  # an engine joined, left or restarted (its counters began again)
            self.counted = counted
        if not samples or sample[0] > samples[-1][0]:
            samples.append(sample)
        # Keep the newest sample at or before the window's start as its baseline.
        while len(samples) > 2 and samples[1][0] <= sample[0] - THROUGHPUT_WINDOW:
            samples.popleft()
        (start, before), (end, after) = samples[0], samples[-1]
        span = min(end - start, THROUGHPUT_WINDOW)
        if span < MIN_THROUGHPUT_SPAN or after <= before:
            return None
        return (after - before) / span

    def _read(self) -> tuple[tuple[float, float] | None, int]:
        """(newest scrape time, tokens processed) over the endpoints scraped, and how many."""
        scraped_at, processed, counted = None, 0.0, 0
        for endpoint in self.endpoints:
            telemetry = endpoint.telemetry
            if telemetry is None:
                continue
            counted += 1
            processed += (
                telemetry.prompt_tokens - telemetry.prefix_hits + telemetry.generation_tokens
            )
            if scraped_at is None or telemetry.scraped_at > scraped_at:
                scraped_at = telemetry.scraped_at
        return (None if scraped_at is None else (scraped_at, processed)), counted


class PoolPrice:
    """One pool's `price`: the dollars of a request's charged tokens."""

    def __init__(self, price: PriceConfig, endpoints: Sequence[Endpoint]) -> None:
        self.price = price
        self.throughput = PoolThroughput(endpoints) if price.gpu_hour is not None else None

    def dollars(self, tokens: ChargedTokens) -> float | None:
        price = self.price
        if self.throughput is None:
            assert price.input_per_mtok is not None and price.output_per_mtok is not None
            cached = price.cached_input_per_mtok
            return _PER_MTOK * (
                tokens.input * price.input_per_mtok
                + tokens.cached * (price.input_per_mtok if cached is None else cached)
                + tokens.output * price.output_per_mtok
            )
        assert price.gpu_hour is not None
        rate = self.throughput.tokens_per_second()
        if rate is None:
            return None
        per_second = price.gpu_hour * (price.gpus or 1) / 3600
        # Cached prompt tokens are not in the engines' processed count: they cost no GPU time.
        return (tokens.input + tokens.output) * per_second / rate


class Pricing:
    """Every priced pool of one config, by pool name."""

    def __init__(self, pools: Iterable[PoolConfig], endpoints: Iterable[Endpoint]) -> None:
        by_pool: dict[str, list[Endpoint]] = {}
        for endpoint in endpoints:
            by_pool.setdefault(endpoint.pool, []).append(endpoint)
        self.pools = {
            pool.name: PoolPrice(pool.price, by_pool.get(pool.name, []))
            for pool in pools
            if pool.price is not None
        }

    def cost(self, ctx: RequestContext) -> float | None:
        """Dollars `ctx` cost; None when its pool has no price (or no measured throughput
        yet) or it reached no engine."""
        if ctx.endpoint is None:
            return None
        price = self.pools.get(ctx.endpoint.pool)
        if price is None:
            return None
        tokens = charged_tokens(ctx)
        return None if tokens is None else price.dollars(tokens)
