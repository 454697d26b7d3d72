"""A minimal, fast OpenAI-compatible upstream for gateway benchmarks (raw ASGI on uvicorn).

    .venv/bin/python benchmarks/fast_upstream.py --port 9001 [--chunks 10] [--gap-ms 2]
        [--answer-logprobs 500]

Routes: `POST /v1/chat/completions` (non-stream: a small JSON answer with usage, or with
`--answer-logprobs N` one of N tokens each with five top log-probabilities, about 300 bytes a
token, as vLLM answers `logprobs: true, top_logprobs: 5`; stream: N SSE
chunks then `data: [DONE]`), `GET /health`, `GET /v1/models` (model `bench-model`), `GET
/metrics` (a minimal vLLM-style exposition: requests in flight as `vllm:num_requests_running`,
nothing waiting, an empty KV cache, so the gateway's telemetry scraper sees a normal idle
engine and the benchmark measures its usual steady state). Every
stream chunk carries its send time in its id, `"id":"bench-<time.monotonic_ns()>"`, so a client
on the same host can compute each chunk's delivery delay (CLOCK_MONOTONIC is shared by all
processes on Linux). Stream shape can be overridden per request with the `x-bench-chunks` and
`x-bench-gap-ms` headers.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
import uvicorn

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MODEL = "bench-model"
STAMP_PREFIX = b'"id":"bench-'

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
COMPLETION = orjson.dumps(
    {
        "id": "bench-0",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
)


def logprobs_completion(tokens: int) -> bytes:
    """A chat answer of `tokens` tokens with five top log-probabilities each, usage last."""
    top = [{"token": f" a{j}", "logprob": -1.25 * j, "bytes": [32, 97, 48 + j]} for j in range(5)]
    content = [
        {"token": " tok", "logprob": -0.125, "bytes": [32, 116, 111, 107], "top_logprobs": top}
        for _ in range(tokens)
    ]
    message = {"role": "assistant", "content": " tok" * tokens}
    choice = {"index": 0, "message": message, "logprobs": {"content": content}}
    return orjson.dumps(
        {
            "id": "bench-0",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [choice | {"finish_reason": "length"}],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": tokens,
                "total_tokens": 8 + tokens,
            },
        }
    )


_MODELS = orjson.dumps(
    {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}],
    }
)
_CHUNK = (
    b'data: {"id":"bench-%d","object":"chat.completion.chunk","created":0,'
    b'"model":"' + MODEL.encode() + b'","choices":[{"index":0,'
    b'"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
)
_LAST = (
    b'data: {"id":"bench-%d","object":"chat.completion.chunk","created":0,'
    b'"model":"' + MODEL.encode() + b'","choices":[{"index":0,"delta":{},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":%d,'
    b'"total_tokens":%d}}\n\n'
)
_DONE = b"data: [DONE]\n\n"
_METRICS_LABELS = '{{model_name="' + MODEL + '"}}'  # braces doubled for str.format
_METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    "vllm:num_requests_running" + _METRICS_LABELS + " {running}\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting" + _METRICS_LABELS + " 0\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    "vllm:kv_cache_usage_perc" + _METRICS_LABELS + " 0.0\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{{block_size="16",num_gpu_blocks="65536"}} 1.0\n'
)
_PROMETHEUS = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]


class FastUpstream:
    """Raw ASGI app; `chunks` content events (the last carries usage), `gap` seconds apart;
    `answer`: the non-stream answer."""

    def __init__(self, chunks: int, gap: float, answer: bytes = COMPLETION) -> None:
        self.chunks = chunks
        self.gap = gap
        self.answer = answer
        self.inflight = 0

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/v1/chat/completions":
            body = await _read_body(receive)
            if body is None:  # the client went away mid-request
                return
            self.inflight += 1
            try:
                if orjson.loads(body).get("stream"):
                    chunks, gap = self._shape(scope["headers"])
                    await _stream(send, chunks, gap)
                else:
                    await _respond(send, 200, self.answer)
            finally:
                self.inflight -= 1
        elif path == "/health":
            await _respond(send, 200, b"{}")
        elif path == "/v1/models":
            await _respond(send, 200, _MODELS)
        elif path == "/metrics":
            await _respond(send, 200, _METRICS.format(running=self.inflight).encode(), _PROMETHEUS)
        else:
            await _respond(send, 404, b'{"error":{"message":"not found"}}')

    def _shape(self, headers: list[tuple[bytes, bytes]]) -> tuple[int, float]:
        chunks, gap = self.chunks, self.gap
        for name, value in headers:
            if name == b"x-bench-chunks":
                chunks = max(1, int(value))
            elif name == b"x-bench-gap-ms":
                gap = float(value) / 1000
        return chunks, gap


async def _read_body(receive: Receive) -> bytes | None:
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _respond(
    send: Send, status: int, body: bytes, content_type: list[tuple[bytes, bytes]] = _JSON
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*content_type, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _stream(send: Send, chunks: int, gap: float) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    for i in range(chunks):
        if i and gap:
            await asyncio.sleep(gap)
        if i == chunks - 1:
            event = _LAST % (time.monotonic_ns(), chunks, chunks + 8)
        else:
            event = _CHUNK % time.monotonic_ns()
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": _DONE, "more_body": False})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=10, help="content events per stream")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="gap between stream events")
    parser.add_argument(
        "--answer-logprobs",
        type=int,
        default=0,
        help="non-stream answers of this many tokens with log-probabilities (0: a small answer)",
    )
    args = parser.parse_args()
    answer = logprobs_completion(args.answer_logprobs) if args.answer_logprobs else COMPLETION
    uvicorn.run(
        FastUpstream(args.chunks, args.gap_ms / 1000, answer),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        server_header=False,
        date_header=False,
    )


if __name__ == "__main__":
    main()
