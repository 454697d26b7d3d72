"""Prometheus metrics of one gateway process, in a registry of its own."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvgate.routing.endpoints import Fleet
from kvgate.types import RequestContext

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """Request counts and latencies by route, model and outcome. Model labels only ever carry
    names the fleet serves, so clients cannot grow the label set."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvgate_requests",
            "Requests answered, by route, model, HTTP status and outcome.",
            ["route", "model", "status", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvgate_request_duration_seconds",
            "Time from request start to the last byte.",
            ["route", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Streams: time from request start to the first event relayed.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.endpoint_requests = Counter(
            "kvgate_endpoint_requests",
            "Requests dispatched to each endpoint, by outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.inflight = Gauge(
            "kvgate_endpoint_inflight_requests",
            "Requests in flight to each endpoint.",
            ["endpoint"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "kvgate_endpoint_healthy",
            "1 when the endpoint passes its health check.",
            ["endpoint"],
            registry=self.registry,
        )
        # Labelled children of the per-request metrics, by label values: `.labels()` validates
        # and joins its arguments on every call, a dict lookup does not. Bounded like the label
        # sets themselves (config names, fixed words, kvgate's own codes).
        self._requests: dict[tuple[str, str, int, str], Counter] = {}
        self._duration: dict[tuple[str, bool], Histogram] = {}
        self._ttft: dict[str, Histogram] = {}
        self._endpoint_requests: dict[tuple[str, str], Counter] = {}

    def observe(self, ctx: RequestContext) -> None:
        now = time.perf_counter()
        model = ctx.model if self.fleet.serves(ctx.model) else "_unknown"
        request_key = (ctx.route, model, ctx.status, ctx.outcome)
        requests = self._requests.get(request_key)
        if requests is None:
            requests = self._requests[request_key] = self.requests.labels(
                ctx.route, model, str(ctx.status), ctx.outcome
            )
        requests.inc()
        duration = self._duration.get((ctx.route, ctx.stream))
        if duration is None:
            duration = self._duration[(ctx.route, ctx.stream)] = self.duration.labels(
                ctx.route, "true" if ctx.stream else "false"
            )
        duration.observe(now - ctx.started)
        if ctx.first_token_at is not None:
            ttft = self._ttft.get(ctx.route)
            if ttft is None:
                ttft = self._ttft[ctx.route] = self.ttft.labels(ctx.route)
            ttft.observe(ctx.first_token_at - ctx.started)
        if ctx.endpoint is not None:
            endpoint_key = (ctx.endpoint.name, ctx.outcome)
            endpoint = self._endpoint_requests.get(endpoint_key)
            if endpoint is None:
                endpoint = self._endpoint_requests[endpoint_key] = self.endpoint_requests.labels(
                    *endpoint_key
                )
            endpoint.inc()

    def observe_rejected(self, route: str, status: int, outcome: str) -> None:
        self.requests.labels(route, "_unknown", str(status), outcome).inc()

    def render(self) -> bytes:
        for endpoint in self.fleet.endpoints:
            self.inflight.labels(endpoint.name).set(endpoint.inflight)
            self.healthy.labels(endpoint.name).set(1 if endpoint.healthy else 0)
        return generate_latest(self.registry)


class AdmissionMetrics:
    """The admission controller's observer (`kvgate.chain.admission_ports.AdmissionObserver`);
    tenant labels are config-bounded names."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_lengths = Gauge(
            "kvgate_admission_queue_length",
            "Requests waiting for capacity, by latency class.",
            ["class"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "kvgate_admission_wait_seconds",
            "Time spent waiting for capacity, by latency class and how the wait ended.",
            ["class", "result"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.shed_requests = Counter(
            "kvgate_admission_shed",
            "Requests refused for overload (503), by class and reason.",
            ["class", "reason"],
            registry=registry,
        )
        self.quota_rejections = Counter(
            "kvgate_quota_rejections",
            "Requests refused by a tenant limit (429), by limit.",
            ["tenant", "limit"],
            registry=registry,
        )

    def quota_rejected(self, tenant: str, limit: str) -> None:
        self.quota_rejections.labels(tenant, limit).inc()

    def shed(self, latency_class: str, reason: str) -> None:
        self.shed_requests.labels(latency_class, reason).inc()

    def waited(self, latency_class: str, result: str, seconds: float) -> None:
        self.queue_wait.labels(latency_class, result).observe(seconds)

    def queue_length(self, latency_class: str, length: int) -> None:
        self.queue_lengths.labels(latency_class).set(length)
