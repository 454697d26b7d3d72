"""Prometheus metrics of one gateway process: its instruments, and the views read at scrape
time (docs/observability.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from kvgate.chain.intent import CLASSES_BY_RANK
from kvgate.chain.tenants import ANONYMOUS
from kvgate.config import Config, ObservabilityConfig
from kvgate.observability.buckets import LATENCY_BUCKETS, TO_UPSTREAM_BUCKETS
from kvgate.observability.labels import LabelCap
from kvgate.observability.resilience import ResilienceMetrics
from kvgate.routing.endpoints import Fleet
from kvgate.types import RequestContext

# Set by `kvgate serve --workers N` before the workers start; prometheus-client reads it when
# first imported and then keeps every instrument's values in files there, one per process.
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
# The token counts of an answer's `usage`, by the name of their counter.
_TOKENS = (
    ("kvgate_prompt_tokens", "Prompt tokens the engines reported (usage.prompt_tokens)."),
    ("kvgate_completion_tokens", "Tokens the engines generated (usage.completion_tokens)."),
    (
        "kvgate_cached_prompt_tokens",
        "Prompt tokens served from the engines' prefix cache "
        "(usage.prompt_tokens_details.cached_tokens).",
    ),
)


class GatewayMetrics:
    """Every instrument of one gateway process: request counts and latencies by route, model
    and outcome, tokens, cost and successful tasks, and the admission and resilience
    observers. Model labels only ever carry names the fleet serves, so clients cannot grow the
    label set, and tenant and model labels are capped (`observability.max_label_values`).

    One instance outlives config reloads (the apps built from successive configs share it), so
    counters never reset on reload. With $PROMETHEUS_MULTIPROC_DIR set, `render` reports the
    sum over every worker process of the instruments; the scrape-time views (routing, state,
    breakers) are the answering process's own and carry its `pid` label."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.multiprocess = bool(os.environ.get(MULTIPROCESS_DIR))
        self.tenant_labels = LabelCap(ObservabilityConfig().max_label_values)
        self.model_labels = LabelCap(ObservabilityConfig().max_label_values)
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
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Streams: time from request start to the first event relayed.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.to_upstream = Histogram(
            "kvgate_time_to_upstream_seconds",
            "Time from request start to the first upstream request sent (ingress, auth, "
            "classification, admission wait, pick).",
            ["route"],
            buckets=TO_UPSTREAM_BUCKETS,
            registry=self.registry,
        )
        self.endpoint_requests = Counter(
            "kvgate_endpoint_requests",
            "Requests dispatched to each endpoint, by outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.tokens = tuple(
            Counter(name, help_text, ["tenant", "model", "pool"], registry=self.registry)
            for name, help_text in _TOKENS
        )
        self.cost = Counter(
            "kvgate_cost_dollars",
            "Dollars the requests cost at their pool's price (failed, retried and resumed work "
            "included).",
            ["tenant", "model", "pool"],
            registry=self.registry,
        )
        self.successes = Counter(
            "kvgate_successful_tasks",
            "Successful tasks: requests answered completely with a 2xx, and workflows whose "
            "last step (x-kvgate-workflow-step: n/n) was.",
            ["tenant", "model", "pool", "kind"],
            registry=self.registry,
        )
        self.trace_spans_dropped = Counter(
            "kvgate_trace_spans_dropped",
            "Spans of traced requests dropped because the trace exporter process fell behind "
            "(or died), or the collector refused them or could not be reached.",
            registry=self.registry,
        )
        self.trace_exporter_restarts = Counter(
            "kvgate_trace_exporter_restarts",
            "Trace exporter processes started again after the one before died.",
            registry=self.registry,
        )
        self.admission = AdmissionMetrics(self.registry, self.tenant_labels)
        self.resilience = ResilienceMetrics(self.registry)
        # Labelled children of the per-request metrics, by label values: `.labels()` validates
        # and joins its arguments on every call, a dict lookup does not. Bounded like the label
        # sets themselves (config names, fixed words, kvgate's own codes).
        self._requests: dict[tuple[str, str, int, str], Counter] = {}
        self._duration: dict[tuple[str, bool], Histogram] = {}
        self._ttft: dict[str, Histogram] = {}
        self._to_upstream: dict[str, Histogram] = {}
        self._endpoint_requests: dict[tuple[str, str], Counter] = {}
        self._tokens: dict[tuple[str, str, str], tuple[Counter, ...]] = {}
        self._cost: dict[tuple[str, str, str], Counter] = {}
        self._successes: dict[tuple[str, str, str, str], Counter] = {}

    def configure(self, config: Config) -> None:
        """Take the label cap and the names that get the first places from `config`."""
        limit = config.observability.max_label_values
        auth = config.auth
        tenants = [t.name for t in auth.tenants] if auth is not None else []
        self.tenant_labels.configure(limit, tenants or [ANONYMOUS])
        self.model_labels.configure(limit, (m for pool in config.pools for m in pool.models))

    def observe(self, ctx: RequestContext, fleet: Fleet, cost: float | None = None) -> None:
        """Count a finished request; `cost` is its dollars when its pool has a price."""
        now = time.perf_counter()
        model = self.model_labels(ctx.model if fleet.serves(ctx.model) else "_unknown")
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
        if ctx.sent_at is not None:
            to_upstream = self._to_upstream.get(ctx.route)
            if to_upstream is None:
                to_upstream = self._to_upstream[ctx.route] = self.to_upstream.labels(ctx.route)
            to_upstream.observe(ctx.sent_at - ctx.started)
        if ctx.endpoint is not None:
            endpoint_key = (ctx.endpoint.name, ctx.outcome)
            endpoint = self._endpoint_requests.get(endpoint_key)
            if endpoint is None:
                endpoint = self._endpoint_requests[endpoint_key] = self.endpoint_requests.labels(
                    *endpoint_key
                )
            endpoint.inc()
            tenant = self.tenant_labels(ctx.tenant.name if ctx.tenant is not None else "_unknown")
            key = (tenant, model, ctx.endpoint.pool)
            if ctx.usage is not None:
                self._count_tokens(key, ctx.usage)
            if cost:
                counter = self._cost.get(key)
                if counter is None:
                    counter = self._cost[key] = self.cost.labels(*key)
                counter.inc(cost)
            kind = successful_task(ctx)
            if kind is not None:
                success_key = (*key, kind)
                successes = self._successes.get(success_key)
                if successes is None:
                    successes = self._successes[success_key] = self.successes.labels(*success_key)
                successes.inc()

    def _count_tokens(self, key: tuple[str, str, str], usage: dict[str, object]) -> None:
        counters = self._tokens.get(key)
        if counters is None:
            counters = self._tokens[key] = tuple(c.labels(*key) for c in self.tokens)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        for counter, value in zip(
            counters,
            (usage.get("prompt_tokens"), usage.get("completion_tokens"), cached),
            strict=True,
        ):
            if isinstance(value, int) and value > 0:
                counter.inc(value)

    def observe_rejected(self, route: str, status: int, outcome: str) -> None:
        self.requests.labels(route, "_unknown", str(status), outcome).inc()

    def render(self, views: Iterable[Collector]) -> bytes:
        """The exposition text: the instruments (every worker's, summed, in multiprocess mode)
        followed by `views`, collected now in this process."""
        scrape_views = _Views(views, str(os.getpid()) if self.multiprocess else None)
        if not self.multiprocess:
            return generate_latest(self.registry) + generate_latest(scrape_views)
        instruments = CollectorRegistry()
        MultiProcessCollector(instruments)
        return generate_latest(instruments) + generate_latest(scrape_views)

    def process_exited(self) -> None:
        """Called once as the process stops serving: its live gauges leave the sums."""
        if self.multiprocess:
            mark_process_dead(os.getpid())


def forget_dead_process(pid: int) -> None:
    """A worker process `pid` died without `Metrics.process_exited`: its live gauges leave the
    sums (a no-op outside multiprocess mode)."""
    if os.environ.get(MULTIPROCESS_DIR):
        mark_process_dead(pid)


def successful_task(ctx: RequestContext) -> str | None:
    """`request` for a request answered completely with a 2xx; for a request of a workflow,
    `workflow` when it is the last step (`n/n`) and None for the steps before it. Reading or
    cancelling a stored response (`ctx.response_id`) is no task: the create that made it was."""
    if ctx.outcome != "ok" or not 200 <= ctx.status < 300 or not ctx.responded:
        return None
    if ctx.response_id is not None:  # a stored response read or cancelled
        return None
    workflow = ctx.options.workflow
    if workflow is None:
        return "request"
    return "workflow" if workflow.step == workflow.total else None


class _Views:
    """Scrape-time collectors as one `collect()`; with a pid, every sample carries it, so a
    series always holds one process's values (no false counter resets when successive scrapes
    are answered by different workers)."""

    def __init__(self, views: Iterable[Collector], pid: str | None) -> None:
        self.views = views
        self.pid = pid

    def collect(self) -> Iterator[Metric]:
        for view in self.views:
            for family in view.collect():
                if self.pid is not None:
                    family.samples = [_with_pid(s, self.pid) for s in family.samples]
                yield family


def _with_pid(sample: Sample, pid: str) -> Sample:
    return sample._replace(labels={**sample.labels, "pid": pid})


class AdmissionMetrics:
    """The admission controller's observer (`kvgate.chain.admission_ports.AdmissionObserver`);
    tenant labels are config-bounded names, capped like every tenant label."""

    def __init__(self, registry: CollectorRegistry, tenant_labels: LabelCap) -> None:
        self.tenant_labels = tenant_labels
        self.queue_lengths = Gauge(
            "kvgate_admission_queue_length",
            "Requests waiting for capacity, by latency class.",
            ["class"],
            registry=registry,
            multiprocess_mode="livesum",  # the queues of every live worker, added
        )
        for latency_class in CLASSES_BY_RANK:  # a sample from the start: autoscalers read it
            self.queue_lengths.labels(latency_class).set(0)
        self._quota_tokens: dict[str, tuple[Counter, Counter]] = {}
        self.queue_wait = Histogram(
            "kvgate_admission_wait_seconds",
            "Time spent waiting for capacity, by latency class and how the wait ended.",
            ["class", "result"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.shed_requests = Counter(
            "kvgate_admission_shed",
            "Requests refused for overload (503), by class and reason.",
            ["class", "reason"],
            registry=registry,
        )
        self.reserved_tokens = Counter(
            "kvgate_quota_reserved_tokens",
            "Tokens reserved against tenants' tokens_per_minute at admission (estimated prompt "
            "plus max_tokens), counted when the request ends.",
            ["tenant"],
            registry=registry,
        )
        self.settled_tokens = Counter(
            "kvgate_quota_settled_tokens",
            "Tokens the same requests were finally charged (their usage).",
            ["tenant"],
            registry=registry,
        )
        self.quota_rejections = Counter(
            "kvgate_quota_rejections",
            "Requests refused by a tenant limit (429), by limit.",
            ["tenant", "limit"],
            registry=registry,
        )

    def settled(self, tenant: str, reserved: int, used: int) -> None:
        label = self.tenant_labels(tenant)
        counters = self._quota_tokens.get(label)
        if counters is None:  # once per tenant: `.labels()` is slow
            counters = (self.reserved_tokens.labels(label), self.settled_tokens.labels(label))
            self._quota_tokens[label] = counters
        counters[0].inc(reserved)
        if used > 0:
            counters[1].inc(used)

    def quota_rejected(self, tenant: str, limit: str) -> None:
        self.quota_rejections.labels(self.tenant_labels(tenant), limit).inc()

    def shed(self, latency_class: str, reason: str) -> None:
        self.shed_requests.labels(latency_class, reason).inc()

    def waited(self, latency_class: str, result: str, seconds: float) -> None:
        self.queue_wait.labels(latency_class, result).observe(seconds)

    def queue_length(self, latency_class: str, length: int) -> None:
        self.queue_lengths.labels(latency_class).set(length)
