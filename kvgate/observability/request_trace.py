"""The spans of one request: the request's (server kind), a child per stage that does work, per
upstream attempt (client kind) and per resume (docs/observability.md). The client's W3C
`traceparent` is continued; each attempt sends its own span's context to the engine. Built by
kvgate/observability/tracing.py.

Nothing here calls OpenTelemetry or builds an attribute: ids are drawn with
`random.getrandbits` (as the SDK's own id generator does), times are `time.time_ns()`, and a
span keeps only the facts its attributes will say, in a tuple. When the request is over its
whole trace is handed to the sink as one `TraceRecord` (kvgate/observability/span_records.py),
from which the attributes and the SDK spans are made off the request path.
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
    SAMPLED,
    Attributes,
    ClientParent,
    PickFacts,
    SpanRecord,
    StepFacts,
    TraceExport,
    UsageCounts,
)
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

    def start(self, ctx: RequestContext) -> _RequestTrace | None:
        client = _client_parent(ctx.client_headers)
        if client is None:
            if self.ratio < 1.0 and random.random() >= self.ratio:
                return None
        elif not client[1] & SAMPLED:
            return None
        return _RequestTrace(self, ctx, client)

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

    def __init__(self, trace: _RequestTrace, name: str, kind: int, facts: StepFacts) -> None:
        self._trace = trace
        self.name = name
        self.kind = kind
        self.facts = facts
        self._done = False
        self.span_id = _span_id()
        self.parent = trace.innermost()
        self.start = time.time_ns()

    def headers(self) -> Headers:
        return self._trace.context_headers(self.span_id)

    def end(self, error: str | None = None) -> None:
        if not self._done:
            self._done = True
            self._trace.closed(self, error)


# An attempt's facts known when it starts (span_records.AttemptFacts without the usage and
# the response model).
_AttemptStart = tuple[str, str, str, str, int, int, int | None]


class _Attempt(_Step):
    """An upstream attempt's span: its facts are completed with the usage when it ends."""

    __slots__ = ("_at_start",)

    def __init__(self, trace: _RequestTrace, model: str, at_start: _AttemptStart) -> None:
        super().__init__(trace, model, CLIENT, None)
        self._at_start = at_start

    def end(self, error: str | None = None) -> None:
        if not self._done:
            ctx = self._trace.ctx
            self.facts = (*self._at_start, _usage(ctx.usage), ctx.response_model)
            super().end(error)


# Stages that only read the config and the fleet's state (no I/O, no waiting), whose outcome
# the request span records (a fallback model: `kvgate.model`; the responses gate's 404: the
# request's status): a span each would cost as much as a real stage's and show nothing.
_FOLDED = frozenset({"kvgate.responses", "kvgate.model_fallback"})
# What `stage_started` gives `stage_ended`: the stage span's id, its parent's, and its start.
_OpenStage = tuple[int, int, int]


class _RequestTrace:
    """A request's span (SERVER kind), the ids of its open steps and the spans already ended;
    see `RequestTrace` in types.py."""

    __slots__ = (
        "_client",
        "_ended",
        "_flags",
        "_open",
        "_requested",
        "_root",
        "_started",
        "_trace_hex",
        "_tracestate",
        "_tracing",
        "ctx",
        "trace_id",
    )

    def __init__(
        self, tracing: GatewayTracing, ctx: RequestContext, client: _ClientContext | None
    ) -> None:
        self._tracing = tracing
        self.ctx = ctx
        self._open: list[int] = []
        self._ended: list[SpanRecord] = []
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
        self._trace_hex = f"00-{self.trace_id:032x}-"
        self._root = _span_id()
        self._started = time.time_ns() - int((time.perf_counter() - ctx.started) * 1e9)

    def innermost(self) -> int:
        """The span id a new span's parent is: the innermost open step, else the request."""
        return self._open[-1] if self._open else self._root

    def context_headers(self, span_id: int) -> Headers:
        headers = [(b"traceparent", f"{self._trace_hex}{span_id:016x}-{self._flags:02x}".encode())]
        if self._tracestate:
            headers.append((b"tracestate", self._tracestate.encode("latin-1")))
        return headers

    def stage_started(self, name: str) -> _OpenStage | None:
        if name in _FOLDED:
            return None
        span_id = _span_id()
        opened = (span_id, self.innermost(), time.time_ns())
        self._open.append(span_id)
        return opened

    def stage_ended(self, name: str, opened: _OpenStage | None, error: str | None) -> None:
        if opened is None:
            return
        span_id, parent, start = opened
        self._open.remove(span_id)
        facts = _picked(self.ctx) if name == "kvgate.pick" else None
        self._ended.append((name, _INTERNAL, span_id, parent, start, time.time_ns(), error, facts))

    def span(self, name: str, attributes: Attributes | None = None) -> _Step:
        step = _Step(self, name, _INTERNAL, attributes)
        self._open.append(step.span_id)
        return step

    def attempt(self, endpoint: Endpoint) -> _Attempt:
        ctx = self.ctx
        host, port = self._tracing.server(endpoint)
        predicted = None if ctx.prefix is None else _predicted(ctx, endpoint.name)
        facts = (endpoint.name, endpoint.pool, endpoint.engine, host, port, ctx.attempts, predicted)
        step = _Attempt(self, ctx.model, facts)
        self._open.append(step.span_id)
        return step

    def closed(self, step: _Step, error: str | None) -> None:
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
                time.time_ns(),
                error,
                step.facts,
            )
        )

    def finish(self) -> None:
        ctx = self.ctx
        end = time.time_ns()
        tenant = ctx.tenant
        intent = ctx.intent
        endpoint = ctx.endpoint
        first_token = ctx.first_token_at
        facts = (  # a span_records.RequestFacts, field by field
            ctx.route,
            ctx.upstream_path,
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
            None if endpoint is None else _endpoint(ctx, endpoint),
            None if endpoint is None else endpoint.engine,
            None if first_token is None else first_token - ctx.started,
            _usage(ctx.usage),
            ctx.response_model,
        )
        record = (
            self.trace_id,
            self._flags,
            self._client,
            self._root,
            self._started,
            end,
            facts,
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


def _span_id() -> int:
    while True:
        drawn = random.getrandbits(64)
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


def _picked(ctx: RequestContext) -> PickFacts | None:
    return None if ctx.endpoint is None else _endpoint(ctx, ctx.endpoint)


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
