"""The trace exporter process: reads finished request traces from its stdin (frames written by
kvgate/observability/exporter_process.py), builds the OpenTelemetry SDK spans they stand for
and exports them with the official exporters, batched as the SDK's batch span processor
batches: an export when 512 spans wait, or when the oldest has waited 5 s
(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, OTEL_BSP_SCHEDULE_DELAY in ms). At end of input (the gateway
stopped, or died) it exports what it holds, shuts the exporters down and exits. After each
batch it writes how many spans it has handled so far to ACK_FD (a pipe back to the gateway,
which counts what a process that died took with it).

    KVGATE_SPAN_EXPORT_SETTINGS=SETTINGS_JSON \
        python -m kvgate.observability.span_export_child ACK_FD

SETTINGS_JSON (in the environment: the command line is everyone's to read, and the endpoint
may carry credentials): {"exporters": ["otlp" | "console", ...], "endpoint": URL or null,
"resource": {attribute: value}, "schema_url": str, "version": kvgate's version, "logging":
[level, "json" | "text"]}. It logs as the gateway does, URL credentials masked. The OTLP
exporter also reads the OTEL_EXPORTER_OTLP_* variables, inherited from the gateway. Every
other descriptor it inherited (a worker's listening socket, under `--workers N`) is closed at
start: held here, it would keep the gateway's port open through a drain and after a crash.
"""

from __future__ import annotations

import json
import logging
import logging.config
import marshal
import math
import os
import select
import signal
import sys
import time
from contextlib import suppress
from typing import cast

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvgate.observability.exporter_process import ACK, FRAME, SETTINGS_VARIABLE
from kvgate.observability.log_format import logging_config
from kvgate.observability.span_records import TraceRecord, readable_spans, scope, span_count
from kvgate.observability.tracing import span_exporter

log = logging.getLogger("kvgate.tracing")
# The SDK batch span processor's defaults: spans per export, and the longest a span waits.
MAX_BATCH = 512
SCHEDULE_DELAY_MS = 5000.0
_READ_BYTES = 1 << 20
# Where the SCHED_IDLE policy does not exist (not Linux) or is refused.
NICE = 10


def main(settings: dict[str, object], ack_fd: int) -> None:
    _close_inherited(ack_fd)
    level, form = cast(list[str], settings["logging"])
    logging.config.dictConfig(logging_config(level, form))
    # Ctrl-C, or a service manager's SIGTERM, may reach the whole process group: the gateway
    # ends this process by closing the pipe once everything is sent (or by dying).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _run_when_idle()
    os.set_inheritable(ack_fd, False)  # whatever an exporter may start must not hold it open
    endpoint = settings["endpoint"]
    assert endpoint is None or isinstance(endpoint, str)
    names = settings["exporters"]
    assert isinstance(names, list)
    exporters = [span_exporter(name, endpoint) for name in names]
    attributes = settings["resource"]
    assert isinstance(attributes, dict)
    resource = _OnceHashedResource(attributes, str(settings["schema_url"]) or None)
    instrumentation = scope(str(settings["version"]))
    batch_size, delay = _batching()
    stdin = sys.stdin.fileno()
    received = bytearray()
    waiting: list[TraceRecord] = []
    waiting_spans = 0
    due = math.inf  # when the oldest waiting trace must be exported
    handled = _Handled(ack_fd)

    def export(records: list[TraceRecord]) -> None:
        spans = [s for record in records for s in readable_spans(record, resource, instrumentation)]
        for start in range(0, len(spans), batch_size):
            part = spans[start : start + batch_size]
            handled.add(len(part), failed=0 if _export(exporters, part) else len(part))

    while True:
        if waiting and not select.select([stdin], [], [], max(0.0, due - time.monotonic()))[0]:
            export(waiting)
            waiting, waiting_spans, due = [], 0, math.inf
            continue
        chunk = os.read(stdin, _READ_BYTES)
        if not chunk:
            break
        received += chunk
        offset = 0
        while len(received) - offset >= FRAME.size:
            (size,) = FRAME.unpack_from(received, offset)
            start = offset + FRAME.size
            if len(received) - start < size:
                break
            for record in marshal.loads(received[start : start + size]):
                waiting.append(record)
                waiting_spans += span_count(record)
            offset = start + size
        del received[:offset]
        if waiting and due == math.inf:
            due = time.monotonic() + delay
        if waiting_spans >= batch_size:
            export(waiting)
            waiting, waiting_spans, due = [], 0, math.inf
    export(waiting)
    for exporter in exporters:
        exporter.shutdown()


def _batching() -> tuple[int, float]:
    """The export batch size and the longest a trace waits for its batch, from the variables
    the SDK's batch span processor reads (OTEL_BSP_MAX_EXPORT_BATCH_SIZE, default 512;
    OTEL_BSP_SCHEDULE_DELAY in ms, default 5000); a value that is not a positive number is
    reported and the default used, as the SDK does."""
    size = _positive("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", MAX_BATCH)
    delay_ms = _positive("OTEL_BSP_SCHEDULE_DELAY", SCHEDULE_DELAY_MS)
    return int(size), delay_ms / 1000


def _positive(variable: str, default: float) -> float:
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or not math.isfinite(value):
        log.warning("%s=%r is not a positive number: using %g", variable, text, default)
        return default
    return value


def _close_inherited(ack_fd: int) -> None:
    """Close every descriptor this process inherited but stdin, stdout, stderr and `ack_fd`:
    an event loop's spawn may not close what the parent left inheritable (uvicorn's workers
    get their listening socket so). Inherited ones are those still inheritable here; what
    this process opened itself (imports, the exporters' libraries) is close-on-exec and
    stays open."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every possible descriptor
        fds = list(range(3, min(os.sysconf("SC_OPEN_MAX"), 65_536)))
    for fd in fds:
        if fd > 2 and fd != ack_fd:
            with suppress(OSError):  # the directory's own descriptor, gone by now
                if os.get_inheritable(fd):
                    os.close(fd)


def _run_when_idle() -> None:
    """Export is background work: it runs on CPU time that serving leaves over. Under
    Linux's SCHED_IDLE policy any ordinary thread that wakes up on a core this process is using
    takes the core at once, and this process gets what is left (what cannot keep up is dropped
    and counted by the gateway); where the policy is missing, nice 10 instead."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(NICE)


class _OnceHashedResource(Resource):
    """A `Resource` that computes its hash once. The OTLP encoder groups the spans of a batch
    by resource, and the SDK hashes a resource by serialising its attributes to JSON, so every
    span paid for a `json.dumps`: about a tenth of this process's CPU under load (py-spy, 300
    traced requests/s). A resource does not change, and equal resources still hash alike."""

    def __init__(self, attributes: dict[str, str], schema_url: str | None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


class _Handled:
    """The spans handed to the exporters so far, and of those the ones an exporter could not
    deliver, acknowledged to the gateway as they grow (it counts the failed ones dropped)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.spans = 0
        self.failed = 0

    def add(self, spans: int, failed: int) -> None:
        self.spans += spans
        self.failed += failed
        with suppress(OSError):  # the gateway is gone: nobody to tell
            os.write(self._fd, ACK.pack(self.spans, self.failed))


def _export(exporters: list[SpanExporter], spans: list[ReadableSpan]) -> bool:
    """Hand `spans` to every exporter; False when one of them did not deliver them (the
    collector refused them or could not be reached: the SDK logs why)."""
    delivered = True
    for exporter in exporters:
        try:
            delivered = exporter.export(spans) is SpanExportResult.SUCCESS and delivered
        except Exception:  # one failed batch must not end the exports that follow
            log.exception("trace export failed (%d spans lost)", len(spans))
            delivered = False
    return delivered


if __name__ == "__main__":
    main(json.loads(os.environ.pop(SETTINGS_VARIABLE)), int(sys.argv[1]))
