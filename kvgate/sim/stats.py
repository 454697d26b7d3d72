"""Counters and latency histograms one engine keeps; /metrics and /sim/stats read them."""

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# Bucket bounds as vLLM declares them for its request latency histograms.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


# How many of the latest first tokens /sim/first-tokens keeps (a benchmark run's worth), and
# the fields of each record, kept as a tuple (about 250 bytes).
FIRST_TOKENS_KEPT = 20_000
FIRST_TOKEN_FIELDS = (
    "id",
    "ttft",
    "prompt_tokens",
    "cached_tokens",
    "waiting",
    "step_base",
    "own_prefill",
    "shared_prefill",
    "decodes",
    "overrun",
)


class Histogram:
    """A cumulative-bucket histogram with Prometheus semantics (`le` upper bounds)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.bucket_counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.bucket_counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Return `(le, cumulative count)` pairs including `+Inf`."""
        pairs = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.bucket_counts, strict=True):
            running += count
            pairs.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return pairs


@dataclass
class EngineCounters:
    """Monotonic counters since engine start; the engine core and the HTTP app update them."""

    requests_received: int = 0
    requests_completed: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    faults_applied: int = 0
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    last_request: dict[str, Any] | None = None
    # One record per request's first token (FIRST_TOKEN_FIELDS), newest last.
    first_tokens: deque[tuple[Any, ...]] = field(
        default_factory=lambda: deque(maxlen=FIRST_TOKENS_KEPT)
    )

    def first_tokens_json(self) -> list[dict[str, Any]]:
        """The `/sim/first-tokens` view: the kept records, oldest first."""
        return [dict(zip(FIRST_TOKEN_FIELDS, record, strict=True)) for record in self.first_tokens]

    def as_json(self) -> dict[str, Any]:
        """The `/sim/stats` view: plain counters plus the last request received."""
        return {
            "requests_received": self.requests_received,
            "requests_completed": self.requests_completed,
            "requests_aborted": self.requests_aborted,
            "prompt_tokens": self.prompt_tokens,
            "tokens_generated": self.generation_tokens,
            "prefix_queries": self.prefix_queries,
            "prefix_hit_tokens": self.prefix_hits,
            "preemptions": self.preemptions,
            "faults_applied": self.faults_applied,
            "last_request": self.last_request,
        }
