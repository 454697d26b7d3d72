"""A scripted OpenAI-compatible upstream for proxy tests: exact timing and failures on demand.

Unlike the simulator it models no engine; it does exactly what a test scripts, and records what
reached it (headers, bodies) and when a client went away.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class Script:
    """What the upstream does with the next requests."""

    chunks: int = 3
    gap: float = 0.0
    status: int = 200
    error_body: bytes | None = None
    headers_delay: float = 0.0
    close_after_chunks: int | None = None
    hang: bool = False
    content_type: bytes = b"text/event-stream"
    answer_body: bytes | None = None  # a non-stream answer's bytes, instead of a built one
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    # A stream's error event after this many chunks, as vLLM sends one (then `[DONE]`).
    error_event_after: int | None = None
    # Bytes of content each streamed chunk carries besides its token (a large event).
    padding: int = 0
    # Send the whole stream in one write, so that the gateway reads its events together.
    one_write: bool = False
    # A stream's bytes, sent as they are in one write, instead of built chunks.
    stream_body: bytes | None = None


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    client: tuple[str, int] | None = None  # the peer address: one per connection
    raw: bytes = b""  # the body's bytes as they arrived


class ScriptedUpstream:
    def __init__(self, models: tuple[str, ...] = ("m1",), healthy: bool = True) -> None:
        self.models = list(models)
        self.healthy = healthy
        self.script = Script()
        self.received: list[Received] = []
        self.disconnects: list[float] = []
        self.disconnected = threading.Event()

    @property
    def inference_requests(self) -> list[Received]:
        return [r for r in self.received if r.path.startswith("/v1/") and r.path != "/v1/models"]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                done = (
                    message["type"]
                    .replace(".startup", ".startup.complete")
                    .replace(".shutdown", ".shutdown.complete")
                )
                await send({"type": done})
                if message["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/health":
            await _reply(send, 200 if self.healthy else 503, b"")
            return
        if path == "/metrics":  # an engine without Prometheus metrics
            await _reply(send, 404, b"")
            return
        if path == "/v1/models":
            data = [{"id": m, "object": "model"} for m in self.models]
            await _reply(send, 200, orjson.dumps({"object": "list", "data": data}))
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        payload = orjson.loads(body) if body else {}
        self.received.append(Received(path, headers, payload, scope.get("client"), body))
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await self._answer(send, payload, path)
        finally:
            watcher.cancel()

    async def _watch(self, receive: Any) -> None:
        message = await receive()
        if message["type"] == "http.disconnect":
            self.disconnects.append(time.monotonic())
            self.disconnected.set()

    async def _answer(self, send: Any, payload: dict[str, Any], path: str) -> None:
        script = self.script
        if script.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(script.headers_delay)
        if script.status != 200:
            body = script.error_body or orjson.dumps(
                {
                    "error": {
                        "message": "scripted failure",
                        "type": "BadRequestError",
                        "param": None,
                        "code": script.status,
                    }
                }
            )
            await _reply(send, script.status, body, script.extra_headers)
            return
        if not payload.get("stream") or path == "/v1/embeddings":  # vLLM ignores it there
            body = script.answer_body or orjson.dumps(_completion(payload))
            await _reply(send, 200, body, script.extra_headers)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", script.content_type), *script.extra_headers],
            }
        )
        if script.stream_body is not None:
            await send({"type": "http.response.body", "body": script.stream_body})
            return
        written: list[bytes] = []

        async def write(body: bytes) -> None:
            if script.one_write:
                written.append(body)
            else:
                await send({"type": "http.response.body", "more_body": True, "body": body})

        for i in range(script.chunks):
            if script.close_after_chunks is not None and i == script.close_after_chunks:
                raise RuntimeError("scripted mid-stream crash")
            if i and script.gap:
                await asyncio.sleep(script.gap)
            if i == script.error_event_after:
                await write(_VLLM_ERROR)
                break
            chunk = {
                "id": "cmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": payload.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": f"tok{i} " + "x" * script.padding},
                        "finish_reason": "stop" if i == script.chunks - 1 else None,
                    }
                ],
            }
            await write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        options = payload.get("stream_options")
        # As vLLM and SGLang read it: a `stream_options` object asks for usage by default.
        if isinstance(options, dict) and options.get("include_usage", True):
            usage = {
                "id": "cmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": payload.get("model"),
                "choices": [],
                "usage": {
                    "prompt_tokens": 5,
                    "completion_tokens": script.chunks,
                    "total_tokens": 5 + script.chunks,
                },
            }
            await write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await send({"type": "http.response.body", "body": b"".join(written) + b"data: [DONE]\n\n"})


def _completion(payload: dict[str, Any]) -> dict[str, Any]:
    if "input" in payload:
        return {
            "object": "list",
            "model": payload["model"],
            "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
            "usage": {"prompt_tokens": 2, "total_tokens": 2},
        }
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    if "prompt" in payload:
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": payload["model"],
            "choices": [{"index": 0, "text": "hello", "finish_reason": "stop", "logprobs": None}],
            "usage": usage,
        }
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": payload["model"],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello"},
                "finish_reason": "stop",
            }
        ],
        "usage": usage,
    }


async def _reply(
    send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


# The usage of `chat_answer`'s answers.
USAGE = {
    "prompt_tokens": 812,
    "total_tokens": 1312,
    "completion_tokens": 500,
    "prompt_tokens_details": {"cached_tokens": 640},
}


def chat_answer(
    content: str, usage: Any = USAGE, logprobs: int = 0, model: str = "served-model", **after: Any
) -> bytes:
    """A vLLM-shaped non-stream chat answer: `logprobs` tokens with five top log-probabilities
    each, `usage` after the choices, `after` after `usage`."""
    tokens = [
        {
            "token": f"t{i}",
            "logprob": -0.25 * i,
            "bytes": [116, 48 + i % 10],
            "top_logprobs": [
                {"token": f"a{j}", "logprob": -1.5 * j, "bytes": [97]} for j in range(5)
            ],
        }
        for i in range(logprobs)
    ]
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": {"content": tokens} if tokens else None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage,
        **after,
    }
    return orjson.dumps(body)


# What vLLM streams when a request fails after its stream started (its own vocabulary: the
# exception's name as the type, the HTTP status as the code), before `[DONE]`.
_VLLM_ERROR = (
    b'data: {"error": {"message": "scripted failure mid-stream", "type": "BadRequestError", '
    b'"param": null, "code": 400}}\n\n'
)
