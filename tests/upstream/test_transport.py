"""UpstreamTransport against a real HTTP server on loopback (the scripted upstream on uvicorn)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import orjson
import pytest

from kvgate.config import UpstreamConfig
from kvgate.upstream.transport import ConnectFailed, UpstreamTransport
from tests.upstreams import Script

HEADERS = [(b"content-type", b"application/json")]


def chat(stream: bool) -> bytes:
    return orjson.dumps(
        {"model": "m1", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    )


@pytest.fixture
async def transport() -> AsyncIterator[UpstreamTransport]:
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    yield transport
    await transport.aclose()


async def test_status_and_headers_arrive_before_the_body_is_read(upstream, transport):
    app, server = upstream
    app.script = Script(status=429, extra_headers=[(b"retry-after", b"3")])
    response = await transport.open(server.url + "/v1/chat/completions", HEADERS, chat(False))
    try:
        assert response.status == 429
        assert response.headers["retry-after"] == "3"
        assert orjson.loads(await response.read())["error"]["message"] == "scripted failure"
    finally:
        response.close()
    assert app.inference_requests[0].body["messages"][0]["content"] == "hi"
    assert app.inference_requests[0].headers["content-type"] == "application/json"


async def test_read_returns_the_whole_body_or_its_first_bytes(upstream, transport):
    _, server = upstream
    url = server.url + "/v1/chat/completions"
    whole = await transport.open(url, HEADERS, chat(False))
    try:
        body = await whole.read()
    finally:
        whole.close()
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "hello"
    first = await transport.open(url, HEADERS, chat(False))
    try:
        assert await first.read(10) == body[:10]
    finally:
        first.close()


async def test_iter_raw_yields_the_stream_as_sent(upstream, transport):
    app, server = upstream
    app.script = Script(chunks=3)
    response = await transport.open(server.url + "/v1/chat/completions", HEADERS, chat(True))
    try:
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        raw = b"".join([chunk async for chunk in response.iter_raw()])
    finally:
        response.close()
    events = raw.split(b"\n\n")
    assert [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:3]] == [
        "tok0 ",
        "tok1 ",
        "tok2 ",
    ]
    assert events[3:] == [b"data: [DONE]", b""]


async def test_closing_before_the_end_aborts_the_request_on_the_engine(upstream, transport):
    app, server = upstream
    app.script = Script(chunks=1000, gap=0.05)
    response = await transport.open(server.url + "/v1/chat/completions", HEADERS, chat(True))
    chunks = response.iter_raw()
    assert (await anext(chunks)).startswith(b"data: ")
    assert not app.disconnected.is_set()
    response.close()
    await chunks.aclose()
    assert await asyncio.to_thread(app.disconnected.wait, 10)


async def test_closing_a_fully_read_response_returns_the_connection_to_the_pool(
    upstream, transport
):
    app, server = upstream
    url = server.url + "/v1/chat/completions"
    for _ in range(2):
        response = await transport.open(url, HEADERS, chat(False))
        await response.read()
        response.close()
    first, second = app.inference_requests
    assert first.client is not None and first.client == second.client  # one connection


async def test_a_refused_connection_is_connect_failed(transport):
    with socket.socket() as bound:  # a bound port nobody listens on refuses connections
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        with pytest.raises(ConnectFailed):
            await transport.open(f"http://127.0.0.1:{port}/v1/chat/completions", HEADERS, b"{}")


def _established_to(port: int) -> int:
    """This process's established TCP connections whose remote port is `port`."""
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


async def test_connections_a_burst_left_idle_are_closed_after_keepalive_expiry(upstream):
    app, server = upstream
    app.script = Script(chunks=3, gap=0.05)
    transport = UpstreamTransport(UpstreamConfig(keepalive_expiry=0.5), connect_timeout=5)
    port = int(server.url.rsplit(":", 1)[1])

    async def one() -> None:
        response = await transport.open(server.url + "/v1/chat/completions", HEADERS, chat(True))
        try:
            await response.read()
        finally:
            response.close()

    try:
        await asyncio.gather(*(one() for _ in range(20)))
        assert _established_to(port) > 1  # the burst's connections are pooled
        # Sooner than the server closes idle connections itself (uvicorn: 5 s), so only the
        # transport's expiry can close them in time.
        deadline = asyncio.get_running_loop().time() + 3
        while _established_to(port) > 0:
            assert asyncio.get_running_loop().time() < deadline, "idle connections stayed open"
            await asyncio.sleep(0.1)
    finally:
        await transport.aclose()
