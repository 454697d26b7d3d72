"""A finished request's trace as plain data (a `TraceRecord`), and the OpenTelemetry SDK spans it
stands for.

The request path records ids, times and the facts that the spans report, in tuples, and makes
no OpenTelemetry call and builds no attribute (kvgate/observability/request_trace.py); the
attributes and the SDK's `ReadableSpan`s are made from the record after the response, by the
exporter process (kvgate/observability/span_export_child.py) or, when a test hands the app an
exporter, in the gateway's process. A record holds only what `marshal` carries (tuples, dicts,
str, int, float, bool, None), so it crosses a pipe as is.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, cast

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

Attribute = str | int | float | bool
Attributes = dict[str, Attribute]
# The engine's usage: prompt, completion and cached prompt tokens (None: not reported).
UsageCounts = tuple[int | None, int | None, int | None]
# An endpoint chosen: its name and pool; with a prefix-aware policy, the prompt tokens the
# prefix index predicted it holds and the prompt's tokens as the index counts them (else None).
PickFacts = tuple[str, str, int | None, int | None]
# One upstream attempt: endpoint, pool, engine kind, host, port, its number in the request,
# tokens predicted cached there (None: not prefix-aware); when it ended, the request's usage
# and the model the engine named.
AttemptFacts = tuple[str, str, str, str, int, int, int | None, UsageCounts | None, str | None]
# One span of a request other than the request's own: name (for an attempt, the model sent to
# the engine), kind (SpanKind's value), span id, parent span id (the request's, or another
# step's), start and end (ns since the epoch), the error code that failed it (None: none), and
# its facts: AttemptFacts for an attempt (CLIENT kind), PickFacts or None for `kvgate.pick`,
# else its attributes or None. The auth, classify and admission stages carry no facts of their
# own: theirs are the request's (RequestFacts), which do not change after those stages.
StepFacts = AttemptFacts | PickFacts | Attributes | None
SpanRecord = tuple[str, int, int, int, int, int, str | None, StepFacts]
# The client's span a request continues: its span id, trace flags and `tracestate` header.
ClientParent = tuple[int, int, str]
# One request's trace: trace id, trace flags of its spans, the client's span (None: a new
# trace), the request's span id, start and end (ns since the epoch), the request's facts (a
# RequestFacts as a plain tuple, its fields in order), and its other spans in the order they
# ended.
TraceRecord = tuple[int, int, ClientParent | None, int, int, int, tuple[Any, ...], list[SpanRecord]]


class RequestFacts(NamedTuple):
    """What a request's span reports, recorded when the request is over (as a plain tuple)."""

    route: str
    path: str
    request_id: str
    requested_model: str
    # The model served (differs from the requested one after a routing fallback).
    model: str
    stream: bool
    status: int
    outcome: str
    # The answer's status line had been sent (a stream that broke after its 200).
    committed: bool
    attempts: int
    resumes: int
    # Tenant name and tier (None: not authenticated), and the key's id.
    tenant: tuple[str, str] | None
    key_id: str | None
    # Latency class, the rule that set it (None: the tier's default), the prompt token
    # estimate and the completion tokens admitted (None: not classified).
    intent: tuple[str, str | None, int, int] | None
    priority: int
    # The last endpoint chosen (None: none), and its engine kind.
    endpoint: PickFacts | None
    engine: str | None
    # Seconds from arrival to the first event relayed (None: none relayed).
    first_token: float | None
    usage: UsageCounts | None
    response_model: str | None


class TraceExport(Protocol):
    """Where finished traces go: started and stopped on the event loop that sends to it."""

    def send(self, record: TraceRecord) -> None:
        """Take one request's trace; must not block (it runs on the request's path)."""

    async def start(self) -> None:
        """Get ready to take traces."""

    async def stop(self) -> None:
        """Export every trace taken so far, then release what `start` took."""


SAMPLED = TraceFlags.SAMPLED
# The SDK marks a trace id it drew at random (W3C Trace Context level 2); kvgate's are.
NEW_TRACE_FLAGS = TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID
CLIENT = SpanKind.CLIENT.value
_KINDS = {kind.value: kind for kind in SpanKind}
_UNSET = Status(StatusCode.UNSET)
# gen_ai.operation.name by route (the Responses API is OpenAI's newer chat interface).
_OPERATIONS = {
    "chat": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "responses": "chat",
}


def scope(version: str) -> InstrumentationScope:
    """The instrumentation scope of kvgate's spans (as `get_tracer("kvgate", version)`)."""
    return InstrumentationScope("kvgate", version)


def readable_spans(
    record: TraceRecord, resource: Resource, instrumentation: InstrumentationScope
) -> list[ReadableSpan]:
    """The SDK spans of one request's trace, in the order they ended (the request's last)."""
    trace_id, flags, client, root_id, started, ended, recorded, steps = record
    facts = RequestFacts._make(recorded)
    operation = _OPERATIONS.get(facts.route, facts.route)
    trace_flags = TraceFlags(flags)
    trace_state = TraceState.from_header([client[2]]) if client and client[2] else None
    parent: SpanContext | None = None
    if client is not None:
        parent = SpanContext(trace_id, client[0], True, TraceFlags(client[1]), trace_state)
    contexts = {
        span_id: SpanContext(trace_id, span_id, False, trace_flags, trace_state)
        for span_id in (root_id, *(step[2] for step in steps))
    }

    def span(
        name: str,
        kind: int,
        span_id: int,
        parent_context: SpanContext | None,
        start: int,
        end: int,
        attributes: Attributes,
        status: Status,
    ) -> ReadableSpan:
        return ReadableSpan(
            name=name,
            context=contexts[span_id],
            parent=parent_context,
            resource=resource,
            attributes=attributes,
            kind=_KINDS[kind],
            status=status,
            start_time=start,
            end_time=end,
            instrumentation_scope=instrumentation,
        )

    spans = []
    for name, kind, span_id, parent_id, start, end, error, step_facts in steps:
        if kind == CLIENT:
            attributes = _attempt(operation, name, cast(AttemptFacts, step_facts))
            name = f"{operation} {name}"
        else:
            attributes = _step(name, facts, step_facts)
        status = _UNSET
        if error is not None:
            attributes["error.type"] = error
            status = Status(StatusCode.ERROR, error)
        spans.append(span(name, kind, span_id, contexts[parent_id], start, end, attributes, status))
    attributes, status = _request(operation, facts)
    spans.append(
        span(
            f"POST {facts.path}",
            SpanKind.SERVER.value,
            root_id,
            parent,
            started,
            ended,
            attributes,
            status,
        )
    )
    return spans


def _request(operation: str, facts: RequestFacts) -> tuple[Attributes, Status]:
    """The request span's attributes and status."""
    attributes: Attributes = {
        "http.request.method": "POST",
        "http.route": facts.path,
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": facts.requested_model,
        "gen_ai.request.stream": facts.stream,
        "kvgate.request_id": facts.request_id,
        "http.response.status_code": facts.status,
        "kvgate.outcome": facts.outcome,
        "kvgate.attempts": facts.attempts,
        "kvgate.resumes": facts.resumes,
    }
    _tenant(attributes, facts)
    _intent(attributes, facts)
    if facts.endpoint is not None:
        _endpoint(attributes, facts.endpoint)
    if facts.engine is not None:
        attributes["gen_ai.provider.name"] = facts.engine
    if facts.model != facts.requested_model:  # a routing fallback chose another model
        attributes["kvgate.model"] = facts.model
    if facts.first_token is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = facts.first_token
    _usage(attributes, facts.usage, facts.response_model)
    if facts.outcome == "ok":
        return attributes, _UNSET
    attributes["error.type"] = facts.outcome
    # Server spans: a 4xx is the client's error, not the gateway's; a broken stream is.
    if facts.status >= 500 or facts.committed:
        return attributes, Status(StatusCode.ERROR, facts.outcome)
    return attributes, _UNSET


def _step(name: str, facts: RequestFacts, step_facts: object) -> Attributes:
    """A step's attributes: what its stage decided, or what it recorded."""
    attributes: Attributes = {}
    if name == "kvgate.auth":
        _tenant(attributes, facts)
    elif name == "kvgate.classify":
        _intent(attributes, facts)
    elif name == "kvgate.admission":
        attributes["kvgate.priority"] = facts.priority
    elif name == "kvgate.pick":
        if step_facts is not None:
            _endpoint(attributes, cast(PickFacts, step_facts))
    elif step_facts is not None:
        attributes.update(cast(Attributes, step_facts))
    return attributes


def _attempt(operation: str, model: str, facts: AttemptFacts) -> Attributes:
    endpoint, pool, engine, host, port, number, predicted, usage, response_model = facts
    attributes: Attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": engine,
        "gen_ai.request.model": model,
        "server.address": host,
        "server.port": port,
        "kvgate.endpoint": endpoint,
        "kvgate.pool": pool,
        "kvgate.attempt": number,
    }
    if predicted is not None:
        attributes["kvgate.prefix.predicted_tokens"] = predicted
    _usage(attributes, usage, response_model)
    return attributes


def _tenant(attributes: Attributes, facts: RequestFacts) -> None:
    if facts.tenant is not None:
        attributes["kvgate.tenant"], attributes["kvgate.tier"] = facts.tenant
    if facts.key_id is not None:
        attributes["kvgate.key_id"] = facts.key_id


def _intent(attributes: Attributes, facts: RequestFacts) -> None:
    if facts.intent is None:
        return
    latency_class, rule, estimated, max_tokens = facts.intent
    attributes["kvgate.class"] = latency_class
    attributes["kvgate.prompt_tokens.estimated"] = estimated
    attributes["gen_ai.request.max_tokens"] = max_tokens
    if rule is not None:
        attributes["kvgate.class.rule"] = rule


def _endpoint(attributes: Attributes, pick: PickFacts) -> None:
    name, pool, predicted, prompt_tokens = pick
    attributes["kvgate.endpoint"] = name
    attributes["kvgate.pool"] = pool
    if predicted is not None and prompt_tokens is not None:
        attributes["kvgate.prefix.predicted_tokens"] = predicted
        attributes["kvgate.prefix.prompt_tokens"] = prompt_tokens


def _usage(attributes: Attributes, usage: UsageCounts | None, response_model: str | None) -> None:
    if usage is not None:
        for value, attribute in zip(usage, _USAGE_ATTRIBUTES, strict=True):
            if value is not None:
                attributes[attribute] = value
    if response_model is not None:
        attributes["gen_ai.response.model"] = response_model


_USAGE_ATTRIBUTES = (
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.cache_read.input_tokens",
)
