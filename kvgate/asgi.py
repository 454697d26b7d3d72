"""The ASGI contract kvgate relies on, and the few ways it answers a request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvgate.errors import KvgateError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON = b"application/json"


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    response_headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
    ]
    if headers:
        response_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send, error: KvgateError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    extra = error.headers()
    if headers:
        extra.extend(headers)
    await send_bytes(send, error.status, error.to_body(), JSON, extra)
