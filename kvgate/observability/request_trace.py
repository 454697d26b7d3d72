"""The spans of one request: the request's (server kind), a child per stage that does work, per
upstream attempt (client kind) and per resume, with GenAI semantic-convention and kvgate
attributes (docs/observability.md). The client's W3C `traceparent` is continued; each attempt
sends its own span's context to the engine. Built by kvgate/observability/tracing.py.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import (
    Span,
    SpanKind,
    Status,
    StatusCode,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvgate import __version__
from kvgate.routing.endpoints import Endpoint
from kvgate.types import Headers, RequestContext

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = {b"traceparent": "traceparent", b"tracestate": "tracestate"}
# gen_ai.operation.name by route (the Responses API is OpenAI's newer chat interface).
_OPERATIONS = {
    "chat": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "responses": "chat",
}
Attribute = str | int | float | bool


class GatewayTracing:
    """The chain's `Tracing`: decides whether a request is traced and starts its trace.

    Sampling is parent-based, decided here before any span exists, so that a request not
    traced costs one scan of its headers and nothing else: a client's `traceparent` decides by
    its sampled flag (a request it does not sample keeps that `traceparent`, passed on to the
    engine untouched); a request without one is traced with probability `ratio`."""

    def __init__(self, provider: TracerProvider, ratio: float) -> None:
        self.provider = provider
        self.ratio = ratio
        self.tracer = provider.get_tracer("kvgate", __version__)
        self._servers: dict[str, tuple[str, int]] = {}

    def start(self, ctx: RequestContext) -> _RequestTrace | None:
        client = _client_context(ctx.client_headers)
        if client is None:
            if self.ratio < 1.0 and random.random() >= self.ratio:
                return None
        elif not get_current_span(client).get_span_context().trace_flags.sampled:
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

    def shutdown(self) -> None:
        """Export what is still buffered, then stop (blocks up to the exporter's timeout)."""
        self.provider.shutdown()


class _Step:
    """An open span of a request; `end` closes it once."""

    __slots__ = ("_done", "_on_end", "_trace", "span")

    def __init__(
        self,
        trace: _RequestTrace,
        span: Span,
        on_end: Callable[[Span, RequestContext], None] | None = None,
    ) -> None:
        self._trace = trace
        self.span = span
        self._on_end = on_end
        self._done = False

    def set(self, key: str, value: Attribute) -> None:
        self.span.set_attribute(key, value)

    def headers(self) -> Headers:
        return _context_headers(self.span)

    def end(self, error: str | None = None) -> None:
        if self._done:
            return
        self._done = True
        if self._on_end is not None:
            self._on_end(self.span, self._trace.ctx)
        if error is not None:
            _failed(self.span, error)
        self.span.end()
        self._trace.closed(self)


class _Folded:
    """A stage without a span of its own (see `_FOLDED`)."""

    __slots__ = ()

    def set(self, key: str, value: Attribute) -> None:
        pass

    def headers(self) -> Headers:
        return []

    def end(self, error: str | None = None) -> None:
        pass


# Stages that only read the config and the fleet's state (no I/O, no waiting), whose outcome
# the request span records (a fallback model: `kvgate.model`; the responses gate's 404: the
# request's status): a span each would cost as much as a real stage's and show nothing.
_FOLDED = frozenset({"kvgate.responses", "kvgate.model_fallback"})
_FOLDED_STEP = _Folded()


class _RequestTrace:
    """A request's span (SERVER kind) and its open steps; see `RequestTrace` in types.py."""

    __slots__ = ("_open", "_operation", "_requested", "_root", "_tracing", "ctx")

    def __init__(
        self, tracing: GatewayTracing, ctx: RequestContext, client: Context | None
    ) -> None:
        self._tracing = tracing
        self.ctx = ctx
        self._open: list[_Step] = []
        self._operation = _OPERATIONS.get(ctx.route, ctx.route)
        self._requested = ctx.model
        started = time.time_ns() - int((time.perf_counter() - ctx.started) * 1e9)
        self._root = tracing.tracer.start_span(
            f"POST {ctx.upstream_path}",
            context=client,
            kind=SpanKind.SERVER,
            start_time=started,
            attributes={
                "http.request.method": "POST",
                "http.route": ctx.upstream_path,
                "gen_ai.operation.name": self._operation,
                "gen_ai.request.model": ctx.model,
                "gen_ai.request.stream": ctx.stream,
                "kvgate.request_id": ctx.request_id,
            },
        )

    def _parent(self) -> Context:
        return set_span_in_context(self._open[-1].span if self._open else self._root)

    def span(self, name: str) -> _Step | _Folded:
        if name in _FOLDED:
            return _FOLDED_STEP
        span = self._tracing.tracer.start_span(name, context=self._parent())
        step = _Step(self, span, _STEP_ATTRIBUTES.get(name))
        self._open.append(step)
        return step

    def attempt(self, endpoint: Endpoint) -> _Step:
        ctx = self.ctx
        operation = self._operation
        host, port = self._tracing.server(endpoint)
        attributes: dict[str, Attribute] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": endpoint.engine,
            "gen_ai.request.model": ctx.model,
            "server.address": host,
            "server.port": port,
            "kvgate.endpoint": endpoint.name,
            "kvgate.pool": endpoint.pool,
            "kvgate.attempt": ctx.attempts,
        }
        if ctx.prefix is not None:
            attributes["kvgate.prefix.predicted_tokens"] = _predicted(ctx, endpoint.name)
        span = self._tracing.tracer.start_span(
            f"{operation} {ctx.model}",
            context=self._parent(),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )
        step = _Step(self, span, _attempt_ended)
        self._open.append(step)
        return step

    def closed(self, step: _Step) -> None:
        if step in self._open:
            self._open.remove(step)

    def finish(self) -> None:
        for step in reversed(self._open):  # a step left open by a bug must not leak
            step.end("interrupted")
        _request_ended(self._root, self.ctx, self._requested)
        self._root.end()


def _context_headers(span: Span) -> Headers:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, set_span_in_context(span))
    return [(name.encode(), value.encode("latin-1")) for name, value in carrier.items()]


def _client_context(headers: Headers) -> Context | None:
    """The client's trace context (a valid W3C traceparent, and tracestate), or None."""
    carrier = {
        _TRACE_HEADERS[name]: value.decode("latin-1")
        for name, value in headers
        if name in _TRACE_HEADERS
    }
    if not carrier:
        return None
    context = _PROPAGATOR.extract(carrier)
    return context if get_current_span(context).get_span_context().is_valid else None


def _failed(span: Span, error: str) -> None:
    span.set_attribute("error.type", error)
    span.set_status(Status(StatusCode.ERROR, error))


def _predicted(ctx: RequestContext, endpoint: str) -> int:
    """Prompt tokens the prefix index predicted `endpoint` holds for this request."""
    assert ctx.prefix is not None
    return ctx.prefix.prompt_tokens - ctx.prefix.uncached_tokens(endpoint)


def _usage(span: Span, ctx: RequestContext) -> None:
    usage = ctx.usage
    if usage is None:
        return
    for key, attribute in (
        ("prompt_tokens", "gen_ai.usage.input_tokens"),
        ("completion_tokens", "gen_ai.usage.output_tokens"),
    ):
        value = usage.get(key)
        if isinstance(value, int):
            span.set_attribute(attribute, value)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", cached)
    if ctx.response_model is not None:
        span.set_attribute("gen_ai.response.model", ctx.response_model)


def _attempt_ended(span: Span, ctx: RequestContext) -> None:
    _usage(span, ctx)


def _request_ended(span: Span, ctx: RequestContext, requested_model: str) -> None:
    span.set_attribute("http.response.status_code", ctx.status)
    span.set_attribute("kvgate.outcome", ctx.outcome)
    span.set_attribute("kvgate.attempts", ctx.attempts)
    span.set_attribute("kvgate.resumes", ctx.resumes)
    _tenant(span, ctx)
    _intent(span, ctx)
    if ctx.endpoint is not None:
        _endpoint(span, ctx)
        span.set_attribute("gen_ai.provider.name", ctx.endpoint.engine)
    if ctx.model != requested_model:  # a routing fallback chose another model
        span.set_attribute("kvgate.model", ctx.model)
    if ctx.first_token_at is not None:
        span.set_attribute("gen_ai.response.time_to_first_chunk", ctx.first_token_at - ctx.started)
    _usage(span, ctx)
    if ctx.outcome != "ok":
        span.set_attribute("error.type", ctx.outcome)
        # Server spans: a 4xx is the client's error, not the gateway's; a broken stream is.
        if ctx.status >= 500 or ctx.committed:
            span.set_status(Status(StatusCode.ERROR, ctx.outcome))


def _tenant(span: Span, ctx: RequestContext) -> None:
    if ctx.tenant is not None:
        span.set_attribute("kvgate.tenant", ctx.tenant.name)
        span.set_attribute("kvgate.tier", ctx.tenant.tier)
    if ctx.key_id is not None:
        span.set_attribute("kvgate.key_id", ctx.key_id)


def _intent(span: Span, ctx: RequestContext) -> None:
    intent = ctx.intent
    if intent is None:
        return
    span.set_attribute("kvgate.class", intent.latency_class)
    span.set_attribute("kvgate.prompt_tokens.estimated", intent.prompt_tokens)
    span.set_attribute("gen_ai.request.max_tokens", intent.max_tokens)
    if intent.rule is not None:
        span.set_attribute("kvgate.class.rule", intent.rule)


def _endpoint(span: Span, ctx: RequestContext) -> None:
    assert ctx.endpoint is not None
    span.set_attribute("kvgate.endpoint", ctx.endpoint.name)
    span.set_attribute("kvgate.pool", ctx.endpoint.pool)
    if ctx.prefix is not None:
        span.set_attribute("kvgate.prefix.predicted_tokens", _predicted(ctx, ctx.endpoint.name))
        span.set_attribute("kvgate.prefix.prompt_tokens", ctx.prefix.prompt_tokens)


def _priority(span: Span, ctx: RequestContext) -> None:
    span.set_attribute("kvgate.priority", ctx.priority)


# What each stage span records when it ends (what that stage decided).
_STEP_ATTRIBUTES: dict[str, Callable[[Span, RequestContext], None]] = {
    "kvgate.auth": _tenant,
    "kvgate.classify": _intent,
    "kvgate.admission": _priority,
    "kvgate.pick": lambda span, ctx: _endpoint(span, ctx) if ctx.endpoint is not None else None,
}
