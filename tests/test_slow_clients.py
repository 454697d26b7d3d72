"""Slow and idle clients cost bounded resources: a body trickled slower than
`server.body_timeout` gets 408 and its connection back; idle keep-alive connections are closed
after the keep-alive timeout; other clients are served meanwhile."""

from __future__ import annotations

import socket
import threading
import time

import httpx

from tests.conftest import gateway_config


def _request_head(port: int, length: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_a_trickled_body_gets_408_and_others_are_served(upstream, start_gateway):
    engine, up = upstream
    _, server = start_gateway(gateway_config([up.url], server={"body_timeout": 1.0}))
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.settimeout(10)
    slow.sendall(_request_head(server.port, len(body)))
    stop = threading.Event()

    def trickle() -> None:
        for byte in body[:20]:
            if stop.is_set():
                return
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(0.25)

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    started = time.monotonic()
    # Meanwhile another client is served at once.
    fast = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=5)
    assert fast.status_code == 200
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += slow.recv(4096)
    stop.set()
    assert reply.startswith(b"HTTP/1.1 408")
    assert b'"request_timeout"' in reply or b"request_timeout" in reply + slow.recv(4096)
    assert time.monotonic() - started < 8  # one body_timeout, generously
    slow.close()
    assert len(engine.inference_requests) == 1  # the trickled request reached no engine


def test_idle_keepalive_connections_are_closed(upstream, start_gateway):
    _, up = upstream
    _, server = start_gateway(gateway_config([up.url]))
    idle = []
    for _ in range(1000):
        conn = socket.create_connection(("127.0.0.1", server.port))
        conn.sendall(f"GET /healthz HTTP/1.1\r\nHost: x:{server.port}\r\n\r\n".encode())
        idle.append(conn)
    for conn in idle:
        conn.settimeout(15)
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):
            answer += conn.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200
    closed = 0
    for conn in idle:  # the server closes each after its keep-alive timeout (5 s by default)
        try:
            closed += conn.recv(4096) == b""
        except OSError:
            closed += 1
        conn.close()
    assert closed == 1000
