"""UpstreamTransport against raw loopback servers that answer exactly the bytes a test scripts:
every HTTP/1.1 framing, broken connections at each point, the pool's bounds, and TLS (on both
event loops: tests/upstream/conftest.py)."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import orjson
import pytest

from kvgate.config import UpstreamConfig
from kvgate.upstream.transport import (
    ConnectFailed,
    ConnectionLost,
    PoolExhausted,
    UpstreamTransport,
)
from tests.servers import ServerThread
from tests.upstreams import ScriptedUpstream

HEADERS = [(b"content-type", b"application/json")]
BODY = b'{"model": "m1"}'

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


class RawServer:
    """A loopback server running `handler` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed = 0
        self.a_connection_closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            self.closed += 1
            self.a_connection_closed.set()
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/chat/completions"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[RawServer]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> RawServer:
        raw = RawServer(handler)
        raw.server = await asyncio.start_server(raw._serve, "127.0.0.1", 0)
        servers.append(raw.server)
        return raw

    yield start
    for server in servers:
        server.close()


def answering(*responses: bytes, then_close: bool = False) -> Handler:
    """Answer each request on a connection with the next of `responses`, then close the
    connection or keep it open until the client closes it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            await read_request(reader)
            writer.write(response)
            await writer.drain()
        if not then_close:
            await reader.read()

    return handler


async def whole(transport: UpstreamTransport, url: str) -> tuple[int, bytes]:
    response = await transport.open(url, HEADERS, BODY)
    try:
        return response.status, await response.read()
    finally:
        response.close()


async def test_content_length_chunked_and_close_delimited_bodies(serve):
    content_length = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"
    )
    server = await serve(answering(content_length, chunked))
    until_close = await serve(
        answering(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nhello", then_close=True)
    )
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        assert await whole(transport, server.url) == (200, b"hello")
        assert await whole(transport, server.url) == (200, b"hello")
        assert server.connections == 1  # both framings leave the connection reusable
        async with asyncio.timeout(5):
            assert await whole(transport, until_close.url) == (200, b"hello")
    finally:
        await transport.aclose()


async def test_another_method_is_sent_on_the_same_connections(serve):
    """The `/v1/responses/{id}` routes GET or cancel with the client's method and query."""
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            heads.append((await read_request(reader)).split(b"\r\n", 1)[0])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
        await reader.read()

    server = await serve(handler)
    base = server.url.removesuffix("/v1/chat/completions")
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        for method in (b"GET", b"DELETE"):
            url = f"{base}/v1/responses/resp_1?stream=true"
            response = await transport.open(url, HEADERS, b"", method=method)
            assert await response.read() == b"{}"
            response.close()
    finally:
        await transport.aclose()
    assert heads == [
        b"GET /v1/responses/resp_1?stream=true HTTP/1.1",
        b"DELETE /v1/responses/resp_1?stream=true HTTP/1.1",
    ]
    assert server.connections == 1


async def test_an_informational_answer_before_the_real_one_is_skipped(serve):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # on its own, as a server that first reads the body sends it
        writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
        await reader.read()

    server = await serve(handler)
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        assert await whole(transport, server.url) == (201, b"ok")
    finally:
        await transport.aclose()


async def test_the_request_carries_host_length_and_the_given_headers(serve):
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await reader.read()

    server = await serve(handler)
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        assert await whole(transport, server.url + "?x=1") == (204, b"")
    finally:
        await transport.aclose()
    port = server.url.split(":")[2].split("/")[0]
    assert seen == [
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:" + port.encode() + b"\r\n"
        b"content-length: 15\r\ncontent-type: application/json\r\n\r\n" + BODY
    ]


@pytest.mark.parametrize(
    ("reset", "message"),
    [(False, "the engine closed the connection"), (True, "connection reset by peer")],
)
async def test_a_connection_lost_before_the_answer_says_how(serve, reset, message):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if reset:  # linger 0: the close sends RST, not FIN
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    server = await serve(handler)
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        with pytest.raises(ConnectionLost) as lost:
            await transport.open(server.url, HEADERS, BODY)
    finally:
        await transport.aclose()
    assert str(lost.value) == message


async def test_bytes_before_a_mid_body_cut_are_relayed_then_the_cut_is_raised(serve):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        await writer.drain()
        await asyncio.sleep(0.05)

    server = await serve(handler)
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    received: list[bytes] = []
    try:
        response = await transport.open(server.url, HEADERS, BODY)
        with pytest.raises(ConnectionLost, match="cut short"):
            async for chunk in response.iter_raw():
                received.append(chunk)
        response.close()
    finally:
        await transport.aclose()
    assert received == [b"data: "]


async def test_max_connections_bounds_the_sockets_and_a_waiter_times_out(serve):
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    server = await serve(answering(ok, ok, ok))
    transport = UpstreamTransport(UpstreamConfig(max_connections=1), connect_timeout=0.2)
    try:
        held = await transport.open(server.url, HEADERS, BODY)
        with pytest.raises(PoolExhausted):  # the gateway's own limit, not a connect timeout
            await transport.open(server.url, HEADERS, BODY)
        waiting = asyncio.create_task(whole(transport, server.url))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await held.read() == b"ok"
        held.close()
        assert await waiting == (200, b"ok")
    finally:
        await transport.aclose()
    assert server.connections == 1


async def test_idle_connections_expire_and_are_closed(serve):
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    server = await serve(answering(ok, ok, ok))
    transport = UpstreamTransport(UpstreamConfig(keepalive_expiry=0.2), connect_timeout=5)
    try:
        assert await whole(transport, server.url) == (200, b"ok")
        await asyncio.sleep(0.5)
        assert server.closed == 1  # the expiry timer closed the idle socket
        assert await whole(transport, server.url) == (200, b"ok")
        # Block the loop on purpose: the expiry timer is due but cannot run.
        time.sleep(0.3)  # noqa: ASYNC251
        assert await whole(transport, server.url) == (200, b"ok")  # not on the expired one
    finally:
        await transport.aclose()
    assert server.connections == 3


async def test_no_idle_connection_is_kept_when_the_pool_keeps_none(serve):
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    server = await serve(answering(ok, ok))
    transport = UpstreamTransport(UpstreamConfig(max_keepalive_connections=0), connect_timeout=5)
    try:
        assert await whole(transport, server.url) == (200, b"ok")
        assert await whole(transport, server.url) == (200, b"ok")
    finally:
        await transport.aclose()
    assert server.connections == 2


async def test_a_cancelled_exchange_closes_its_connection(serve):
    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # until the client closes the connection

    server = await serve(never_answers)
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await transport.open(server.url, HEADERS, BODY)
        # Closed, not pooled with its answer still owed.
        await asyncio.wait_for(server.a_connection_closed.wait(), 5)
    finally:
        await transport.aclose()


async def test_reading_pauses_while_the_consumer_does_not_read(serve):
    size = 32 * 1024 * 1024  # far beyond the read-ahead and loopback's socket buffers
    written = asyncio.Event()

    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(bytes(size))
        await writer.drain()
        written.set()
        await reader.read()

    server = await serve(large)
    transport = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        response = await transport.open(server.url, HEADERS, BODY)
        await asyncio.sleep(0.5)
        assert not written.is_set()  # the engine's socket is held back, not our memory filled
        assert len(await response.read()) == size
        response.close()
        await asyncio.wait_for(written.wait(), 5)
    finally:
        await transport.aclose()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt"),
            *("ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
            "-addext",
            *("subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture
def tls_engine(certificate: tuple[Path, Path]) -> Iterator[str]:
    """A scripted engine on https with a self-signed certificate."""
    cert, key = certificate
    options = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    with ServerThread(ScriptedUpstream(), **options) as server:
        yield server.url.replace("http://", "https://") + "/v1/chat/completions"


async def test_an_https_engine_is_reached_over_tls_only_with_a_trusted_certificate(
    tls_engine, certificate, monkeypatch
):
    untrusting = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        with pytest.raises(ConnectFailed):
            await untrusting.open(tls_engine, HEADERS, BODY)
    finally:
        await untrusting.aclose()
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))  # read by the default trust store
    trusting = UpstreamTransport(UpstreamConfig(), connect_timeout=5)
    try:
        status, body = await whole(trusting, tls_engine)
    finally:
        await trusting.aclose()
    assert status == 200 and orjson.loads(body)["choices"][0]["message"]["content"] == "hello"
