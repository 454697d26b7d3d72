"""Shared helpers for the simulator tests: request bodies and an SSE reader."""

import time
from typing import Any

import httpx
import orjson

LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog while the gateway routes requests to "
    "engines that share their prefix caches across many turns of a long conversation. "
)


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    """A chat completion body with one user message."""
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


async def read_stream(
    response: httpx.Response, started: float | None = None
) -> tuple[list[Any], float | None]:
    """Return the parsed `data:` payloads of an SSE response ("[DONE]" kept as a string)
    and the seconds from `started` (a perf_counter reading; default: now) until the first
    content token arrived."""
    started = time.perf_counter() if started is None else started
    events: list[Any] = []
    first_token: float | None = None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            events.append(data)
            continue
        payload = orjson.loads(data)
        events.append(payload)
        if first_token is None and content_of(payload):
            first_token = time.perf_counter() - started
    return events, first_token


def content_of(chunk: Any) -> str:
    """The text a chat or completion chunk carries ("" for role/usage chunks)."""
    if not isinstance(chunk, dict) or not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def streamed_text(events: list[Any]) -> str:
    """The concatenated text of a stream's chunks."""
    return "".join(content_of(event) for event in events)
