"""Slow, idle and oversized clients cost bounded resources: a body trickled slower than
`server.body_timeout` gets 408 and its connection closed; headers trickled past
`server.header_timeout` lose their connection, and headers past `server.max_header_bytes` get
431 before they are all read; idle keep-alive connections are closed after the
keep-alive timeout; other clients are served meanwhile, and a thousand such connections cost a
few MiB of the gateway's memory."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def test_headers_past_the_limit_get_431_and_the_connection_closed_before_they_are_read(
    upstream, start_gateway
):
    """No key is needed to send headers: without a limit three connections sending hundreds of
    megabytes of them took the gateway's memory past 1.5 GB. Headers within the limit (64 KiB
    by default) pass."""
    engine, up = upstream
    _, server = start_gateway(gateway_config([up.url]))
    body = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'
    within = {"x-pad": "a" * 48000}
    assert (
        httpx.post(server.url + "/v1/chat/completions", content=body, headers=within).status_code
        == 200
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as flood:
        flood.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        sent, reply = 0, b""
        with contextlib.suppress(OSError):  # the gateway closes while we still send
            while sent < 64 * 1024 * 1024:
                flood.sendall(b"X-Pad: " + b"a" * 8000 + b"\r\n")
                sent += 8009
        with contextlib.suppress(OSError):
            while chunk := flood.recv(65536):
                reply += chunk
    assert sent < 8 * 1024 * 1024  # refused long before the flood ended
    assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
    assert b'"request_header_fields_too_large"' in reply
    assert len(engine.received) == 1  # the flood reached no engine


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


def _gateway_process(
    tmp_path: Path, upstream_url: str, timeout: float
) -> tuple[subprocess.Popen[bytes], int]:
    """`kvgate serve` in its own process (so its RSS and fds are the gateway's alone), with
    `timeout` seconds for idle keep-alive connections, request headers and bodies."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    config = tmp_path / "gw.yaml"
    config.write_text(
        f"server: {{port: {port}, access_log: false, keepalive_timeout: {timeout}, "
        f"header_timeout: {timeout}, body_timeout: {timeout}}}\n"
        f"auth: none\npools:\n  - name: p\n    endpoints: [{{url: '{upstream_url}'}}]\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kvgate serve exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, port
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("kvgate serve did not start")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _closed_by_server(conn: socket.socket) -> bytes:
    """Everything the server sent until it closed the connection (waits for the close)."""
    received = b""
    try:
        while chunk := conn.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_idle_and_trickling_connections_cost_bounded_memory_and_are_closed(upstream, tmp_path):
    """1,000 idle keep-alive connections, 100 clients trickling headers and 100 trickling a
    body, one byte each every 0.5 s, all held at once: the gateway's RSS grows by less than
    32 MiB (9.3 MiB measured on a 2-core VM, about 8 KB per connection), another client is
    served meanwhile, and the server closes every one of them by its timeout (408 for the
    bodies); then its open fds are back where they started."""
    engine, up = upstream
    timeout = 6.0
    proc, port = _gateway_process(tmp_path, up.url, timeout)
    try:
        base_rss, base_fds = _rss(proc.pid), _fds(proc.pid)
        chat = b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}'
        body = chat * 20
        headers, bodies = [], []
        for _ in range(100):
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            headers.append(conn)
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
            conn.sendall(_request_head(port, len(body)))
            bodies.append(conn)
        stop = threading.Event()

        def trickle() -> None:
            for index in range(len(body)):
                for conn in headers:
                    with contextlib.suppress(OSError):
                        conn.sendall(b"X-Slow: a\r\n"[index % 11 : index % 11 + 1])
                for conn in bodies:
                    with contextlib.suppress(OSError):
                        conn.sendall(body[index : index + 1])
                if stop.wait(0.5):
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        started = time.monotonic()
        idle = []
        for _ in range(1000):
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
            conn.sendall(f"GET /healthz HTTP/1.1\r\nHost: x:{port}\r\n\r\n".encode())
            idle.append(conn)
        for conn in idle:
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                answer += conn.recv(4096)
        assert _rss(proc.pid) - base_rss < 32 * 2**20
        served = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=chat)
        assert served.status_code == 200
        for conn in headers + idle:
            assert _closed_by_server(conn) == b""
        for conn in bodies:
            assert _closed_by_server(conn).startswith(b"HTTP/1.1 408")
        # Every slow connection was opened before `started`; each is closed one timeout after
        # its last request (the idle ones) or its start, plus generous slack for a busy machine.
        assert time.monotonic() - started < 3 * timeout + 20
        stop.set()
        sender.join()
        for conn in headers + bodies + idle:
            conn.close()
        assert len(engine.inference_requests) == 1  # only the served client reached the engine
        deadline = time.monotonic() + 10
        while _fds(proc.pid) > base_fds + 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _fds(proc.pid) <= base_fds + 5
    finally:
        proc.terminate()
        proc.wait(timeout=10)
