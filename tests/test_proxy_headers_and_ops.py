"""Header hygiene and the operational routes: models, health, readiness, metrics."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import gateway_config
from tests.servers import ServerThread
from tests.upstreams import ScriptedUpstream

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def test_hop_by_hop_and_client_credentials_never_reach_the_engine(upstream, start_gateway):
    engine, upstream_server = upstream
    _, server = start_gateway(
        gateway_config(
            [upstream_server.url],
            pool={"endpoints": [{"url": upstream_server.url, "api_key": "engine-key"}]},
        )
    )
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json=CHAT,
        headers={
            "authorization": "Bearer client-secret",
            "connection": "keep-alive, x-private-hop",
            "x-private-hop": "drop me",
            "keep-alive": "timeout=5",
            "proxy-authorization": "Basic abc",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "x-kvgate-tenant": "someone-else",
            "x-custom": "kept",
        },
    )
    assert response.status_code == 200
    seen = engine.inference_requests[0].headers
    assert seen["authorization"] == "Bearer engine-key"
    for name in ("x-private-hop", "keep-alive", "proxy-authorization", "x-kvgate-tenant"):
        assert name not in seen
    assert seen["traceparent"] == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert seen["x-custom"] == "kept"
    assert seen["x-request-id"] == response.headers["x-request-id"]
    assert len(response.headers["x-request-id"]) >= 16


def test_the_engine_is_told_the_body_is_json_whatever_the_client_declared(upstream, gateway):
    """`curl -d` declares a form; vLLM refuses any content type but JSON."""
    engine, _ = upstream
    _, server = gateway
    for declared in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {} if declared is None else {"content-type": declared}
        response = httpx.post(
            server.url + "/v1/chat/completions", content=orjson.dumps(CHAT), headers=headers
        )
        assert response.status_code == 200
    assert [r.headers["content-type"] for r in engine.inference_requests] == [
        "application/json"
    ] * 3


def test_client_request_id_is_kept_and_returned(upstream, gateway):
    engine, _ = upstream
    _, server = gateway
    response = httpx.post(
        server.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc-123"}
    )
    assert response.headers["x-request-id"] == "abc-123"
    assert engine.inference_requests[0].headers["x-request-id"] == "abc-123"
    assert response.headers["x-kvgate-endpoint"] == "default-0"


def test_a_body_request_id_names_the_request_when_no_header_does(upstream, gateway):
    """vLLM takes the X-Request-Id header over the body's `request_id` (its extension): the
    header the gateway sends carries the body's, so the engine keeps the client's id; a body
    id no header may carry is sent without one."""
    engine, _ = upstream
    _, server = gateway
    url = server.url + "/v1/chat/completions"
    for given in ("client-7", "job/42#7"):  # any visible ASCII, as clients write them
        named = httpx.post(url, json={**CHAT, "request_id": given})
        assert named.headers["x-request-id"] == given
        assert engine.inference_requests[-1].headers["x-request-id"] == given
    both = httpx.post(url, json={**CHAT, "request_id": "body-8"}, headers={"x-request-id": "h-8"})
    assert (
        engine.inference_requests[-1].headers["x-request-id"]
        == "h-8"
        == both.headers["x-request-id"]
    )
    # One no header can carry goes alone, as it would reach the engine directly: with a
    # header of the gateway's beside it, vLLM would name the request by the header.
    for unfit_id in ("has spaces\n", "x" * 200):
        unfit = httpx.post(url, json={**CHAT, "request_id": unfit_id})
        assert unfit.headers["x-request-id"] != unfit_id
        assert engine.inference_requests[-1].body["request_id"] == unfit_id
        assert "x-request-id" not in engine.inference_requests[-1].headers


def test_every_answer_carries_a_request_id_and_engine_errors_name_the_engine(upstream, gateway):
    engine, _ = upstream
    _, server = gateway
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/nope"), ("GET", "/healthz")):
        answer = httpx.request(method, server.url + path, headers={"x-request-id": "ops-7"})
        assert answer.headers["x-request-id"] == "ops-7", path
        assert len(httpx.request(method, server.url + path).headers["x-request-id"]) >= 16
    engine.script.status = 500
    failed = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert failed.status_code == 500
    assert failed.headers["x-kvgate-endpoint"] == "default-0"
    refused = httpx.post(server.url + "/v1/chat/completions", json={"model": "m1"})
    assert refused.status_code == 400 and "x-kvgate-endpoint" not in refused.headers


def test_a_path_with_a_trailing_slash_is_served_as_the_path_without_it(upstream, gateway):
    """vLLM and SGLang (FastAPI) redirect `/v1/chat/completions/` to the path without the
    slash, and clients follow; the gateway serves it as that path, and so sends it on."""
    engine, _ = upstream
    _, server = gateway
    answer = httpx.post(server.url + "/v1/chat/completions/", json=CHAT)
    assert answer.status_code == 200
    assert [r.path for r in engine.inference_requests] == ["/v1/chat/completions"]
    assert httpx.get(server.url + "/v1/models/").json()["data"][0]["id"] == "m1"
    assert httpx.get(server.url + "/healthz/").status_code == 200
    for path in ("/v1/nope/", "/v1/chat/completions//x/"):
        missing = httpx.post(server.url + path, json=CHAT)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"
    assert len(engine.inference_requests) == 1


@pytest.mark.parametrize(
    ("given", "low", "high"),
    [
        ("7", 7, 7),
        (
            lambda: format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True),
            118,
            121,
        ),
        ("99999999999999999999", 86_400, 86_400),  # at most a day
        ("Wed, 21 Oct 2015 07:28:00 GMT", 1, 1),  # a date gone by: come back at once
    ],
)
def test_an_engines_retry_after_is_read_in_both_of_its_forms(upstream, gateway, given, low, high):
    """RFC 9110: delay-seconds or an HTTP-date; relayed as whole seconds, at most a day."""
    engine, _ = upstream
    engine.script.status = 503
    value = given() if callable(given) else given
    engine.script.extra_headers = [(b"retry-after", value.encode())]
    _, server = gateway
    answer = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert answer.status_code == 503
    assert low <= int(answer.headers["retry-after"]) <= high


def test_no_authorization_upstream_without_endpoint_key(upstream, gateway):
    engine, _ = upstream
    _, server = gateway
    httpx.post(
        server.url + "/v1/chat/completions",
        json=CHAT,
        headers={"authorization": "Bearer client-secret"},
    )
    assert "authorization" not in engine.inference_requests[0].headers


def test_models_are_the_union_of_healthy_endpoints(start_gateway):
    a, b, sick = (
        ScriptedUpstream(("m1", "m2")),
        ScriptedUpstream(("m3",)),
        ScriptedUpstream(("hidden",), healthy=False),
    )
    with ServerThread(a) as sa, ServerThread(b) as sb, ServerThread(sick) as ss:
        _, server = start_gateway(
            {
                "server": {"access_log": False},
                "pools": [
                    {"name": "p1", "endpoints": [{"url": sa.url}, {"url": ss.url}]},
                    {
                        "name": "p2",
                        "engine": "sglang",
                        "models": ["m4"],
                        "endpoints": [{"url": sb.url}],
                    },
                ],
            }
        )
        listing = httpx.get(server.url + "/v1/models").json()
        assert listing["object"] == "list"
        assert [m["id"] for m in listing["data"]] == ["m1", "m2", "m3", "m4"]
        assert all(m["object"] == "model" for m in listing["data"])
        assert httpx.get(server.url + "/readyz").status_code == 200
        assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}


def test_metrics_count_requests_and_latency(upstream, gateway):
    _, server = gateway
    httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    httpx.post(server.url + "/v1/chat/completions", json={"model": "m1"})
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {
        (s.labels["status"], s.labels["model"]): s.value
        for s in families["kvgate_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests[("200", "m1")] == 1
    assert requests[("400", "_unknown")] == 1
    durations = [
        s for s in families["kvgate_request_duration_seconds"].samples if s.name.endswith("_count")
    ]
    assert sum(s.value for s in durations) == 1
    inflight = [s.value for s in families["kvgate_endpoint_inflight_requests"].samples]
    assert inflight == [0]


def test_metrics_count_the_event_loops_tasks(upstream, gateway):
    """`kvgate_process_asyncio_tasks` follows the requests in flight (each held by the task
    serving it) and falls back when they end: the gauge a soak reads to see a task leak."""
    engine, _ = upstream
    _, server = gateway

    def tasks() -> float:
        text = httpx.get(server.url + "/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        return families["kvgate_process_asyncio_tasks"].samples[0].value

    idle = tasks()
    assert idle >= 1  # the scrape's own task at least
    engine.script.headers_delay = 2.0
    with ThreadPoolExecutor(max_workers=5) as pool:
        held = [
            pool.submit(httpx.post, server.url + "/v1/chat/completions", json=CHAT, timeout=30)
            for _ in range(5)
        ]
        deadline = time.monotonic() + 10
        while len(engine.inference_requests) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tasks() >= idle + 5
        assert [f.result().status_code for f in held] == [200] * 5
    deadline = time.monotonic() + 10
    while tasks() > idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tasks() == idle
