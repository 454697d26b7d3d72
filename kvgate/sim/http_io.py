"""Reading request bodies and sending complete responses in the simulator's ASGI apps."""

from .asgi_types import Receive, Send

JSON_HEADERS = [(b"content-type", b"application/json")]


async def read_body(receive: Receive) -> bytes:
    """The request body (what arrived before a disconnect, if the client left)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def respond(send: Send, status: int, body: bytes, headers: list | None = None) -> None:
    """Send a whole response (JSON content type unless `headers` are given)."""
    headers = [
        *(headers if headers is not None else JSON_HEADERS),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
