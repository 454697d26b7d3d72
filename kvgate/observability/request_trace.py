"""The spans of one request: the request's (server kind), a child per stage that does work, per
upstream attempt (client kind) and per resume, with GenAI semantic-convention and kvgate
attributes (docs/observability.md). The client's W3C `traceparent` is continued; each attempt
sends its own span's context to the engine. Built by kvgate/observability/tracing.py.

Nothing here calls OpenTelemetry per span: ids are drawn with `random.getrandbits` (as the SDK's
own id generator does), times are `time.time_ns()`, attributes go into plain dicts, and when
the request is over its whole trace is handed to the sink as one `TraceRecord`
(kvgate/observability/span_records.py), from which SDK spans are built off the request path.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import SpanKind, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvgate.observability.span_records import (
    NEW_TRACE_FLAGS,
    SAMPLED,
    Attribute,
    ClientParent,
    SpanRecord,
    TraceExport,
)
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
_SERVER = SpanKind.SERVER.value
_CLIENT = SpanKind.CLIENT.value
_INTERNAL = SpanKind.INTERNAL.value
_ERROR = StatusCode.ERROR.value
Attributes = dict[str, Attribute]
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
    """An open span of a request; `end` records it once."""

    __slots__ = (
        "_done",
        "_on_end",
        "_trace",
        "attributes",
        "kind",
        "name",
        "parent",
        "span_id",
        "start",
    )

    def __init__(
        self,
        trace: _RequestTrace,
        name: str,
        kind: int,
        attributes: Attributes,
        on_end: Callable[[Attributes, RequestContext], None] | None,
    ) -> None:
        self._trace = trace
        self.name = name
        self.kind = kind
        self.attributes = attributes
        self._on_end = on_end
        self._done = False
        self.span_id = _span_id()
        self.parent = trace.innermost()
        self.start = time.time_ns()

    def set(self, key: str, value: Attribute) -> None:
        self.attributes[key] = value

    def headers(self) -> Headers:
        return self._trace.context_headers(self.span_id)

    def end(self, error: str | None = None) -> None:
        if self._done:
            return
        self._done = True
        if self._on_end is not None:
            self._on_end(self.attributes, self._trace.ctx)
        self._trace.closed(self, error)


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
    """A request's span (SERVER kind), its open steps and the spans already ended; see
    `RequestTrace` in types.py."""

    __slots__ = (
        "_client",
        "_ended",
        "_flags",
        "_open",
        "_operation",
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
        self._open: list[_Step] = []
        self._ended: list[SpanRecord] = []
        self._operation = _OPERATIONS.get(ctx.route, ctx.route)
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
        return self._open[-1].span_id if self._open else self._root

    def context_headers(self, span_id: int) -> Headers:
        headers = [(b"traceparent", f"{self._trace_hex}{span_id:016x}-{self._flags:02x}".encode())]
        if self._tracestate:
            headers.append((b"tracestate", self._tracestate.encode("latin-1")))
        return headers

    def span(self, name: str) -> _Step | _Folded:
        if name in _FOLDED:
            return _FOLDED_STEP
        step = _Step(self, name, _INTERNAL, {}, _STEP_ATTRIBUTES.get(name))
        self._open.append(step)
        return step

    def attempt(self, endpoint: Endpoint) -> _Step:
        ctx = self.ctx
        operation = self._operation
        host, port = self._tracing.server(endpoint)
        attributes: Attributes = {
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
        step = _Step(self, f"{operation} {ctx.model}", _CLIENT, attributes, _usage)
        self._open.append(step)
        return step

    def closed(self, step: _Step, error: str | None) -> None:
        """Record an ended step (`error`: the code that failed it)."""
        if step in self._open:
            self._open.remove(step)
        attributes = step.attributes
        code, description = 0, None
        if error is not None:
            attributes["error.type"] = error
            code, description = _ERROR, error
        self._ended.append(
            (
                step.name,
                step.kind,
                step.span_id,
                step.parent,
                step.start,
                time.time_ns(),
                attributes,
                code,
                description,
            )
        )

    def finish(self) -> None:
        for step in reversed(self._open):  # a step left open by a bug must not leak
            step.end("interrupted")
        ctx = self.ctx
        attributes: Attributes = {
            "http.request.method": "POST",
            "http.route": ctx.upstream_path,
            "gen_ai.operation.name": self._operation,
            "gen_ai.request.model": self._requested,
            "gen_ai.request.stream": ctx.stream,
            "kvgate.request_id": ctx.request_id,
        }
        code, description = _request_ended(attributes, ctx, self._requested)
        name = f"POST {ctx.upstream_path}"
        end = time.time_ns()
        self._ended.append(
            (name, _SERVER, self._root, 0, self._started, end, attributes, code, description)
        )
        self._tracing.export.send((self.trace_id, self._flags, self._client, self._ended))


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


def _usage(attributes: Attributes, ctx: RequestContext) -> None:
    usage = ctx.usage
    if usage is None:
        return
    for key, attribute in (
        ("prompt_tokens", "gen_ai.usage.input_tokens"),
        ("completion_tokens", "gen_ai.usage.output_tokens"),
    ):
        value = usage.get(key)
        if isinstance(value, int):
            attributes[attribute] = value
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int):
        attributes["gen_ai.usage.cache_read.input_tokens"] = cached
    if ctx.response_model is not None:
        attributes["gen_ai.response.model"] = ctx.response_model


def _request_ended(
    attributes: Attributes, ctx: RequestContext, requested_model: str
) -> tuple[int, str | None]:
    """Fill the request span's closing attributes; its status code and description."""
    attributes["http.response.status_code"] = ctx.status
    attributes["kvgate.outcome"] = ctx.outcome
    attributes["kvgate.attempts"] = ctx.attempts
    attributes["kvgate.resumes"] = ctx.resumes
    _tenant(attributes, ctx)
    _intent(attributes, ctx)
    if ctx.endpoint is not None:
        _endpoint(attributes, ctx)
        attributes["gen_ai.provider.name"] = ctx.endpoint.engine
    if ctx.model != requested_model:  # a routing fallback chose another model
        attributes["kvgate.model"] = ctx.model
    if ctx.first_token_at is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = ctx.first_token_at - ctx.started
    _usage(attributes, ctx)
    if ctx.outcome != "ok":
        attributes["error.type"] = ctx.outcome
        # Server spans: a 4xx is the client's error, not the gateway's; a broken stream is.
        if ctx.status >= 500 or ctx.committed:
            return _ERROR, ctx.outcome
    return 0, None


def _tenant(attributes: Attributes, ctx: RequestContext) -> None:
    if ctx.tenant is not None:
        attributes["kvgate.tenant"] = ctx.tenant.name
        attributes["kvgate.tier"] = ctx.tenant.tier
    if ctx.key_id is not None:
        attributes["kvgate.key_id"] = ctx.key_id


def _intent(attributes: Attributes, ctx: RequestContext) -> None:
    intent = ctx.intent
    if intent is None:
        return
    attributes["kvgate.class"] = intent.latency_class
    attributes["kvgate.prompt_tokens.estimated"] = intent.prompt_tokens
    attributes["gen_ai.request.max_tokens"] = intent.max_tokens
    if intent.rule is not None:
        attributes["kvgate.class.rule"] = intent.rule


def _endpoint(attributes: Attributes, ctx: RequestContext) -> None:
    assert ctx.endpoint is not None
    attributes["kvgate.endpoint"] = ctx.endpoint.name
    attributes["kvgate.pool"] = ctx.endpoint.pool
    if ctx.prefix is not None:
        attributes["kvgate.prefix.predicted_tokens"] = _predicted(ctx, ctx.endpoint.name)
        attributes["kvgate.prefix.prompt_tokens"] = ctx.prefix.prompt_tokens


def _priority(attributes: Attributes, ctx: RequestContext) -> None:
    attributes["kvgate.priority"] = ctx.priority


def _picked(attributes: Attributes, ctx: RequestContext) -> None:
    if ctx.endpoint is not None:
        _endpoint(attributes, ctx)


# What each stage span records when it ends (what that stage decided).
_STEP_ATTRIBUTES: dict[str, Callable[[Attributes, RequestContext], None]] = {
    "kvgate.auth": _tenant,
    "kvgate.classify": _intent,
    "kvgate.admission": _priority,
    "kvgate.pick": _picked,
}
