"""A finished request's trace as plain data (a `TraceRecord`), and the OpenTelemetry SDK spans it
stands for.

The request path records ids, times and attributes into tuples and makes no OpenTelemetry call
(kvgate/observability/request_trace.py); the SDK's `ReadableSpan`s are built from the record
after the response, by the exporter process (kvgate/observability/span_export_child.py) or,
when a test hands the app an exporter, in the gateway's process. A record holds only what
`marshal` carries (tuples, dicts, str, int, float, bool, None), so it crosses a pipe as is.
"""

from __future__ import annotations

from typing import Protocol

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

Attribute = str | int | float | bool
# One span: name, kind (SpanKind's value), span id, parent span id (0: the request's parent,
# the client's span or none), start and end (ns since the epoch), attributes, status code
# (StatusCode's value) and status description.
SpanRecord = tuple[str, int, int, int, int, int, dict[str, Attribute], int, str | None]
# The client's span a request continues: its span id, trace flags and `tracestate` header.
ClientParent = tuple[int, int, str]
# One request's trace: trace id, trace flags of its spans, the client's span (None: a new
# trace), the spans (the request's last).
TraceRecord = tuple[int, int, ClientParent | None, list[SpanRecord]]


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
_KINDS = {kind.value: kind for kind in SpanKind}
_STATUS = {code.value: code for code in StatusCode}
_UNSET = Status(StatusCode.UNSET)


def scope(version: str) -> InstrumentationScope:
    """The instrumentation scope of kvgate's spans (as `get_tracer("kvgate", version)`)."""
    return InstrumentationScope("kvgate", version)


def readable_spans(
    record: TraceRecord, resource: Resource, instrumentation: InstrumentationScope
) -> list[ReadableSpan]:
    """The SDK spans of one request's trace, in the order they ended."""
    trace_id, flags, client, spans = record
    trace_flags = TraceFlags(flags)
    trace_state = TraceState.from_header([client[2]]) if client and client[2] else None
    root: SpanContext | None = None
    if client is not None:
        root = SpanContext(trace_id, client[0], True, TraceFlags(client[1]), trace_state)
    contexts = {
        span[2]: SpanContext(trace_id, span[2], False, trace_flags, trace_state) for span in spans
    }
    return [
        ReadableSpan(
            name=name,
            context=contexts[span_id],
            parent=contexts[parent_id] if parent_id else root,
            resource=resource,
            attributes=attributes,
            kind=_KINDS[kind],
            status=_UNSET if code == 0 else Status(_STATUS[code], description),
            start_time=start,
            end_time=end,
            instrumentation_scope=instrumentation,
        )
        for (name, kind, span_id, parent_id, start, end, attributes, code, description) in spans
    ]
