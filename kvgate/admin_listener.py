"""The admin listener (`server.admin_port`): `/metrics` and `/admin/*` on a port of their own,
so the public port can be exposed alone. On the public port those routes are then unknown
(404). It shares the gateway's state (same process, same event loop); the public listener's
server runs the gateway's lifespan, this one none.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.asgi import ASGIApp, Receive, Scope, Send, send_bytes, send_error
from kvgate.errors import MethodNotAllowed, NotFound

METRICS_PATH = "/metrics"
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"


def is_admin_route(path: str) -> bool:
    return path == METRICS_PATH or path.startswith("/admin/")


def unknown_route(scope: Scope) -> NotFound:
    return NotFound(f"Unknown route {scope['method']} {scope['path']}", code="unknown_url")


class AdminListener:
    """ASGI app of the admin port: `admin` answers `/admin/*`, `render_metrics` `/metrics`."""

    def __init__(self, admin: ASGIApp, render_metrics: Callable[[], bytes]) -> None:
        self.admin = admin
        self.render_metrics = render_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path.startswith("/admin/"):
            await self.admin(scope, receive, send)
        elif path != METRICS_PATH:
            await send_error(send, unknown_route(scope))
        elif scope["method"] not in ("GET", "HEAD"):
            error = MethodNotAllowed(f"{scope['method']} is not allowed on {path}; use GET")
            await send_error(send, error, [(b"allow", b"GET")])
        else:
            await send_bytes(send, 200, self.render_metrics(), _PROMETHEUS)
