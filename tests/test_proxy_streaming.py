"""Streaming done right: no buffering, commit point, disconnects, timeouts — on real sockets."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import orjson
import pytest

from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread

CHAT = {"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def test_chunks_are_relayed_as_they_arrive(upstream, gateway):
    engine, _ = upstream
    engine.script.chunks, engine.script.gap = 5, 0.1
    _, server = gateway
    arrivals = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=CHAT) as response:
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 5
    assert arrivals[-1] - arrivals[0] >= 0.3


# kvgate's own HTTP protocol tells the chain that the client left (`ON_DISCONNECT`); under
# uvicorn's plain one the chain watches `receive()` instead. Both must abort the upstream.
SERVED_BY = pytest.mark.parametrize("http", ["kvgate", "httptools"])


@SERVED_BY
def test_client_disconnect_mid_stream_aborts_upstream(upstream, start_gateway, http):
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 100, 0.05
    app, server = _served_by(start_gateway, up.url, http)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=CHAT) as response:
        next(response.iter_raw())
        closed_at = time.monotonic()
    assert engine.disconnected.wait(timeout=2)
    assert engine.disconnects[0] - closed_at < 1.0
    _wait_for(lambda: app.fleet.endpoints[0].inflight == 0)


@SERVED_BY
def test_client_disconnect_while_waiting_for_unary_answer_aborts_upstream(
    upstream, start_gateway, http
):
    engine, up = upstream
    engine.script.headers_delay = 30
    app, server = _served_by(start_gateway, up.url, http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", timeout=0.3, json={**CHAT, "stream": False})
    assert engine.disconnected.wait(timeout=2)
    _wait_for(lambda: app.fleet.endpoints[0].inflight == 0)


def test_failure_before_first_event_is_a_clean_error_response(upstream, gateway):
    engine, _ = upstream
    engine.script.close_after_chunks = 0
    _, server = gateway
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] in (
        "upstream_stream_truncated",
        "upstream_connection_lost",
    )


def test_failure_after_commit_ends_stream_with_error_event_not_done(upstream, gateway):
    engine, _ = upstream
    engine.script.chunks, engine.script.close_after_chunks = 5, 2
    app, server = gateway
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    events = _events(response.content)
    assert len(events) == 3
    assert b"[DONE]" not in response.content
    last = orjson.loads(events[-1].removeprefix(b"data: "))
    assert set(last["error"]) == {"message", "type", "param", "code"}
    _wait_for(lambda: app.fleet.endpoints[0].inflight == 0)


@pytest.mark.parametrize("one_write", [False, True])
def test_an_engine_error_event_mid_stream_reaches_the_client_in_openai_shape_and_ends_it(
    upstream, gateway, one_write
):
    """vLLM streams its own vocabulary (`BadRequestError`, the status as an integer code) and
    a `[DONE]` after it; the client gets OpenAI's shape as the stream's last event. Whether
    the events before the error arrive apart from it (the stream committed first) or in the
    same read: the error is not the answer, and they are not lost."""
    engine, _ = upstream
    engine.script.chunks, engine.script.error_event_after = 5, 2
    engine.script.gap, engine.script.one_write = (0.0, True) if one_write else (0.05, False)
    app, server = gateway
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    events = _events(response.content)
    assert len(events) == 3 and b"[DONE]" not in response.content
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error == {
        "message": "scripted failure mid-stream",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    client = sdk_client(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(openai.APIError, match="scripted failure mid-stream"):
        for _ in stream:
            pass
    _wait_for(lambda: app.fleet.endpoints[0].inflight == 0)


def test_an_engine_error_event_before_any_token_is_the_answer(upstream, gateway):
    engine, _ = upstream
    engine.script.error_event_after = 0
    _, server = gateway
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["code"] is None


def test_an_event_of_megabytes_is_relayed_whole(upstream, gateway):
    """A completions stream with `echo` and `logprobs` puts the prompt's log-probabilities in
    its first event: megabytes for a long prompt."""
    engine, _ = upstream
    engine.script.chunks, engine.script.padding = 2, 3_000_000
    _, server = gateway
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert response.status_code == 200
    events = _events(response.content)
    assert events[-1] == b"data: [DONE]"
    contents = [
        orjson.loads(e.removeprefix(b"data: "))["choices"][0]["delta"]["content"]
        for e in events[:2]
    ]
    assert contents == [f"tok{i} " + "x" * 3_000_000 for i in range(2)]


def test_first_token_timeout(upstream, start_gateway):
    engine, server_thread = upstream
    engine.script.headers_delay = 5
    _, server = start_gateway(gateway_config([server_thread.url], timeouts={"first_token": 0.3}))
    started = time.monotonic()
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_first_token_timeout"
    assert time.monotonic() - started < 3
    assert engine.disconnected.wait(timeout=2)


def test_stall_timeout_after_commit_is_an_error_event(upstream, start_gateway):
    engine, server_thread = upstream
    engine.script.chunks, engine.script.gap = 3, 2.0
    _, server = start_gateway(gateway_config([server_thread.url], timeouts={"stall": 0.3}))
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    last = orjson.loads(_events(response.content)[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_stall_timeout"


def test_a_client_that_stops_reading_is_not_an_engine_stall_and_frees_its_place(
    upstream, start_gateway
):
    """A client that never reads a fast stream blocks the gateway's writes to it: that time is
    the client's, not the engine's silence. No stall timeout blames the engine (its breaker
    counts nothing); at the total deadline the gateway drops the connection instead of
    waiting to send a last error event, and the request's place is freed."""
    engine, server_thread = upstream
    engine.script.chunks, engine.script.padding = 4000, 16384  # ~64 MB, as fast as it goes
    config = gateway_config([server_thread.url], timeouts={"stall": 0.3, "total": 3.0})
    app, server = start_gateway(config)
    body = orjson.dumps(CHAT)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )
        endpoint = app.fleet.endpoints[0]
        deadline = time.monotonic() + 5
        while not endpoint.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert endpoint.inflight == 1
        deadline = time.monotonic() + 15
        while endpoint.inflight and time.monotonic() < deadline:
            time.sleep(0.1)
        assert endpoint.inflight == 0  # freed at the total deadline
        # The connection was reset: what the kernel held for the client is not trickled out.
        received = 0
        with pytest.raises(ConnectionResetError):
            while chunk := client.recv(1 << 20):
                received += len(chunk)
    assert received < 4000 * 16384
    breaker = app.resilience.breakers[app.fleet.endpoints[0]]
    assert breaker.consecutive_failures == 0
    text = httpx.get(server.url + "/metrics").text
    assert (
        sample_value(
            text, "kvgate_upstream_attempts_total", endpoint="default-0", result="released"
        )
        == 1
    )
    assert (
        sample_value(
            text,
            "kvgate_requests_total",
            route="chat",
            model="m1",
            status="200",
            outcome="client_read_timeout",
        )
        == 1
    )


def test_the_gateways_connections_all_in_use_is_its_own_limit_not_the_engines_failure(
    upstream, start_gateway
):
    """With every upstream connection (`upstream.max_connections`) held by a long stream, a
    request that waits for one in vain gets 503 `upstream_connections_exhausted`: the engine is
    not blamed (its breaker counts nothing), nor reported as not accepting connections."""
    engine, server_thread = upstream
    engine.script.chunks, engine.script.gap = 20, 0.1
    config = gateway_config(
        [server_thread.url], upstream={"max_connections": 1}, timeouts={"connect": 0.2}
    )
    app, server = start_gateway(config)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=CHAT) as held:
        assert held.status_code == 200
        answer = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "upstream_connections_exhausted"
        assert answer.headers["retry-after"] == "1"
        held.read()
    assert app.resilience.breakers[app.fleet.endpoints[0]].consecutive_failures == 0
    text = httpx.get(server.url + "/metrics").text
    assert not sample_value(
        text, "kvgate_upstream_attempts_total", endpoint="default-0", result="failure"
    )


def test_stream_with_every_gap_under_the_stall_limit_completes(upstream, start_gateway):
    # 6 gaps of 0.15 s: each under the 0.4 s stall limit, together more than twice it.
    engine, server_thread = upstream
    engine.script.chunks, engine.script.gap = 7, 0.15
    _, server = start_gateway(gateway_config([server_thread.url], timeouts={"stall": 0.4}))
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    events = _events(response.content)
    assert events[-1] == b"data: [DONE]"
    assert len([e for e in events if e.startswith(b"data: {")]) == 7


def test_total_deadline_cuts_a_steady_stream(upstream, start_gateway):
    engine, server_thread = upstream
    engine.script.chunks, engine.script.gap = 40, 0.1
    config = gateway_config([server_thread.url], timeouts={"stall": 0.5, "total": 1.0})
    _, server = start_gateway(config)
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    last = orjson.loads(_events(response.content)[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "deadline_exceeded"


def test_total_deadline_for_unary(upstream, start_gateway):
    engine, server_thread = upstream
    engine.script.headers_delay = 5
    _, server = start_gateway(gateway_config([server_thread.url], timeouts={"total": 0.3}))
    response = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": False})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"


def test_a_deadline_before_the_engine_answers_a_stream_is_the_deadlines(upstream, start_gateway):
    """A stream whose total deadline passes before the engine sends its headers ends with
    `deadline_exceeded` (the limit that fired), not the engine's first-token timeout."""
    engine, server_thread = upstream
    engine.script.headers_delay = 5
    _, server = start_gateway(gateway_config([server_thread.url], timeouts={"total": 0.3}))
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"


def test_total_deadline_covers_an_engine_error_body_that_stalls(start_gateway):
    async def stalling_error(scope, receive, send):  # a 500 whose body never ends
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await receive()
        head = [(b"content-type", b"application/json"), (b"content-length", b"100")]
        await send({"type": "http.response.start", "status": 500, "headers": head})
        await send({"type": "http.response.body", "body": b'{"error": ', "more_body": True})
        await asyncio.sleep(30)

    with ServerThread(stalling_error, lifespan="off") as engine:
        config = gateway_config(
            [engine.url], pool={"models": [CHAT["model"]]}, timeouts={"total": 0.5}
        )
        _, server = start_gateway(config)
        started = time.monotonic()
        response = httpx.post(
            server.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=10
        )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - started < 5


def test_non_stream_answer_to_stream_request_is_a_protocol_error(upstream, gateway):
    engine, _ = upstream
    engine.script.content_type = b"application/json"
    _, server = gateway
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_not_a_stream"


def test_unreachable_endpoint_is_503_without_panic_and_not_ready(start_gateway):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    app, server = start_gateway(
        gateway_config([dead], pool={"models": ["m1"]}, health={"panic_threshold": 0})
    )
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 503
    assert ready.json()["pools_without_healthy_endpoint"] == ["default"]
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_endpoint"
    assert "retry-after" in response.headers
    app.fleet.endpoints[0].healthy = True
    app.fleet.refresh()
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_connect_failed"
    assert app.fleet.endpoints[0].inflight == 0


def _wait_for(condition, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _served_by(start_gateway, upstream_url: str, http: str):
    """A gateway in front of `upstream_url`, served by kvgate's HTTP protocol or uvicorn's."""
    options = {} if http == "kvgate" else {"http": http}
    return start_gateway(gateway_config([upstream_url]), **options)
