"""kvgate's HTTP protocol writes a response's head and the body that follows it in one system
call (`kvgate/write_coalescing.py`), and HTTP behaves as before: answers arrive whole and
byte-exact, streams event by event, keep-alive, `connection: close`, pipelining,
100-continue and a slow reader's flow control all work. On uvloop, the loop kvgate serves
with; the write system calls are counted from the kernel's per-thread I/O accounting."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvgate.app import GatewayApp
from kvgate.config import parse_config
from kvgate.write_coalescing import CoalescingTransport
from tests.conftest import gateway_config
from tests.servers import ServerThread
from tests.upstreams import ScriptedUpstream

BIG_CHUNK = 64 * 1024
BIG_CHUNKS = 128  # 8 MiB: far more than the loopback socket buffers hold


class Answers:
    """An ASGI app: `/echo` answers the request's query and body with a content-length,
    `/big` 8 MiB written in a loop that never yields by itself (counting the sends that had to
    wait for the client: uvicorn's write flow control)."""

    def __init__(self) -> None:
        self.sends_held_back = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/big":
            await self._big(send)
            return
        answer = scope["query_string"] + b"|" + body
        head = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": answer})

    async def _big(self, send: Any) -> None:
        loop = asyncio.get_running_loop()
        size = (b"content-length", b"%d" % (BIG_CHUNK * BIG_CHUNKS))
        await send({"type": "http.response.start", "status": 200, "headers": [size]})
        for i in range(BIG_CHUNKS):
            ran: list[bool] = []
            loop.call_soon(ran.append, True)  # runs during the send only if the send waited
            await send({"type": "http.response.body", "body": _chunk(i), "more_body": True})
            self.sends_held_back += bool(ran)
        await send({"type": "http.response.body", "body": b""})


def _chunk(i: int) -> bytes:
    return bytes([i % 251]) * BIG_CHUNK


def _answer(query: bytes, body: bytes = b"") -> bytes:
    text = query + b"|" + body
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (
        len(text),
        text,
    )


@pytest.fixture
def answers() -> Iterator[tuple[Answers, ServerThread]]:
    app = Answers()
    plain = {"loop": "uvloop", "lifespan": "off", "date_header": False, "server_header": False}
    with ServerThread(app, **plain) as server:
        yield app, server


class WriteCounter:
    """The write system calls (write, writev) a server's event-loop thread has made."""

    def __init__(self, server: ServerThread) -> None:
        self._io = Path(f"/proc/self/task/{server.call(_thread_id())}/io")

    def __call__(self) -> int:
        for line in self._io.read_text().splitlines():
            if line.startswith("syscw:"):
                return int(line.split()[1])
        raise AssertionError(f"no syscw in {self._io}")


async def _thread_id() -> int:
    return threading.get_native_id()


def _connect(server: ServerThread) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.settimeout(10)
    return conn


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _read_to_eof(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_an_answer_is_one_write_and_arrives_byte_exact(answers):
    _, server = answers
    writes = WriteCounter(server)
    with _connect(server) as conn:
        expected = _answer(b"q=1", b"hello")
        before = writes()
        conn.sendall(b"POST /echo?q=1 HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
        assert _read_exactly(conn, len(expected)) == expected
        assert writes() - before == 1  # head and body: one system call (uvicorn makes two)


def test_an_answer_then_close_arrives_whole_before_the_close(answers):
    _, server = answers
    with _connect(server) as conn:
        conn.sendall(b"GET /echo?q=2 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        received = _read_to_eof(conn)  # the answer is written and the connection closed at once
        text = b"q=2|"
        assert received == (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(text), text)
        )


def test_a_head_with_no_body_after_it_still_leaves(answers):
    # uvicorn writes nothing after the head of an answer to HEAD: the head goes out at the end
    # of the pass on a kept-alive connection, and before the close on a closing one.
    _, server = answers
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 4\r\n"
    with _connect(server) as conn:
        conn.sendall(b"HEAD /echo?h=1 HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _read_exactly(conn, len(head) + 2) == head + b"\r\n"
        conn.sendall(b"HEAD /echo?h=2 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_to_eof(conn) == head + b"connection: close\r\n\r\n"


def test_pipelined_requests_are_answered_in_order(answers):
    _, server = answers
    with _connect(server) as conn:
        requests = [b"GET /echo?n=%d HTTP/1.1\r\nhost: x\r\n\r\n" % n for n in range(5)]
        conn.sendall(b"".join(requests))
        expected = b"".join(_answer(b"n=%d" % n) for n in range(5))
        assert _read_exactly(conn, len(expected)) == expected


def test_expect_100_continue_gets_its_interim_answer_first(answers):
    _, server = answers
    with _connect(server) as conn:
        conn.sendall(
            b"POST /echo?c=1 HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            b"content-length: 4\r\n\r\n"
        )
        interim = b"HTTP/1.1 100 Continue\r\n\r\n"
        assert _read_exactly(conn, len(interim)) == interim
        conn.sendall(b"body")
        expected = _answer(b"c=1", b"body")
        assert _read_exactly(conn, len(expected)) == expected


def test_a_slow_reader_gets_everything_and_holds_the_writer_back(answers):
    app, server = answers
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect(("127.0.0.1", server.port))
        conn.settimeout(10)
        conn.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.3)  # the server fills every buffer before the client reads a byte
        head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (BIG_CHUNK * BIG_CHUNKS)
        expected = head + b"".join(_chunk(i) for i in range(BIG_CHUNKS))
        received = bytearray()
        while len(received) < len(expected):
            chunk = conn.recv(BIG_CHUNK)
            assert chunk, "connection closed early"
            received += chunk
        assert bytes(received) == expected
        assert app.sends_held_back > 0  # the real transport paused uvicorn's writer


@pytest.fixture
def uvloop_gateway(upstream: tuple[ScriptedUpstream, ServerThread]) -> Iterator[ServerThread]:
    config = parse_config(gateway_config([upstream[1].url]))
    with ServerThread(GatewayApp(config), loop="uvloop") as server:
        yield server


def _chat(stream: bool) -> bytes:
    body = orjson.dumps(
        {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        | ({"stream": True} if stream else {})
    )
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


def _read_answer(conn: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    return head, body + _read_exactly(conn, length - len(body))


def test_the_gateway_answers_keep_alive_requests_in_two_writes_each(upstream, uvloop_gateway):
    engine, _ = upstream
    writes = WriteCounter(uvloop_gateway)
    with _connect(uvloop_gateway) as conn:
        conn.sendall(_chat(stream=False))
        _read_answer(conn)  # the gateway's connection to the engine is open now
        requests = 10
        before = writes()
        for _ in range(requests):
            conn.sendall(_chat(stream=False))
            head, body = _read_answer(conn)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            expected = orjson.dumps(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 1,
                    "model": "m1",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hello"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                }
            )
            assert body == expected
        # The request to the engine and the answer: two each (three without coalescing); the slack
        # is for a health probe that may fall in the window.
        assert writes() - before <= 2 * requests + 2
        assert len(engine.inference_requests) == requests + 1


def test_the_gateway_closes_after_answering_connection_close(uvloop_gateway):
    with _connect(uvloop_gateway) as conn:
        conn.sendall(
            _chat(stream=False).replace(b"host: x\r\n", b"host: x\r\nconnection: close\r\n")
        )
        received = _read_to_eof(conn)
        head, _, body = received.partition(b"\r\n\r\n")
        assert b"\r\nconnection: close" in head
        assert orjson.loads(body)["choices"][0]["message"]["content"] == "hello"


def test_a_stream_through_the_gateway_arrives_event_by_event(upstream, uvloop_gateway):
    engine, _ = upstream
    engine.script.chunks, engine.script.gap = 5, 0.1
    with _connect(uvloop_gateway) as conn:
        conn.sendall(_chat(stream=True))
        first = conn.recv(65536)
        arrivals = [time.monotonic()]
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"tok0" in first  # the head and the first event leave together
        data = first
        while not data.endswith(b"0\r\n\r\n"):
            chunk = conn.recv(65536)
            assert chunk, "stream cut short"
            arrivals.append(time.monotonic())
            data += chunk
        assert all(f"tok{i} ".encode() in data for i in range(5))
        assert data.count(b"data: ") == 6  # five events and [DONE]
        assert arrivals[-1] - arrivals[0] > 0.3  # four gaps of 0.1 s between first and last


def test_a_held_head_counts_in_the_buffer_and_leaves_before_a_close():
    async def scenario() -> tuple[list[int], bytes]:
        loop = asyncio.get_running_loop()
        received: asyncio.Future[bytes] = loop.create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received.set_result(await reader.read())
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        coalescing = CoalescingTransport(transport, loop)
        sizes = []
        coalescing.write(bytearray(b"HTTP/1.1 200 OK\r\n\r\n"))
        sizes.append(coalescing.get_write_buffer_size())  # held
        coalescing.write(b"body")
        sizes.append(coalescing.get_write_buffer_size())  # gone out with the body
        coalescing.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        sizes.append(coalescing.get_write_buffer_size())
        coalescing.close()  # in the same pass: the head must still leave
        data = await asyncio.wait_for(received, 10)
        server.close()
        await server.wait_closed()
        return sizes, data

    sizes, data = asyncio.run(scenario())
    assert sizes == [19, 0, 27]
    assert data == b"HTTP/1.1 200 OK\r\n\r\nbody" + b"HTTP/1.1 204 No Content\r\n\r\n"
