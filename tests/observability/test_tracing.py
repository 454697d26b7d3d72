"""OpenTelemetry traces of a real gateway on uvicorn in front of simulated engines, read with
the SDK's in-memory exporter: the span tree, the client's trace continued, the attempt's
context reaching the engine, one span per attempt, a resume span, sampling, the settings'
precedence, and nothing at all when tracing is off."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvgate.app import GatewayApp
from kvgate.config import ConfigError, TracingConfig, parse_config
from kvgate.observability.tracing import build_tracing
from kvgate.sim import EngineOptions, SimFleet
from tests.chain.helpers import make_key, tenant
from tests.conftest import gateway_config
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread

MODEL = "sim-model"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
STAGES = ["kvgate.auth", "kvgate.classify", "kvgate.admission", "kvgate.pick"]


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as sim:
        yield sim


@pytest.fixture
def traced() -> Iterator[Any]:
    """Start a gateway whose spans go to an in-memory exporter; yields `start(config)`."""
    servers: list[ServerThread] = []

    def start(config: dict[str, Any]) -> tuple[GatewayApp, ServerThread, InMemorySpanExporter]:
        exporter = InMemorySpanExporter()
        app = GatewayApp(parse_config(config), span_exporter=exporter)
        servers.append(ServerThread(app).__enter__())
        return app, servers[-1], exporter

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def traced_config(fleet: SimFleet, policy: str = "round_robin", **tracing: Any) -> dict[str, Any]:
    return gateway_config(
        fleet.urls,
        pool={"models": [MODEL], "policy": policy},
        auth="none",
        observability={"tracing": {"exporter": "console", **tracing}},
    )


def requests_traced(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The first `count` request spans (a request's span ends just after its answer)."""
    deadline = time.monotonic() + 10
    while True:
        roots = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
        if len(roots) >= count or time.monotonic() > deadline:
            return roots
        time.sleep(0.02)


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    found = [
        s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    ]
    return sorted(found, key=lambda s: s.start_time or 0)


def traceparent_of(span: ReadableSpan) -> str:
    assert span.context is not None
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def engine_of(fleet: SimFleet, attempt: ReadableSpan) -> Any:
    """The simulated engine an attempt span says it was sent to."""
    attributes = attempt.attributes or {}
    assert attributes["server.address"] == "127.0.0.1"
    return next(e for e in fleet.engines if e.port == attributes["server.port"])


def test_a_stream_is_one_trace_continuing_the_clients(fleet, traced):
    _, server, exporter = traced(traced_config(fleet, policy="balanced"))
    # The stream pauses 0.3 s after its third token: its span must outlast the pause.
    for engine in fleet.engines:
        engine.set_fault({"mode": "stall_after_tokens", "tokens": 3, "delay_ms": 300})
    client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Name three rivers of Europe."}],
            extra_headers={"traceparent": TRACEPARENT},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None

    [root] = requests_traced(exporter, 1)
    assert root.context is not None and root.parent is not None
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN and root.parent.is_remote
    assert root.name == "POST /v1/chat/completions"
    steps = children(exporter, root)
    assert [s.name for s in steps] == [*STAGES, f"chat {MODEL}"]
    attempt = steps[-1]
    assert attempt.kind == SpanKind.CLIENT
    assert all(s.context and s.context.trace_id == root.context.trace_id for s in steps)

    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.provider.name"] == "vllm"
    assert attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert attributes["http.response.status_code"] == 200
    assert attributes["kvgate.outcome"] == "ok"
    assert attributes["kvgate.tenant"] == "anonymous"
    assert attributes["kvgate.class"] in ("interactive", "standard", "batch")
    assert attributes["kvgate.endpoint"] == attempt.attributes["kvgate.endpoint"]
    assert attributes["kvgate.prefix.predicted_tokens"] >= 0
    assert attempt.attributes["kvgate.attempt"] == 1
    assert attempt.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert dict(steps[0].attributes or {})["kvgate.tenant"] == "anonymous"
    assert dict(steps[1].attributes or {})["kvgate.class"] == attributes["kvgate.class"]
    assert isinstance(dict(steps[2].attributes or {})["kvgate.priority"], int)
    assert dict(steps[3].attributes or {})["kvgate.endpoint"] == attributes["kvgate.endpoint"]

    # The request's span lasts as long as the stream, pause included, and ends after it.
    assert root.end_time and root.start_time and attempt.end_time
    assert root.end_time >= attempt.end_time
    assert root.end_time - root.start_time >= 300_000_000
    assert attributes["gen_ai.response.time_to_first_chunk"] < 0.3

    # The engine was sent the attempt span's context, not the client's.
    engine = engine_of(fleet, attempt)
    received = engine.stats()["last_request"]["headers"]
    assert received["traceparent"] == traceparent_of(attempt)


def test_a_retry_is_two_attempt_spans(fleet, traced):
    _, server, exporter = traced(traced_config(fleet))
    fleet.engines[0].set_fault({"mode": "http_error", "status": 503, "count": 1})
    client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for i in range(2):  # round robin: one of the two starts on the failing engine
        client.chat.completions.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": f"hello {i}"}]
        )
        retried = requests_traced(exporter, i + 1)[i]
        if (retried.attributes or {})["kvgate.attempts"] == 2:
            break
    else:
        pytest.fail("no request met the failing engine")
    attempts = [s for s in children(exporter, retried) if s.kind == SpanKind.CLIENT]
    assert [a.attributes["kvgate.attempt"] for a in attempts] == [1, 2]
    failed, served = attempts
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["error.type"] == "upstream_error"
    assert failed.attributes["kvgate.endpoint"] != served.attributes["kvgate.endpoint"]
    assert served.status.status_code == StatusCode.UNSET
    assert "gen_ai.usage.output_tokens" in served.attributes
    assert "gen_ai.usage.output_tokens" not in failed.attributes
    engine = engine_of(fleet, served)
    assert engine.stats()["last_request"]["headers"]["traceparent"] == traceparent_of(served)
    # The pick span says what the pick chose (the failing engine); the request's, the last.
    [pick] = [s for s in children(exporter, retried) if s.name == "kvgate.pick"]
    assert pick.attributes["kvgate.endpoint"] == failed.attributes["kvgate.endpoint"]
    assert retried.attributes["kvgate.endpoint"] == served.attributes["kvgate.endpoint"]


def test_a_wait_in_admission_is_a_child_of_the_admission_span(fleet, traced):
    key, entry = make_key("a-1")
    config = traced_config(fleet)
    config["auth"] = {"tenants": [tenant("a", "silver", [entry], limits={"max_concurrent": 1})]}
    _, server, exporter = traced(config)
    for engine in fleet.engines:
        engine.set_fault({"mode": "stall_after_tokens", "tokens": 1, "delay_ms": 500})
    client = sdk_client(base_url=server.url + "/v1", api_key=key, max_retries=0)

    def ask(text: str) -> None:
        client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": text}]
        )

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(ask, "first")
        time.sleep(0.2)  # the first holds the tenant's one place while it stalls
        pool.submit(ask, "second").result()
        first.result()
    waits = [s for s in exporter.get_finished_spans() if s.name == "kvgate.admission.wait"]
    assert len(waits) == 1 and waits[0].parent is not None
    [admission] = [
        s
        for s in exporter.get_finished_spans()
        if s.context is not None and s.context.span_id == waits[0].parent.span_id
    ]
    assert admission.name == "kvgate.admission"
    assert admission.start_time <= waits[0].start_time <= waits[0].end_time <= admission.end_time


def test_tracing_off_makes_no_trace_and_passes_the_clients_context_on(fleet, traced):
    app, server, exporter = traced(gateway_config(fleet.urls, auth="none"))
    assert app.tracing is None and app.chain.tracing is None
    client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)
    client.chat.completions.create(
        model=MODEL,
        max_tokens=3,
        messages=[{"role": "user", "content": "hello"}],
        extra_headers={"traceparent": TRACEPARENT},
    )
    seen = [e.stats()["last_request"] for e in fleet.engines]
    assert [r["headers"]["traceparent"] for r in seen if r] == [TRACEPARENT]
    assert exporter.get_finished_spans() == ()


def test_a_client_not_sampling_is_followed_and_the_ratio_applies_to_new_traces(fleet, traced):
    _, server, exporter = traced(traced_config(fleet, sample_ratio=0.0))
    client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)
    sent = []
    for flags in ("00", None, "01"):  # client not sampling, no client trace, client sampling
        parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-{flags}"
        headers = {} if flags is None else {"traceparent": parent}
        before = [e.stats()["requests_received"] for e in fleet.engines]
        client.chat.completions.create(
            model=MODEL,
            max_tokens=3,
            messages=[{"role": "user", "content": "hello"}],
            extra_headers=headers,
        )
        [stats] = [
            stats
            for stats, count in zip((e.stats() for e in fleet.engines), before, strict=True)
            if stats["requests_received"] > count
        ]
        sent.append(stats["last_request"]["headers"].get("traceparent"))
    [root] = requests_traced(exporter, 1)
    assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN
    time.sleep(0.2)  # the other two would have been exported by now
    assert len([s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]) == 1
    # A request not traced leaves the trace context as the client sent it (or absent).
    assert sent[0] == f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
    assert sent[1] is None
    assert sent[2].split("-")[1] == CLIENT_TRACE and sent[2].split("-")[2] != CLIENT_SPAN


def test_settings_come_from_the_config_then_the_otel_variables(monkeypatch):
    memory = InMemorySpanExporter()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert build_tracing(TracingConfig(), memory) is not None
    assert build_tracing(TracingConfig(exporter="none"), memory) is None  # config first
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert build_tracing(TracingConfig(exporter="console"), memory) is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    assert build_tracing(TracingConfig(), memory) is None  # the default: off

    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gateway")
    tracing = build_tracing(TracingConfig(exporter="console"), memory)
    assert tracing is not None and tracing.ratio == 0.25
    assert tracing.resource.attributes["service.name"] == "edge-gateway"
    tracing = build_tracing(TracingConfig(exporter="console", sample_ratio=0.5), memory)
    assert tracing is not None and tracing.ratio == 0.5
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    tracing = build_tracing(TracingConfig(exporter="console"), memory)
    assert tracing is not None
    assert tracing.resource.attributes["service.name"] == "kvgate"

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="zipkin"):
        build_tracing(TracingConfig(), memory)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "2")
    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        build_tracing(TracingConfig(exporter="console"), memory)


def test_the_config_refuses_a_bad_endpoint_ratio_or_exporter():
    for tracing in ({"endpoint": "collector:4318"}, {"sample_ratio": 1.5}, {"exporter": "x"}):
        config = gateway_config(["http://127.0.0.1:1"], observability={"tracing": tracing})
        with pytest.raises(ConfigError, match=r"observability\.tracing"):
            parse_config(config)


def test_a_resumed_stream_has_a_resume_span_over_its_continuation(fleet, traced):
    config = traced_config(fleet)
    config["pools"][0]["resume"] = True
    _, server, exporter = traced(config)
    fleet.engines[0].set_fault({"mode": "crash_after_tokens", "tokens": 5, "count": 1})
    client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for i in range(2):  # round robin: one of the two starts on the crashing engine
        text = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=MODEL,
                max_tokens=12,
                stream=True,
                messages=[{"role": "user", "content": f"Tell a story {i}."}],
            )
            if chunk.choices
        )
        assert text
        root = requests_traced(exporter, i + 1)[i]
        if (root.attributes or {})["kvgate.resumes"] == 1:
            break
    else:
        pytest.fail("no stream met the crashing engine")
    steps = children(exporter, root)
    assert [s.name for s in steps] == [*STAGES, f"chat {MODEL}", "kvgate.resume"]
    broken, resume = steps[-2:]
    assert broken.attributes["error.type"] == "upstream_connection_lost"
    [continuation] = children(exporter, resume)
    assert continuation.kind == SpanKind.CLIENT
    assert continuation.attributes["kvgate.attempt"] == 2
    assert resume.attributes["kvgate.resume.relayed_tokens"] >= 1
    assert continuation.status.status_code == StatusCode.UNSET
    assert root.attributes["kvgate.outcome"] == "ok"


def test_serve_refuses_an_unsupported_otel_exporter_without_starting(tmp_path):
    config = tmp_path / "kvgate.yaml"
    config.write_text("pools: [{name: p, endpoints: [{url: 'http://127.0.0.1:9'}]}]\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "OTEL_TRACES_EXPORTER": "zipkin"},
    )
    assert result.returncode == 1
    assert "$OTEL_TRACES_EXPORTER: unsupported trace exporter 'zipkin'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_retrieve_is_traced_under_its_method_and_route_never_its_id(traced):
    options = EngineOptions(profile="fast", responses_store=True)
    with SimFleet.in_thread(engines=1, options=options) as storing:
        _, server, exporter = traced(traced_config(storing))
        client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)
        created = client.responses.create(model=MODEL, input="hello", max_output_tokens=2)
        assert client.responses.retrieve(created.id).id == created.id
    _, root = requests_traced(exporter, 2)
    assert root.name == "GET /v1/responses/{response_id}"
    attributes = dict(root.attributes or {})
    assert attributes["http.request.method"] == "GET"
    assert attributes["http.route"] == "/v1/responses/{response_id}"
    assert attributes["kvgate.endpoint"] == "default-0"
    # Auth is its own span; the stage that reads the id only reads the fleet (folded).
    assert [s.name for s in children(exporter, root)] == ["kvgate.auth", "responses_retrieve"]
    assert created.id.split("_kvg")[0] not in str(root.attributes)
