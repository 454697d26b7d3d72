"""The trace export path off the request: a recorded trace becomes exactly the spans the SDK
would have made (same OTLP bytes), the exporter process delivers traces to a real OTLP/HTTP
receiver, drops and counts what does not fit while it is stalled, and a gateway serving with
`exporter: otlp` sends its spans through it."""

from __future__ import annotations

import asyncio
import logging
import logging.config
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import suppress

import httpx
import pytest
import uvloop
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk import resources
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvgate import __version__
from kvgate.app import GatewayApp
from kvgate.config import parse_config
from kvgate.observability.exporter_process import FLUSH_SECONDS, ExporterProcess
from kvgate.observability.log_format import logging_config
from kvgate.observability.span_export_child import _batching, _OnceHashedResource
from kvgate.observability.span_records import (
    NEW_TRACE_FLAGS,
    ROOT,
    SAMPLED,
    ClientParent,
    RequestFacts,
    SpanRecord,
    TraceRecord,
    readable_spans,
    scope,
    span_count,
    stage_parent,
)
from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.otlp_collector import OtlpCollector
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7
REQUEST_SPAN, AUTH, PICK, ATTEMPT = 0x1111, 0x2222, 0x2233, 0x3333
RESOURCE = Resource({"service.name": "kvgate", "service.version": __version__})


class _FixedIds(IdGenerator):
    """The SDK's ids, chosen: one trace id, then the given span ids in order."""

    def __init__(self, span_ids: list[int]) -> None:
        self._spans = iter(span_ids)

    def generate_trace_id(self) -> int:
        return TRACE

    def generate_span_id(self) -> int:
        return next(self._spans)

    def is_trace_id_random(self) -> bool:
        return True


# One streamed request as kvgate records it (span_records.RequestFacts), and the attributes
# its spans say.
FACTS = RequestFacts(
    route="chat",
    path="/v1/chat/completions",
    request_id="req-1",
    requested_model="sim-model",
    model="sim-model",
    stream=True,
    status=200,
    outcome="ok",
    committed=True,
    attempts=1,
    resumes=0,
    tenant=("acme", "gold"),
    key_id="k-1",
    intent=("interactive", None, 12, 64),
    priority=100,
    endpoint=("e1", "main", 8, 12),
    picked=("e1", "main", 8, 12),
    engine="vllm",
    first_token=0.25,
    usage=(12, 7, None),
    response_model="sim-model",
)
REQUEST_ATTRIBUTES = {
    "http.request.method": "POST",
    "http.route": "/v1/chat/completions",
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "sim-model",
    "gen_ai.request.stream": True,
    "kvgate.request_id": "req-1",
    "http.response.status_code": 200,
    "kvgate.outcome": "ok",
    "kvgate.attempts": 1,
    "kvgate.resumes": 0,
    "kvgate.tenant": "acme",
    "kvgate.tier": "gold",
    "kvgate.key_id": "k-1",
    "kvgate.class": "interactive",
    "kvgate.prompt_tokens.estimated": 12,
    "gen_ai.request.max_tokens": 64,
    "kvgate.endpoint": "e1",
    "kvgate.pool": "main",
    "kvgate.prefix.predicted_tokens": 8,
    "kvgate.prefix.prompt_tokens": 12,
    "gen_ai.provider.name": "vllm",
    "gen_ai.response.time_to_first_chunk": 0.25,
    "gen_ai.usage.input_tokens": 12,
    "gen_ai.usage.output_tokens": 7,
    "gen_ai.response.model": "sim-model",
}
AUTH_ATTRIBUTES = {"kvgate.tenant": "acme", "kvgate.tier": "gold", "kvgate.key_id": "k-1"}
PICK_ATTRIBUTES = {
    "kvgate.endpoint": "e1",
    "kvgate.pool": "main",
    "kvgate.prefix.predicted_tokens": 8,
    "kvgate.prefix.prompt_tokens": 12,
}
ATTEMPT_ATTRIBUTES = {
    "gen_ai.operation.name": "chat",
    "gen_ai.provider.name": "vllm",
    "gen_ai.request.model": "sim-model",
    "server.address": "127.0.0.1",
    "server.port": 9000,
    "kvgate.endpoint": "e1",
    "kvgate.pool": "main",
    "kvgate.attempt": 1,
    "kvgate.prefix.predicted_tokens": 8,
    "gen_ai.usage.input_tokens": 12,
    "gen_ai.usage.output_tokens": 7,
    "gen_ai.response.model": "sim-model",
}


def _made_by_the_sdk(client: ClientParent | None) -> list[ReadableSpan]:
    """A request's spans made the SDK's way (the way kvgate made them before records)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        sampler=ALWAYS_ON,
        resource=RESOURCE,
        id_generator=_FixedIds([REQUEST_SPAN, AUTH, PICK, ATTEMPT]),
        shutdown_on_exit=False,
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("kvgate", __version__)
    parent = None
    if client is not None:
        carrier = {"traceparent": f"00-{TRACE:032x}-{client[0]:016x}-{client[1]:02x}"}
        carrier["tracestate"] = client[2]
        parent = TraceContextTextMapPropagator().extract(carrier)
    root = tracer.start_span(
        "POST /v1/chat/completions", context=parent, kind=SpanKind.SERVER, start_time=1_000
    )
    auth = tracer.start_span("kvgate.auth", context=set_span_in_context(root), start_time=1_100)
    auth.set_attributes(AUTH_ATTRIBUTES)
    auth.end(1_200)
    pick = tracer.start_span("kvgate.pick", context=set_span_in_context(root), start_time=1_200)
    pick.set_attributes(PICK_ATTRIBUTES)
    pick.end(1_250)
    attempt = tracer.start_span(
        "chat sim-model", context=set_span_in_context(root), kind=SpanKind.CLIENT, start_time=1_300
    )
    attempt.set_attributes(ATTEMPT_ATTRIBUTES)
    attempt.set_attribute("error.type", "upstream_timeout")
    attempt.set_status(Status(StatusCode.ERROR, "upstream_timeout"))
    attempt.end(1_400)
    root.set_attributes(REQUEST_ATTRIBUTES)
    root.end(1_500)
    provider.shutdown()
    return list(exporter.get_finished_spans())


def _ns(count: int) -> float:
    """`count` ns as a `time.perf_counter()` reading (the records' clock is 0 here)."""
    return count * 1e-9


def _recorded(client: ClientParent | None) -> TraceRecord:
    """The same request as kvgate records it."""
    flags = NEW_TRACE_FLAGS if client is None else SAMPLED
    attempt = ("e1", "main", "vllm", "127.0.0.1", 9000, 1, 8, (12, 7, None), "sim-model")
    client_kind = SpanKind.CLIENT.value
    steps: list[SpanRecord] = [
        (
            "sim-model",
            client_kind,
            ATTEMPT,
            ROOT,
            _ns(1_300),
            _ns(1_400),
            "upstream_timeout",
            attempt,
        ),
    ]
    stages = ("kvgate.auth", "kvgate.responses", "kvgate.pick")
    ends = [_ns(1_100), _ns(1_200), _ns(1_200), _ns(1_250)]
    return (
        TRACE,
        flags,
        client,
        0,
        _ns(1_000),
        _ns(1_500),
        tuple(FACTS),
        stages,
        ends,
        None,
        steps,
    )


@pytest.mark.parametrize("client", [None, (CLIENT_SPAN, 1, "vendor=abc,other=1")])
def test_a_record_becomes_the_spans_the_sdk_would_have_made(client):
    expected = encode_spans(_made_by_the_sdk(client)).SerializeToString()
    ids = iter([REQUEST_SPAN, AUTH, PICK])
    record = _recorded(client)
    built = readable_spans(record, RESOURCE, scope(__version__), lambda: next(ids))
    assert encode_spans(built).SerializeToString() == expected
    assert span_count(record) == len(built)


def test_a_failed_stage_is_a_span_with_its_error_and_a_folded_stage_makes_none():
    """Stages as the chain notes them: auth ended, the folded responses gate ended, classify
    failed; a step opened during the folded stage is the request's child."""
    wait = ("kvgate.wait", SpanKind.INTERNAL.value, 0x4444, stage_parent(1), 0.15, 0.16, None, None)
    stages = ("kvgate.auth", "kvgate.responses", "kvgate.classify", "kvgate.pick")
    failed = (0.3, "model_not_found")
    facts = tuple(FACTS._replace(outcome="model_not_found", status=404))
    record = (
        TRACE,
        NEW_TRACE_FLAGS,
        None,
        0,
        0.0,
        0.4,
        facts,
        stages,
        [0.1, 0.2, 0.25],
        failed,
        [wait],
    )
    spans = {s.name: s for s in readable_spans(record, RESOURCE, scope(__version__))}
    assert set(spans) == {
        "kvgate.auth",
        "kvgate.classify",
        "kvgate.wait",
        "POST /v1/chat/completions",
    }
    assert span_count(record) == len(spans)
    classify, request = spans["kvgate.classify"], spans["POST /v1/chat/completions"]
    assert (classify.start_time, classify.end_time) == (250_000_000, 300_000_000)
    assert classify.status.status_code == StatusCode.ERROR
    assert (classify.attributes or {})["error.type"] == "model_not_found"
    assert spans["kvgate.auth"].status.status_code == StatusCode.UNSET
    for child in (spans["kvgate.auth"], classify, spans["kvgate.wait"]):
        assert child.parent is not None and request.context is not None
        assert child.parent.span_id == request.context.span_id


@pytest.fixture(autouse=True)
def _short_batch_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exporter processes started here wait 50 ms for a batch to fill, not the SDK's 5 s."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")


def _settings(endpoint: str) -> dict[str, object]:
    return {
        "exporters": ["otlp"],
        "endpoint": endpoint,
        "resource": dict(RESOURCE.attributes),
        "schema_url": "",
        "version": __version__,
    }


def _trace(number: int) -> TraceRecord:
    """Trace `number`: a step and the request's span, each saying `number` (`_number`)."""
    steps: list[SpanRecord] = [
        ("kvgate.step", 1, 2 * number + 2, ROOT, 1e-8, 2e-8, None, {"n": number})
    ]
    facts = tuple(FACTS._replace(attempts=number))
    return (number + 1, NEW_TRACE_FLAGS, None, 0, 0.0, 3e-8, facts, (), [0.0], None, steps)


def _number(span: Span) -> int:
    """The number of the `_trace` a received span is part of."""
    said = {a.key: a.value.int_value for a in span.attributes}
    return said["n"] if "n" in said else said["kvgate.attempts"]


def test_a_stalled_exporter_process_drops_and_counts_what_does_not_fit_then_delivers_the_rest():
    dropped: list[int] = []

    async def scenario(endpoint: str) -> tuple[int, int]:
        export = ExporterProcess(_settings(endpoint), dropped.append, max_buffered_bytes=2**17)
        await export.start()
        assert export.pid is not None
        os.kill(export.pid, signal.SIGSTOP)  # it reads nothing: the pipe, then the buffer fill
        sent = 0
        try:
            while not dropped:
                for _ in range(1000):
                    export.send(_trace(sent // 2))
                    sent += 2
                await asyncio.sleep(0.15)  # the batch goes down the pipe
                assert sent < 200_000, "nothing was ever dropped"
        finally:
            os.kill(export.pid, signal.SIGCONT)
        await export.stop()
        return sent, export.dropped

    with OtlpCollector() as collector:
        sent, counted = asyncio.run(scenario(collector.endpoint))
        received = collector.spans
    assert sum(dropped) == counted > 0
    assert len(received) + counted == sent
    # What arrived is whole traces in the order sent, up to the first dropped one.
    numbers = [_number(s) for s in received]
    assert numbers == sorted(numbers) and numbers[0] == 0
    assert len(set(numbers)) * 2 == len(received)


async def _until(condition: Callable[[], object]) -> None:
    """Wait for `condition`, 30 s at most (a loaded machine may take seconds to start a
    process)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_spans_wait_for_a_full_batch_or_the_schedule_delay_as_the_sdk_batches_them(monkeypatch):
    """OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans make an export at once; fewer wait for
    OTEL_BSP_SCHEDULE_DELAY; a value that is not a positive number leaves the default."""
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1500")

    async def scenario(collector: OtlpCollector) -> tuple[int, int, float]:
        export = ExporterProcess(_settings(collector.endpoint), lambda spans: None)
        await export.start()
        for number in range(4):  # eight spans: a full batch
            export.send(_trace(number))
        await _until(lambda: len(collector.spans) == 8)
        export.send(_trace(4))  # two spans: they wait for the delay
        sent = time.monotonic()
        await asyncio.sleep(0.5)
        early = len(collector.spans)
        await _until(lambda: len(collector.spans) == 10)
        waited = time.monotonic() - sent
        await export.stop()
        return early, len(collector.spans), waited

    with OtlpCollector() as collector:
        early, total, waited = asyncio.run(scenario(collector))
    assert (early, total) == (8, 10)
    assert waited >= 1.4


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan"])
def test_a_batch_setting_that_is_not_a_positive_number_leaves_the_default(monkeypatch, value):
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", value)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", value)
    assert _batching() == (512, 5.0)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policy")
def test_the_exporter_process_runs_on_cpu_time_serving_leaves_over_and_still_delivers():
    async def scenario(endpoint: str) -> int:
        export = ExporterProcess(_settings(endpoint), lambda spans: None)
        await export.start()
        pid = export.pid
        assert pid is not None
        await _until(lambda: os.sched_getscheduler(pid) == os.SCHED_IDLE)
        for number in range(50):
            export.send(_trace(number))
        await export.stop()
        return export.dropped

    with OtlpCollector() as collector:
        dropped = asyncio.run(scenario(collector.endpoint))
        received = collector.spans
    assert dropped == 0 and len(received) == 100


def test_a_killed_exporter_process_is_restarted_and_the_traces_sent_meanwhile_arrive(caplog):
    """What the dead process had been sent and not exported is dropped and counted; what was
    sent while it was down goes to the next one; stopping after the restart flushes."""
    dropped: list[int] = []
    restarted: list[int] = []

    async def scenario(endpoint: str) -> tuple[int, int | None, int]:
        export = ExporterProcess(
            _settings(endpoint), dropped.append, lambda: restarted.append(1), backoff=(0.2, 1.0)
        )
        await export.start()
        first = export.pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)  # it exports nothing of what follows
        for number in range(5):
            export.send(_trace(number))
        await asyncio.sleep(2 * FLUSH_SECONDS)  # after the flush timer set by the first send
        os.kill(first, signal.SIGKILL)
        await _until(lambda: export.dropped)  # the gateway saw it die
        for number in range(5, 10):  # they wait for the next process
            export.send(_trace(number))
        await _until(lambda: restarted)
        for number in range(10, 15):
            export.send(_trace(number))
        await export.stop()
        return first, export.pid, export.restarts

    with OtlpCollector() as collector:
        first, second, restarts = asyncio.run(scenario(collector.endpoint))
        received = collector.spans
    assert second != first and restarts == 1 and restarted == [1]
    assert dropped == [10]  # the five traces the killed process held, two spans each
    assert sorted(_number(s) for s in received) == [n for n in range(5, 15) for _ in range(2)]
    deaths = [r for r in caplog.records if "exited" in r.getMessage()]
    assert len(deaths) == 1 and deaths[0].levelname == "ERROR"
    assert deaths[0].getMessage() == (
        f"trace exporter process (pid {first}) exited (-9), 10 spans it held dropped: "
        "restart 1 in 0.2 s"
    )


def test_an_exporter_process_that_keeps_dying_is_restarted_ever_more_slowly(caplog):
    """Each death in a row doubles the wait before the next start, up to the longest; one
    that lived at least the longest wait is started again after the first."""
    kills: list[float] = []
    restarts: list[float] = []

    async def kill_and_wait_for_the_next(export: ExporterProcess) -> None:
        assert export.pid is not None
        kills.append(time.monotonic())
        os.kill(export.pid, signal.SIGKILL)
        await _until(lambda: len(restarts) == len(kills))

    async def scenario() -> None:
        export = ExporterProcess(
            _settings("http://127.0.0.1:9/v1/traces"),
            lambda spans: None,
            lambda: restarts.append(time.monotonic()),
            backoff=(0.1, 0.8),
        )
        await export.start()
        for _ in range(5):  # killed as soon as it is up
            await kill_and_wait_for_the_next(export)
        await asyncio.sleep(1.0)  # this one outlives the longest wait
        await kill_and_wait_for_the_next(export)
        await export.stop()

    asyncio.run(scenario())
    delays = [float(d) for d in re.findall(r"restart \d+ in ([\d.]+) s", caplog.text)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 0.8, 0.1]
    assert all(r - k >= d for k, r, d in zip(kills, restarts, delays, strict=True))


def test_stopping_while_a_restart_waits_drops_and_counts_what_waits(caplog):
    """Traces wait for the next process up to the bound (the third of three is dropped at
    once); stopping drops what waits, and what comes after the stop."""
    dropped: list[int] = []

    async def scenario() -> ExporterProcess:
        export = ExporterProcess(
            _settings("http://127.0.0.1:9/v1/traces"),
            dropped.append,
            backoff=(600.0, 600.0),
            max_pending_traces=2,
        )
        await export.start()
        assert export.pid is not None
        os.kill(export.pid, signal.SIGKILL)
        await _until(lambda: "exited" in caplog.text)
        for number in range(3):
            export.send(_trace(number))
        await asyncio.wait_for(export.stop(), 30)  # not the ten minutes of the wait
        export.send(_trace(3))
        return export

    export = asyncio.run(scenario())
    assert export.restarts == 0 and dropped == [2, 4, 2] and export.dropped == 8


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast")) as sim:
        yield sim


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Serve under asyncio's loop, or under uvloop as `kvgate serve` does."""
    if request.param == "uvloop":
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        yield request.param
    finally:
        asyncio.set_event_loop_policy(None)


def _otlp_gateway(fleet, collector: OtlpCollector) -> GatewayApp:
    """An open gateway on `fleet` exporting its traces over OTLP to `collector`."""
    tracing = {"exporter": "otlp", "endpoint": collector.endpoint}
    config = gateway_config(
        fleet.urls, pool={"models": ["sim-model"]}, auth="none", observability={"tracing": tracing}
    )
    return GatewayApp(parse_config(config))


def test_a_gateway_exporting_otlp_sends_each_requests_spans_through_its_exporter_process(
    fleet, event_loop_kind
):
    with OtlpCollector() as collector:
        app = _otlp_gateway(fleet, collector)
        with ServerThread(app) as server:
            assert server.loop is not None
            assert type(server.loop).__module__.split(".")[0] == event_loop_kind
            client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)
            client.chat.completions.create(
                model="sim-model",
                max_tokens=3,
                messages=[{"role": "user", "content": "hello"}],
                extra_headers={"traceparent": f"00-{TRACE:032x}-{CLIENT_SPAN:016x}-01"},
            )
            assert app.tracing is not None
            pid = app.tracing.export.pid  # type: ignore[attr-defined]
            assert pid is not None and pid != os.getpid()
        spans = {s.name: s for s in collector.spans}  # the app stopped: everything is flushed
        resource = {a.key: a.value.string_value for a in collector.resources[0].resource.attributes}
    assert resource["service.name"] == "kvgate"
    assert set(spans) == {
        "POST /v1/chat/completions",
        "kvgate.auth",
        "kvgate.classify",
        "kvgate.admission",
        "kvgate.pick",
        "chat sim-model",
    }
    root = spans["POST /v1/chat/completions"]
    assert root.trace_id == TRACE.to_bytes(16, "big")
    assert root.parent_span_id == CLIENT_SPAN.to_bytes(8, "big")
    assert all(s.trace_id == root.trace_id for s in spans.values())
    assert all(s.parent_span_id == root.span_id for n, s in spans.items() if s is not root)
    attempt = spans["chat sim-model"]
    received = fleet.engines[0].stats()["last_request"]["headers"]["traceparent"]
    assert received == f"00-{TRACE:032x}-{attempt.span_id.hex()}-01"


def test_a_gateway_whose_exporter_process_is_killed_starts_another_and_its_traces_arrive(
    fleet, event_loop_kind, caplog
):
    with OtlpCollector() as collector:
        app = _otlp_gateway(fleet, collector)
        assert app.tracing is not None
        export = app.tracing.export
        assert isinstance(export, ExporterProcess)
        with ServerThread(app) as server:
            assert type(server.loop).__module__.split(".")[0] == event_loop_kind
            client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)

            def ask(trace_id: int) -> None:
                client.chat.completions.create(
                    model="sim-model",
                    max_tokens=3,
                    messages=[{"role": "user", "content": "hello"}],
                    extra_headers={"traceparent": f"00-{trace_id:032x}-{CLIENT_SPAN:016x}-01"},
                )

            def wait_for(condition: Callable[[], object]) -> None:
                deadline = time.monotonic() + 30
                while not condition():
                    assert time.monotonic() < deadline, "condition not met in time"
                    time.sleep(0.01)

            def spans_of(trace_id: int) -> int:
                wanted = trace_id.to_bytes(16, "big")
                return sum(s.trace_id == wanted for s in collector.spans)

            ask(TRACE)
            wait_for(lambda: spans_of(TRACE) == 6)
            killed = export.pid
            assert killed is not None
            os.kill(killed, signal.SIGKILL)
            wait_for(lambda: "exited" in caplog.text)  # the gateway saw it die
            ask(TRACE + 1)
            wait_for(lambda: spans_of(TRACE + 1) == 6)
            assert export.pid != killed
            metrics = httpx.get(server.url + "/metrics").text
    assert sample_value(metrics, "kvgate_trace_exporter_restarts_total") == 1
    assert sample_value(metrics, "kvgate_trace_spans_dropped_total") == export.dropped


def test_the_exporter_process_resource_is_hashed_once_and_as_the_sdk_hashes_it(monkeypatch):
    attributes = {"service.name": "kvgate", "service.version": __version__}
    once = _OnceHashedResource(attributes, "https://opentelemetry.io/schemas/1.26.0")
    sdk = Resource(attributes, "https://opentelemetry.io/schemas/1.26.0")
    assert once == sdk and hash(once) == hash(sdk)
    serialised = []
    monkeypatch.setattr(resources, "dumps", lambda *a, **k: serialised.append(a) or "")
    assert {once: 1}[once] == 1 and hash(once) == hash(once)
    assert serialised == []


def test_the_exporter_process_holds_no_inherited_socket_and_no_secret_in_its_command_line(
    capfd, monkeypatch
):
    """Under `--workers N` a worker's listening socket is inheritable: the exporter process
    closes it at start, or it would keep the gateway's port open through a drain and after a
    crash. Its settings (the endpoint may carry credentials) are not on its command line,
    which `ps` shows everyone, and what it logs masks them."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.set_inheritable(True)
    link = f"socket:[{os.fstat(listener.fileno()).st_ino}]"
    nobody = "http://otel:PASSWORD@127.0.0.1:1/v1/traces?api_key=QUERYSECRET"
    dropped: list[int] = []

    def command_of(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline", "rb") as command:
            return command.read().decode(errors="replace")

    async def scenario() -> str:
        export = ExporterProcess(_settings(nobody), dropped.append)
        await export.start()
        try:
            pid = export.pid
            assert pid is not None
            await _until(lambda: "span_export_child" in command_of(pid))
            await _until(lambda: link not in _sockets_of(pid))
            export.send(_trace(1))  # its export to a port nobody listens on fails: logged
            return command_of(pid)
        finally:
            await export.stop()

    try:
        command = uvloop.run(scenario())  # the gateway's loop, whose spawn passes the socket on
    finally:
        listener.close()
    assert "PASSWORD" not in command and "QUERYSECRET" not in command
    logged = capfd.readouterr().err
    assert "Failed to export" in logged  # the failed export was logged, in the child
    assert "PASSWORD" not in logged and "QUERYSECRET" not in logged
    assert dropped == [2]  # and its spans, which never reached a collector, counted dropped


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_log_lines_mask_url_credentials_a_library_writes(capfd, log_format):
    """Libraries log the URLs they call (the OTLP exporter's retry warning names its endpoint
    and query): every process's log handler masks passwords and secret-like parameters, in
    the message and in an exception's text."""
    logging.config.dictConfig(logging_config("INFO", log_format))  # conftest restores it
    library = logging.getLogger("urllib3.connectionpool")
    library.warning(
        "Retrying %s: Max retries exceeded with url: /v1/traces?api_key=QUERYSECRET&x=1",
        "http://otel:PASSWORD@collector:4318/v1/traces",
    )
    try:
        raise ConnectionError("http://u:EXCPASSWORD@h/x?token=EXCTOKEN")
    except ConnectionError:
        library.exception("export failed")
    logged = capfd.readouterr().err
    for secret in ("PASSWORD", "QUERYSECRET", "EXCPASSWORD", "EXCTOKEN"):
        assert secret not in logged
    assert "otel:***@collector:4318" in logged and "api_key=***&x=1" in logged
    assert "u:***@h/x?token=***" in logged


def _sockets_of(pid: int) -> set[str]:
    """The socket links among the process's open descriptors."""
    names = os.listdir(f"/proc/{pid}/fd")
    links = set()
    for name in names:
        with suppress(OSError):
            links.add(os.readlink(f"/proc/{pid}/fd/{name}"))
    return {link for link in links if link.startswith("socket:")}
