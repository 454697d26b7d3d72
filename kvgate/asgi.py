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

# A request's scope key through which the server tells the app that its client left, without
# the app keeping a task per request in `receive()` for it. kvgate's own server protocol
# (`kvgate/http_server.py`) puts None there; the app may put a callable, which the protocol
# calls once when the connection is lost before that request's response is complete. Without
# the key (another server), the app watches `receive()` for `http.disconnect`.
ON_DISCONNECT = "kvgate.on_disconnect"
# A request's scope key holding a callable that drops its connection at once (the buffered
# answer discarded), for a client that stopped reading a stream; kvgate's own server protocol
# provides it. Without it (another server) the app returns and the server closes the
# connection once what it buffered is written.
ABORT = "kvgate.abort"


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
