"""The floor under kvgate's added latency: kvgate's HTTP server and its upstream client with
nothing between them.

    python benchmarks/passthrough_proxy.py --port 8081 --upstream http://127.0.0.1:8000

The same uvicorn as `kvgate serve` (its server options and header-deadline protocol, uvloop,
httptools) and the same data-path client (`kvgate.upstream.transport`), joined by the least a
proxy must do: read the request body, POST it to the one upstream, and relay the answer (a
whole body with its length when the upstream gave one, otherwise each chunk as it arrives).
No authentication, parsing, admission, routing, retries, relay deadlines, metrics or
settlement. `benchmarks/overhead.py --floor` measures it beside kvgate, so that kvgate's added
latency splits into what this stack costs and what kvgate's request chain adds on top.
`GET` on any path answers 200 (the readiness check).
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn

from kvgate.asgi import Receive, Scope, Send
from kvgate.config import UpstreamConfig
from kvgate.serving import uvicorn_options
from kvgate.upstream.transport import UpstreamTransport

CONNECT_TIMEOUT = 5.0


class PassthroughProxy:
    """An ASGI app that forwards every POST to `upstream` + its path."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.transport: UpstreamTransport | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        else:
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.transport = UpstreamTransport(UpstreamConfig(), CONNECT_TIMEOUT)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.transport is not None:
                    await self.transport.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        assert self.transport is not None
        headers = [(b"content-type", b"application/json")]
        answer = await self.transport.open(self.upstream + scope["path"], headers, b"".join(parts))
        try:
            head: list[tuple[bytes, bytes]] = [
                (b"content-type", answer.headers.get("content-type", "").encode("latin-1"))
            ]
            start = {"type": "http.response.start", "status": answer.status, "headers": head}
            if "content-length" in answer.headers:
                body = await answer.read()
                head.append((b"content-length", b"%d" % len(body)))
                await send(start)
                await send({"type": "http.response.body", "body": body})
                return
            await send(start)
            async for chunk in answer.iter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            answer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    args = parser.parse_args()
    options: dict[str, Any] = uvicorn_options("127.0.0.1", args.port, "warning", "text")
    uvicorn.run(PassthroughProxy(args.upstream), **options)


if __name__ == "__main__":
    main()
