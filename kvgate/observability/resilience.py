"""Prometheus metrics of the resilience layer: the gateway's `ResilienceObserver`.

Labels carry only endpoint and pool names from the config and fixed reason/result words (plus
kvgate's own error codes for retry reasons), so clients cannot grow the label sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.observability.buckets import LATENCY_BUCKETS
from kvgate.upstream.breaker import BreakerState
from kvgate.upstream.resilience import Resilience


class ResilienceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.transitions = Counter(
            "kvgate_breaker_transitions",
            "Circuit breaker state changes, by endpoint.",
            ["endpoint", "from_state", "to_state"],
            registry=registry,
        )
        self.skipped = Counter(
            "kvgate_breaker_ejections_skipped",
            "Breakers that tripped while their pool already had the maximum share ejected.",
            ["endpoint"],
            registry=registry,
        )
        self.attempts = Counter(
            "kvgate_upstream_attempts",
            "Upstream attempts by endpoint and result (ok, failure, overload, client_error, "
            "released).",
            ["endpoint", "result"],
            registry=registry,
        )
        self.retries = Counter(
            "kvgate_retries",
            "Retries dispatched, by pool and the error that caused them.",
            ["pool", "reason"],
            registry=registry,
        )
        self.retries_denied = Counter(
            "kvgate_retries_denied",
            "Retriable failures not retried, by pool and reason (budget, throttle, deadline, "
            "attempts, no_endpoint).",
            ["pool", "reason"],
            registry=registry,
        )
        self.throttled_attempts = Counter(
            "kvgate_throttled_attempts",
            "Attempts rejected locally by the client-side throttle, by pool.",
            ["pool"],
            registry=registry,
        )
        self.resumes = Counter(
            "kvgate_stream_resumes",
            "Broken streams resumed on another endpoint, by outcome.",
            ["pool", "outcome"],
            registry=registry,
        )
        self.resume_overhead = Counter(
            "kvgate_stream_resume_overhead_tokens",
            "Prompt tokens re-read by engines to resume broken streams.",
            ["pool"],
            registry=registry,
        )
        self.inter_token = Histogram(
            "kvgate_inter_token_latency_seconds",
            "Streams: time between two consecutive chunks relayed to the client.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._attempts: dict[tuple[str, str], Counter] = {}
        self._inter_token: dict[str, Callable[[float], None]] = {}

    def breaker_transition(self, endpoint: str, old: str, new: str) -> None:
        self.transitions.labels(endpoint, old, new).inc()

    def ejection_skipped(self, endpoint: str) -> None:
        self.skipped.labels(endpoint).inc()

    def attempt_finished(self, endpoint: str, result: str) -> None:
        # Once per upstream attempt: the labelled child is cached (`.labels()` is slow).
        child = self._attempts.get((endpoint, result))
        if child is None:
            child = self._attempts[(endpoint, result)] = self.attempts.labels(endpoint, result)
        child.inc()

    def token_gap_recorder(self, route: str) -> Callable[[float], None]:
        recorder = self._inter_token.get(route)
        if recorder is None:
            recorder = self._inter_token[route] = self.inter_token.labels(route).observe
        return recorder

    def retry(self, pool: str, reason: str) -> None:
        self.retries.labels(pool, reason).inc()

    def retry_denied(self, pool: str, reason: str) -> None:
        self.retries_denied.labels(pool, reason).inc()

    def throttled(self, pool: str) -> None:
        self.throttled_attempts.labels(pool).inc()

    def resumed(self, pool: str, outcome: str, overhead_tokens: int) -> None:
        self.resumes.labels(pool, outcome).inc()
        if overhead_tokens:
            self.resume_overhead.labels(pool).inc(overhead_tokens)


class BreakerStateCollector(Collector):
    """`kvgate_breaker_state{endpoint,state}`: 1 for each endpoint's current state, 0 for the
    others, read at scrape time."""

    def __init__(self, resilience: Resilience) -> None:
        self.resilience = resilience

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvgate_breaker_state",
            "Circuit breaker state: 1 for the current one of closed, half_open and open.",
            labels=["endpoint", "state"],
        )
        for breaker in self.resilience.breakers.values():
            current = breaker.refresh()
            for state in BreakerState:
                family.add_metric([breaker.name, state.value], 1 if state is current else 0)
        yield family
