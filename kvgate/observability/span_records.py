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

import functools
import random
from collections.abc import Callable
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
# A step's facts: AttemptFacts for an attempt (CLIENT kind), else its attributes or None.
StepFacts = AttemptFacts | Attributes | None
# One span of a request that is neither the request's nor a stage's (an attempt, a wait, a
# resume): name (for an attempt, the model sent to the engine), kind (SpanKind's value), span
# id, parent (ROOT: the request's span; `stage_parent(k)`: stage k's; else another step's span
# id), start and end (`time.perf_counter()`), the error code that failed it (None: none), and
# its facts.
SpanRecord = tuple[str, int, int, int, float, float, str | None, StepFacts]
# The client's span a request continues: its span id, trace flags and `tracestate` header.
ClientParent = tuple[int, int, str]
# When a stage failed (`time.perf_counter()`), and the error code that failed it.
StageFailure = tuple[float, str]
# One request's trace: trace id, trace flags of its spans, the client's span (None: a new
# trace), the clock (ns since the epoch at `time.perf_counter()` 0), the request's start and
# end (`time.perf_counter()`), the request's facts (a RequestFacts as a plain tuple, its
# fields in order), the chain's stage names, when the stages started and then when each
# ended, the stage that failed (the one after the last that ended; None: none), and the
# steps in the order they ended. The request's span and its stages' get their span ids when
# the spans are made: none of them leaves the gateway.
TraceRecord = tuple[
    int,
    int,
    ClientParent | None,
    int,
    float,
    float,
    tuple[Any, ...],
    tuple[str, ...],
    list[float],
    StageFailure | None,
    list[SpanRecord],
]
# The parent of a span that is the request's own child.
ROOT = 0
# Stages that only read the config and the fleet's state (no I/O, no waiting), whose outcome
# the request span records (a fallback model: `kvgate.model`; the responses gate's 404 and the
# stored-response stage's 404 or 503: the request's status; the endpoint a response id names:
# `kvgate.endpoint`): a span each would cost as much as a real stage's and show nothing.
FOLDED = frozenset({"kvgate.responses", "kvgate.model_fallback", "kvgate.stored_response"})


def stage_parent(stage: int) -> int:
    """The parent (SpanRecord) that names the span of the chain's `stage`-th stage."""
    return -1 - stage


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
    # The last endpoint chosen (None: none), the one the pick stage chose, and the last's
    # engine kind.
    endpoint: PickFacts | None
    picked: PickFacts | None
    engine: str | None
    # Seconds from arrival to the first event relayed (None: none relayed).
    first_token: float | None
    usage: UsageCounts | None
    response_model: str | None
    # The HTTP method (other than POST on the `/v1/responses/{id}` routes, whose `path` is the
    # route's template, never a response id).
    method: str = "POST"


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
_INTERNAL = SpanKind.INTERNAL.value
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


def new_span_id() -> int:
    """A span id as the SDK draws one (64 random bits, never 0)."""
    while True:
        drawn = random.getrandbits(64)
        if drawn:
            return drawn


def span_count(record: TraceRecord) -> int:
    """How many spans `readable_spans` makes of `record`."""
    ends, failed = record[8], record[9]
    return 1 + len(record[10]) + _stage_spans(record[7], len(ends) - (failed is None))


@functools.lru_cache(maxsize=64)
def _stage_spans(stages: tuple[str, ...], started: int) -> int:
    """Spans of the first `started` of these stages (the folded ones make none)."""
    return sum(1 for name in stages[:started] if name not in FOLDED)


def readable_spans(
    record: TraceRecord,
    resource: Resource,
    instrumentation: InstrumentationScope,
    span_ids: Callable[[], int] = new_span_id,
) -> list[ReadableSpan]:
    """The SDK spans of one request's trace, in the order they ended (the request's last).
    `span_ids` draws the ids of the request's span and its stages' (in that order)."""
    trace_id, flags, client, clock, started, ended, recorded, stages, ends, failed, steps = record
    facts = RequestFacts._make(recorded)
    operation = _OPERATIONS.get(facts.route, facts.route)
    trace_flags = TraceFlags(flags)
    trace_state = TraceState.from_header([client[2]]) if client and client[2] else None
    parent: SpanContext | None = None
    if client is not None:
        parent = SpanContext(trace_id, client[0], True, TraceFlags(client[1]), trace_state)

    def context(span_id: int) -> SpanContext:
        return SpanContext(trace_id, span_id, False, trace_flags, trace_state)

    def ns(time: float) -> int:
        return clock + round(time * 1e9)

    def span(
        name: str,
        kind: int,
        own: SpanContext,
        parent_context: SpanContext | None,
        start: float,
        end: float,
        attributes: Attributes,
        status: Status,
    ) -> ReadableSpan:
        return ReadableSpan(
            name=name,
            context=own,
            parent=parent_context,
            resource=resource,
            attributes=attributes,
            kind=_KINDS[kind],
            status=status,
            start_time=ns(start),
            end_time=ns(end),
            instrumentation_scope=instrumentation,
        )

    root = context(span_ids())
    # Each stage's span context; a folded stage's children are the request's.
    stage_contexts: list[SpanContext] = []
    made: list[tuple[float, ReadableSpan]] = []
    for k in range(len(ends) - (failed is None)):
        name = stages[k]
        if name in FOLDED:
            stage_contexts.append(root)
            continue
        own = context(span_ids())
        stage_contexts.append(own)
        end, error = (ends[k + 1], None) if k + 1 < len(ends) else cast(StageFailure, failed)
        attributes = _stage(name, facts)
        status = _failed(attributes, error)
        made.append((end, span(name, _INTERNAL, own, root, ends[k], end, attributes, status)))
    step_contexts = {step[2]: context(step[2]) for step in steps}
    for name, kind, span_id, parent_ref, start, end, error, step_facts in steps:
        if parent_ref == ROOT:
            parent_context = root
        elif parent_ref < 0:
            parent_context = stage_contexts[-1 - parent_ref]
        else:
            parent_context = step_contexts[parent_ref]
        if kind == CLIENT:
            attributes = _attempt(operation, name, cast(AttemptFacts, step_facts))
            name = f"{operation} {name}" if name else operation  # the id routes name no model
        else:
            attributes = dict(cast(Attributes, step_facts or {}))
        own = step_contexts[span_id]
        status = _failed(attributes, error)
        made.append((end, span(name, kind, own, parent_context, start, end, attributes, status)))
    made.sort(key=lambda ended_span: ended_span[0])
    attributes, status = _request(operation, facts)
    server = SpanKind.SERVER.value
    name = f"{facts.method} {facts.path}"
    request = span(name, server, root, parent, started, ended, attributes, status)
    return [*(s for _, s in made), request]


def _failed(attributes: Attributes, error: str | None) -> Status:
    """A stage's or step's status; a failed one's error code also goes in `error.type`."""
    if error is None:
        return _UNSET
    attributes["error.type"] = error
    return Status(StatusCode.ERROR, error)


def _request(operation: str, facts: RequestFacts) -> tuple[Attributes, Status]:
    """The request span's attributes and status."""
    attributes: Attributes = {
        "http.request.method": facts.method,
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


def _stage(name: str, facts: RequestFacts) -> Attributes:
    """A stage's attributes: what it decided."""
    attributes: Attributes = {}
    if name == "kvgate.auth":
        _tenant(attributes, facts)
    elif name == "kvgate.classify":
        _intent(attributes, facts)
    elif name == "kvgate.admission":
        attributes["kvgate.priority"] = facts.priority
    elif name == "kvgate.pick" and facts.picked is not None:
        _endpoint(attributes, facts.picked)
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
