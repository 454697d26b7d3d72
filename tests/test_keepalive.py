"""The server's idle keep-alive timeout outlasts clients' pool expiry: a connection a client
reuses after 5 s idle (httpx's and the OpenAI SDK's expiry) is still open, so that request
never meets a connection the gateway is closing at the same moment."""

from __future__ import annotations

import socket
import time

from kvgate.app import GatewayApp
from kvgate.config import parse_config
from kvgate.serving import uvicorn_options
from tests.conftest import gateway_config
from tests.servers import ServerThread


def _get_healthz(conn: socket.socket, port: int) -> bytes:
    conn.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    answer = b""
    while not answer.endswith(b'{"status":"ok"}'):
        chunk = conn.recv(4096)
        if not chunk:
            break
        answer += chunk
    return answer


def test_a_connection_idle_past_client_pool_expiry_is_still_served(upstream):
    _, up = upstream
    config = parse_config(gateway_config([up.url]))
    options = uvicorn_options("127.0.0.1", 0, "warning", "text")
    served = {key: options[key] for key in ("timeout_keep_alive", "http")}
    with ServerThread(GatewayApp(config), **served) as server:
        conn = socket.create_connection(("127.0.0.1", server.port))
        conn.settimeout(10)
        assert _get_healthz(conn, server.port).startswith(b"HTTP/1.1 200")
        time.sleep(6)  # past 5 s: the pools of httpx / the OpenAI SDK retire it about now
        assert _get_healthz(conn, server.port).startswith(b"HTTP/1.1 200")
        conn.close()
    assert config.server.keepalive_timeout == options["timeout_keep_alive"]
