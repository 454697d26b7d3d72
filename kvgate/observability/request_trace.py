"""The spans of one request: the request's (server kind), a child per stage that does work, per
upstream attempt (client kind) and per resume (docs/observability.md). The client's W3C
`traceparent` is continued; each attempt sends its own span's context to the engine. Built by
kvgate/observability/tracing.py.

What runs before the answer is as little as it can be, because in a serving process it runs
with cold caches, where each distinct call costs several times what a timing loop shows: the
trace id is drawn (`random.getrandbits`, as the SDK's own id generator does), the chain appends
`time.perf_counter()` as each stage ends, and an attempt draws the one span id that leaves the
process and formats its `traceparent`. The other span ids, the wall-clock times and every
fact are settled in `finish`, after the answer's last byte, and the whole trace is handed to
the sink as one `TraceRecord` (kvgate/observability/span_records.py), from which the
attributes and the SDK spans are made off the request path.
"""

from __future__ import annotations

import random
import time
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import SpanKind, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvgate.observability.span_records import (
    CLIENT,
    NEW_TRACE_FLAGS,
    ROOT,
    SAMPLED,
    Attributes,
    ClientParent,
    PickFacts,
    SpanRecord,
    StepFacts,
    TraceExport,
    UsageCounts,
    new_span_id,
    stage_parent,
)
from kvgate.response_routes import TEMPLATES
from kvgate.routing.endpoints import Endpoint
from kvgate.types import Headers, RequestContext

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = {b"traceparent": "traceparent", b"tracestate": "tracestate"}
_INTERNAL = SpanKind.INTERNAL.value
# The client's trace: its trace id, trace flags, and the request span's parent as recorded.
_ClientContext = tuple[int, int, ClientParent]


class GatewayTracing:
    """The chain's `Tracing`: decides whether a request is traced and starts its trace.

    Sampling is parent-based, decided here before any span exists, so that a request not
    traced costs one scan of its headers and nothing else: a client's `traceparent` decides by
    its sampled flag (a request it does not sample keeps that `traceparent`, passed on to the
    engine untouched); a request without one is traced with probability `ratio`. Each traced
    request's record goes to `export` once, after its answer's last byte; `resource` is what
    the exported spans carry."""

    def __init__(self, export: TraceExport, ratio: float, resource: Resource) -> None:
        self.export = export
        self.ratio = ratio
        self.resource = resource
        self._servers: dict[str, tuple[str, int]] = {}

    async def open(self) -> None:
        """Ready the export (an exporter process starts); call on the serving event loop."""
        await self.export.start()

    async def shutdown(self) -> None:
        """Export every finished trace, then stop (may wait up to the exporter's timeout)."""
        await self.export.stop()

    def start(self, ctx: RequestContext, stages: tuple[str, ...]) -> _RequestTrace | None:
        client = _client_parent(ctx.client_headers)
        if client is None:
            if self.ratio < 1.0 and random.random() >= self.ratio:
                return None
        elif not client[1] & SAMPLED:
            return None
        return _RequestTrace(self, ctx, client, stages)

    def server(self, endpoint: Endpoint) -> tuple[str, int]:
        """The engine's host and port (server.address, server.port), parsed once."""
        known = self._servers.get(endpoint.url)
        if known is None:
            parts = urlsplit(endpoint.url)
            default = 443 if parts.scheme == "https" else 80
            known = self._servers[endpoint.url] = (parts.hostname or "", parts.port or default)
        return known


class _Step:
    """An open span of a request other than a stage's (a wait, a resume); `end` records it
    once. `facts`: its attributes (span_records.SpanRecord)."""

    __slots__ = ("_done", "_trace", "facts", "kind", "name", "parent", "span_id", "start")

    def __init__(self, trace: _RequestTrace, name: str, kind: int, facts: Any) -> None:
        self._trace = trace
        self.name = name
        self.kind = kind
        self.facts = facts
        self._done = False
        self.span_id = new_span_id()
        self.parent = trace.innermost()
        self.start = time.perf_counter()

    def headers(self) -> Headers:
        return self._trace.context_headers(self.span_id)

    def end(self, error: str | None = None) -> None:
        if not self._done:
            self._done = True
            self._trace.closed(self, error, self.facts)


class _Attempt(_Step):
    """An upstream attempt's span: until it ends, its facts are the endpoint and the attempt's
    number; then they become span_records.AttemptFacts."""

    __slots__ = ()

    def end(self, error: str | None = None) -> None:
        if not self._done:
            self._done = True
            self._trace.closed(self, error, self._trace.attempt_facts(*self.facts))


class _RequestTrace:
    """A request's span (SERVER kind), the times its stages ended, its open steps and the
    spans already ended; see `RequestTrace` in types.py."""

    __slots__ = (
        "_client",
        "_ended",
        "_failed",
        "_first_attempt",
        "_flags",
        "_open",
        "_requested",
        "_stages",
        "_tracestate",
        "_tracing",
        "ctx",
        "stage_ends",
        "trace_id",
    )

    def __init__(
        self,
        tracing: GatewayTracing,
        ctx: RequestContext,
        client: _ClientContext | None,
        stages: tuple[str, ...],
    ) -> None:
        self._tracing = tracing
        self.ctx = ctx
        self._stages = stages
        # When the stages started, then when each ended (time.perf_counter()).
        self.stage_ends = [time.perf_counter()]
        self._failed: tuple[float, str] | None = None
        self._open: list[int] = []
        self._ended: list[SpanRecord] = []
        self._first_attempt: Endpoint | None = None
        self._requested = ctx.model
        if client is None:
            self.trace_id = _trace_id()
            self._flags = NEW_TRACE_FLAGS
            self._client: ClientParent | None = None
            self._tracestate = ""
        else:
            self.trace_id, client_flags, self._client = client
            # As the SDK: sampled, and random-trace-id only if the client's trace says so.
            self._flags = SAMPLED | (client_flags & (NEW_TRACE_FLAGS ^ SAMPLED))
            self._tracestate = self._client[2]

    def stage_failed(self, error: str) -> None:
        self._failed = (time.perf_counter(), error)

    def innermost(self) -> int:
        """The parent of a new span (span_records.SpanRecord): the innermost open step, else
        the stage under way, else the request."""
        if self._open:
            return self._open[-1]
        running = len(self.stage_ends) - 1
        if running < len(self._stages) and self._failed is None:
            return stage_parent(running)
        return ROOT

    def context_headers(self, span_id: int) -> Headers:
        traceparent = b"00-%032x-%016x-%02x" % (self.trace_id, span_id, self._flags)
        if not self._tracestate:
            return [(b"traceparent", traceparent)]
        return [(b"traceparent", traceparent), (b"tracestate", self._tracestate.encode("latin-1"))]

    def span(self, name: str, attributes: Attributes | None = None) -> _Step:
        step = _Step(self, name, _INTERNAL, attributes)
        self._open.append(step.span_id)
        return step

    def attempt(self, endpoint: Endpoint) -> _Attempt:
        if self._first_attempt is None:
            self._first_attempt = endpoint
        step = _Attempt(self, self.ctx.model, CLIENT, (endpoint, self.ctx.attempts))
        self._open.append(step.span_id)
        return step

    def attempt_facts(self, endpoint: Endpoint, number: int) -> StepFacts:
        """An attempt's span_records.AttemptFacts, when it has ended."""
        ctx = self.ctx
        host, port = self._tracing.server(endpoint)
        predicted = None if ctx.prefix is None else _predicted(ctx, endpoint.name)
        return (
            endpoint.name,
            endpoint.pool,
            endpoint.engine,
            host,
            port,
            number,
            predicted,
            _usage(ctx.usage),
            ctx.response_model,
        )

    def closed(self, step: _Step, error: str | None, facts: StepFacts) -> None:
        """Record an ended step (`error`: the code that failed it)."""
        if step.span_id in self._open:
            self._open.remove(step.span_id)
        self._ended.append(
            (
                step.name,
                step.kind,
                step.span_id,
                step.parent,
                step.start,
                time.perf_counter(),
                error,
                facts,
            )
        )

    def finish(self) -> None:
        ctx = self.ctx
        ended = time.perf_counter()
        clock = time.time_ns() - round(ended * 1e9)
        tenant = ctx.tenant
        intent = ctx.intent
        endpoint = ctx.endpoint
        first_token = ctx.first_token_at
        # The pick stage's choice: the first attempt goes to it; without one the context
        # still names it (only a retry changes it).
        first = self._first_attempt
        last = None if endpoint is None else _endpoint(ctx, endpoint)
        picked = last if first is None or first is endpoint else _endpoint(ctx, first)
        facts = (  # a span_records.RequestFacts, field by field
            ctx.route,
            TEMPLATES.get(ctx.route, ctx.upstream_path),
            ctx.request_id,
            self._requested,
            ctx.model,
            ctx.stream,
            ctx.status,
            ctx.outcome,
            ctx.committed,
            ctx.attempts,
            ctx.resumes,
            None if tenant is None else (tenant.name, tenant.tier),
            ctx.key_id,
            None
            if intent is None
            else (intent.latency_class, intent.rule, intent.prompt_tokens, intent.max_tokens),
            ctx.priority,
            last,
            picked,
            None if endpoint is None else endpoint.engine,
            None if first_token is None else first_token - ctx.started,
            _usage(ctx.usage),
            ctx.response_model,
            ctx.method.decode(),
        )
        record = (
            self.trace_id,
            self._flags,
            self._client,
            clock,
            ctx.started,
            ended,
            facts,
            self._stages,
            self.stage_ends,
            self._failed,
            self._ended,
        )
        self._tracing.export.send(record)


def _client_parent(headers: Headers) -> _ClientContext | None:
    """The client's trace context (a valid W3C traceparent, and tracestate), or None."""
    carrier = {
        _TRACE_HEADERS[name]: value.decode("latin-1")
        for name, value in headers
        if name in _TRACE_HEADERS
    }
    if not carrier:
        return None
    context = get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    if not context.is_valid:
        return None
    flags = int(context.trace_flags)
    return context.trace_id, flags, (context.span_id, flags, context.trace_state.to_header())


def _trace_id() -> int:
    while True:
        drawn = random.getrandbits(128)
        if drawn:
            return drawn


def _predicted(ctx: RequestContext, endpoint: str) -> int:
    """Prompt tokens the prefix index predicted `endpoint` holds for this request."""
    assert ctx.prefix is not None
    return ctx.prefix.prompt_tokens - ctx.prefix.uncached_tokens(endpoint)


def _endpoint(ctx: RequestContext, endpoint: Endpoint) -> PickFacts:
    prefix = ctx.prefix
    if prefix is None:
        return (endpoint.name, endpoint.pool, None, None)
    return (endpoint.name, endpoint.pool, _predicted(ctx, endpoint.name), prefix.prompt_tokens)


def _usage(usage: dict[str, Any] | None) -> UsageCounts | None:
    """The engine's prompt, completion and cached prompt tokens (each None when absent)."""
    if usage is None:
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if isinstance(prompt, int) else None,
        completion if isinstance(completion, int) else None,
        cached if isinstance(cached, int) else None,
    )
