"""The fault matrix of issue 6, scaled to seconds: a simulated pool of 4 behind the gateway,
one engine (or all) faulted through the simulator, real sockets, and what clients receive."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from kvgate.sim import EngineOptions, SimFleet
from kvgate.upstream.breaker import BreakerState
from tests.metrics_text import sample_value
from tests.resilience.helpers import chat, pool_config, received, stream, wait_for


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=4, options=EngineOptions(profile="fast")) as sim:
        yield sim


@pytest.fixture(autouse=True)
def _clear_faults(fleet: SimFleet) -> Iterator[None]:
    yield
    for engine in fleet.engines:
        engine.clear_fault()


def breaker_state(app, index: int) -> BreakerState:
    return app.resilience.breakers[app.fleet.endpoints[index]].refresh()


def test_1_crash_before_first_byte_is_retried_elsewhere(fleet, start_gateway):
    app, server = start_gateway(pool_config(fleet))
    fleet.engines[0].set_fault({"mode": "reset_before_first_byte"})
    before = received(fleet)
    outcomes = [stream(server.url, chat(max_tokens=8))[1] for _ in range(8)]
    unary = [
        httpx.post(
            server.url + "/v1/chat/completions", json=chat(max_tokens=4), timeout=20
        ).status_code
        for _ in range(4)
    ]
    assert outcomes == ["complete"] * 8 and unary == [200] * 4
    assert app.resilience.breakers[app.fleet.endpoints[0]].consecutive_failures >= 2
    assert received(fleet) - before <= 12 * 2  # each failure costs one extra attempt


def test_2_crash_mid_stream_ends_with_an_error_event_and_is_recorded(fleet, start_gateway):
    app, server = start_gateway(pool_config(fleet))
    fleet.engines[1].set_fault({"mode": "crash_after_tokens", "tokens": 3})
    results = [stream(server.url, chat(max_tokens=12)) for _ in range(8)]
    outcomes = [outcome for _, outcome, _ in results]
    assert "lost" not in outcomes
    assert outcomes.count("error") == 2 and outcomes.count("complete") == 6
    broken = next(r for r, outcome, _ in results if outcome == "error")
    assert b"[DONE]" not in broken.content
    last = orjson.loads(broken.content.strip().split(b"\n\n")[-1][6:])
    assert last["error"]["code"] == "upstream_connection_lost"
    assert app.resilience.breakers[app.fleet.endpoints[1]].consecutive_failures == 2
    wait_for(lambda: all(e.inflight == 0 for e in app.fleet.endpoints))


def test_3_slow_first_token_times_out_retries_and_traffic_shifts_away(fleet, start_gateway):
    config = pool_config(
        fleet,
        timeouts={"first_token": 0.5},
        resilience={
            "breaker": {"consecutive_failures": 2, "base_ejection": 30, "max_ejection": 30}
        },
    )
    app, server = start_gateway(config)
    fleet.engines[2].set_fault({"mode": "slow_first_token", "delay_ms": 5000})
    outcomes = [stream(server.url, chat(max_tokens=4))[1] for _ in range(12)]
    assert outcomes == ["complete"] * 12
    assert breaker_state(app, 2) is BreakerState.OPEN
    seen = fleet.engines[2].stats()["requests_received"]
    for _ in range(8):
        assert stream(server.url, chat(max_tokens=4))[1] == "complete"
    assert fleet.engines[2].stats()["requests_received"] == seen  # ejected: no more traffic


def test_3b_stall_after_commit_is_a_stall_timeout_event(fleet, start_gateway):
    _app, server = start_gateway(pool_config(fleet, timeouts={"stall": 0.3}))
    for engine in fleet.engines:
        engine.set_fault({"mode": "stall_after_tokens", "tokens": 2, "delay_ms": 3000})
    response, outcome, _ = stream(server.url, chat(max_tokens=8))
    assert outcome == "error"
    last = orjson.loads(response.content.strip().split(b"\n\n")[-1][6:])
    assert last["error"]["code"] == "upstream_stall_timeout"


def test_4_5xx_storm_fails_fast_without_amplification_and_recovers(fleet, start_gateway):
    _app, server = start_gateway(pool_config(fleet))
    for engine in fleet.engines:
        engine.set_fault({"mode": "http_error", "status": 503})
    before = received(fleet)
    statuses, retry_after = [], []
    for _ in range(60):
        response = httpx.post(
            server.url + "/v1/chat/completions", json=chat(max_tokens=4), timeout=20
        )
        statuses.append(response.status_code)
        retry_after.append(response.headers.get("retry-after"))
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert set(statuses) == {503}
    assert all(value is not None for value in retry_after)
    assert (received(fleet) - before) / 60 <= 1.2
    metrics = httpx.get(server.url + "/metrics").text
    assert (sample_value(metrics, "kvgate_throttled_attempts_total", pool="default") or 0) > 0
    for engine in fleet.engines:
        engine.clear_fault()
    recovering = received(fleet)
    sent = 0

    def healthy_again() -> bool:
        nonlocal sent
        sent += 1
        return (
            httpx.post(
                server.url + "/v1/chat/completions", json=chat(max_tokens=4), timeout=20
            ).status_code
            == 200
        )

    wait_for(healthy_again, timeout=15)
    assert received(fleet) - recovering <= sent  # no retry storm while recovering


def test_5_connection_refused_is_retried_at_once_and_ejected(fleet, start_gateway):
    app, server = start_gateway(pool_config(fleet))
    fleet.engines[3].set_fault({"mode": "refuse"})
    app.fleet.endpoints[3].healthy = True  # as if the health check had not noticed yet
    app.fleet.refresh()
    outcomes = [stream(server.url, chat(max_tokens=4))[1] for _ in range(24)]
    assert outcomes == ["complete"] * 24
    assert breaker_state(app, 3) is not BreakerState.CLOSED or not app.fleet.endpoints[3].healthy
    metrics = httpx.get(server.url + "/metrics").text
    assert 'kvgate_retries_total{pool="default",reason="upstream_connect_failed"}' in metrics


def test_6_malformed_sse_is_a_backend_failure_never_garbage(fleet, start_gateway):
    app, server = start_gateway(pool_config(fleet))
    fleet.engines[0].set_fault({"mode": "malformed_sse", "tokens": 2})
    results = [stream(server.url, chat(max_tokens=6)) for _ in range(4)]
    outcomes = [o for _, o, _ in results]
    assert set(outcomes) <= {"complete", "error"}  # never lost, never garbage to the client
    for response, outcome, _ in results:
        if outcome == "error":
            last = orjson.loads(response.content.strip().split(b"\n\n")[-1][6:])
            assert last["error"]["code"] == "upstream_malformed_event"
    # The bad event arrives either after the commit (error event) or in the same read as the
    # first event (retried elsewhere before anything reached the client): a backend failure
    # against engine 0 either way.
    retried = (
        'kvgate_retries_total{pool="default",reason="upstream_malformed_event"}'
        in httpx.get(server.url + "/metrics").text
    )
    assert outcomes.count("error") >= 1 or retried
    assert app.resilience.breakers[app.fleet.endpoints[0]].consecutive_failures >= 1
    unary = [
        httpx.post(server.url + "/v1/chat/completions", json=chat(max_tokens=4), timeout=20)
        for _ in range(4)
    ]
    assert [r.status_code for r in unary] == [200] * 4  # truncated JSON body: retried
    assert all(r.json()["choices"] for r in unary)


def test_7_client_disconnect_aborts_upstream_and_is_not_a_failure(start_gateway):
    options = EngineOptions(profile="realistic", speed=1.0)
    with SimFleet.in_thread(engines=2, options=options) as slow:
        app, server = start_gateway(pool_config(slow))
        for _ in range(6):
            with httpx.stream(
                "POST",
                server.url + "/v1/chat/completions",
                timeout=20,
                json=chat(max_tokens=400, ignore_eos=True, stream=True),
            ) as r:
                next(r.iter_raw())
        wait_for(lambda: sum(e.stats()["requests_aborted"] for e in slow.engines) == 6)
        wait_for(lambda: all(e.inflight == 0 for e in app.fleet.endpoints))
        for endpoint in app.fleet.endpoints:
            breaker = app.resilience.breakers[endpoint]
            assert breaker.consecutive_failures == 0 and breaker.state is BreakerState.CLOSED
        assert 'result="released"' in httpx.get(server.url + "/metrics").text


def test_8_retry_after_is_honoured_and_budgeted(fleet, start_gateway):
    app, server = start_gateway(pool_config(fleet))
    fleet.engines[0].set_fault({"mode": "http_error", "status": 429, "retry_after": 30})
    faulted = fleet.engines[0].stats()["faults_applied"]
    outcomes = [stream(server.url, chat(max_tokens=4))[1] for _ in range(8)]
    assert outcomes == ["complete"] * 8
    assert fleet.engines[0].stats()["faults_applied"] == faulted + 1  # held after one 429
    assert not app.resilience.breakers[app.fleet.endpoints[0]].admits()
    assert breaker_state(app, 0) is BreakerState.CLOSED  # a hold is not an ejection


def test_8b_a_pause_longer_than_the_deadline_holds_its_engine_and_the_retry_goes_on(
    fleet, start_gateway
):
    """An engine's Retry-After is that engine's: one asking for an hour, beyond the request's
    deadline, is held out while the request is retried on a healthy engine. When every
    engine asks for a pause, the last refusal is relayed with its Retry-After."""
    app, server = start_gateway(pool_config(fleet))
    for engine in fleet.engines[:2]:
        engine.set_fault({"mode": "http_error", "status": 503, "retry_after": 3600})
    headers = {"x-kvgate-timeout-ms": "2000"}
    answers = [
        httpx.post(server.url + "/v1/chat/completions", json=chat(max_tokens=4), headers=headers)
        for _ in range(4)
    ]
    assert [a.status_code for a in answers] == [200] * 4
    assert not any(app.resilience.breakers[e].admits() for e in app.fleet.endpoints[:2])
    for engine in fleet.engines:
        engine.set_fault({"mode": "http_error", "status": 429, "retry_after": 30})
    _app, server = start_gateway(pool_config(fleet))
    response = httpx.post(
        server.url + "/v1/chat/completions", json=chat(max_tokens=4), headers=headers
    )
    assert response.status_code == 429 and response.headers["retry-after"] == "30"


def test_8c_spent_budget_fails_fast_with_the_original_error(fleet, start_gateway):
    budget = {"percent_of_active": 0, "min_concurrency": 0}
    _app, server = start_gateway(pool_config(fleet, resilience={"retry_budget": budget}))
    fleet.engines[0].set_fault({"mode": "http_error", "status": 503})
    codes = [
        httpx.post(
            server.url + "/v1/chat/completions", json=chat(max_tokens=4), timeout=20
        ).status_code
        for _ in range(4)
    ]
    assert codes.count(503) == 1 and codes.count(200) == 3
    assert 'reason="budget"' in httpx.get(server.url + "/metrics").text


def test_client_errors_are_not_retried_and_never_count(fleet, start_gateway):
    app, server = start_gateway(pool_config(fleet))
    before = received(fleet)
    for _ in range(8):
        response = httpx.post(
            server.url + "/v1/chat/completions", timeout=20, json=chat(max_tokens=10_000_000)
        )
        assert response.status_code == 400
    assert received(fleet) - before == 8
    assert all(app.resilience.breakers[e].consecutive_failures == 0 for e in app.fleet.endpoints)


@pytest.mark.parametrize("header", ["x-kvgate-timeout-ms", "x-kvgate-first-token-timeout-ms"])
def test_bad_timeout_header_is_rejected_before_any_engine(fleet, start_gateway, header):
    app, server = start_gateway(pool_config(fleet))
    before = received(fleet)
    response = httpx.post(
        server.url + "/v1/chat/completions", json=chat(), headers={header: "soon"}, timeout=20
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == header
    assert received(fleet) == before
    assert all(e.inflight == 0 for e in app.fleet.endpoints)


def test_timeout_header_shortens_the_deadline(fleet, start_gateway):
    app, server = start_gateway(pool_config(fleet))
    for engine in fleet.engines:
        engine.set_fault({"mode": "slow_first_token", "delay_ms": 5000})
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json=chat(max_tokens=4),
        headers={"x-kvgate-first-token-timeout-ms": "300", "x-kvgate-timeout-ms": "1500"},
        timeout=20,
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] in ("upstream_first_token_timeout", "deadline_exceeded")
    assert all(
        app.resilience.breakers[e].consecutive_failures == 0 for e in app.fleet.endpoints
    )  # the client's own limit blames no engine


def test_an_engine_refusing_the_gateways_key_is_a_gateway_fault_retried_elsewhere(
    fleet, start_gateway
):
    """A 401/403 from an engine is about the endpoint's `api_key`, which the client cannot fix
    (its own key is never forwarded): the request is retried on another engine, the endpoint
    counts a failure, and when every engine refuses the client gets a 502 server error, not an
    authentication error that says its key is wrong."""
    app, server = start_gateway(pool_config(fleet))
    fleet.engines[0].set_fault({"mode": "http_error", "status": 401})
    assert [
        httpx.post(server.url + "/v1/chat/completions", json=chat(max_tokens=4)).status_code
        for _ in range(4)
    ] == [200] * 4
    assert app.resilience.breakers[app.fleet.endpoints[0]].consecutive_failures >= 1
    for engine in fleet.engines:
        engine.set_fault({"mode": "http_error", "status": 403})
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat(max_tokens=4))
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_auth_failed")
    assert "api_key" in error["message"]
    wait_for(lambda: all(e.inflight == 0 for e in app.fleet.endpoints))


def test_every_engine_paused_tells_the_client_when_the_first_pause_ends(fleet, start_gateway):
    """Once every engine asked for a pause (held out of rotation), `no_healthy_endpoint` says
    when the soonest hold ends, not "1 s" while the gateway knows better."""
    app, server = start_gateway(pool_config(fleet))
    for i, engine in enumerate(fleet.engines):
        engine.set_fault({"mode": "http_error", "status": 503, "retry_after": 20 + i})
    for _ in range(len(fleet.engines)):
        httpx.post(server.url + "/v1/chat/completions", json=chat(max_tokens=4))
    assert not any(app.resilience.breakers[e].admits() for e in app.fleet.endpoints)
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat(max_tokens=4))
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "no_healthy_endpoint"
    assert 15 <= int(answer.headers["retry-after"]) <= 20
