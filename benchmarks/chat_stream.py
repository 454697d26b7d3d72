"""The open-loop replays' client: one streamed chat completion, timed from its intended send.

`routing.py` and `replicas.py` send every request of a trace at its intended time and read
the stream as it comes: the first generated text (not the role-only event engines send first)
gives the time to first token, the usage event the prompt, cached and output tokens.

aiohttp, not httpx: on the ample-KV azure cell (34.8 req/s, hundreds of open streams) the httpx
client used 13.5-14 s of CPU per 35-second replay, fell behind its own schedule, and reported
180-190 first tokens over 2 s that the gateway had sent in time (it measured 20-47), in three
runs of four; this client used 2-3 s and its counts matched the gateway's in every run
(benchmarks/RESULTS.md, Routing). A client that cannot keep up measures itself, not the router.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import orjson

_JSON = {"content-type": "application/json"}


@dataclass(slots=True)
class Streamed:
    """What one streamed request showed the client. `ttft` is seconds from the intended send
    time; `error` is empty on success."""

    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    endpoint: str = ""
    explain: str = ""
    response_id: str = ""  # the answer's `id`
    error: str = ""


def client_session(base_url: str | None = None) -> aiohttp.ClientSession:
    """A session with no cap on connections (an open-loop client must never queue a send
    behind its own pool) and a 300 s limit per request."""
    return aiohttp.ClientSession(
        base_url,
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=300),
    )


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    intended: float,
    into: Streamed,
    headers: dict[str, str] | None = None,
) -> None:
    """POST `body` to `url` as a stream and fill `into` as the events arrive; times are from
    `intended` (the event loop's clock). A transport error or a non-200 answer is recorded in
    `into.error`, never raised."""
    loop = asyncio.get_running_loop()
    try:
        async with session.post(
            url, data=orjson.dumps(body), headers={**_JSON, **(headers or {})}
        ) as response:
            into.endpoint = response.headers.get("x-kvgate-endpoint", "")
            into.explain = response.headers.get("x-kvgate-route-explain", "")
            if response.status != 200:
                into.error = f"http {response.status}"
                await response.read()
                return
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                if not into.response_id:
                    into.response_id = event.get("id") or ""
                choices = event.get("choices") or [{}]
                if into.ttft is None and (choices[0].get("delta") or {}).get("content"):
                    into.ttft = loop.time() - intended
                usage = event.get("usage")
                if usage:
                    into.output_tokens = usage.get("completion_tokens", 0)
                    into.prompt_tokens = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    into.cached_tokens = details.get("cached_tokens") or 0
    except (aiohttp.ClientError, TimeoutError) as exc:
        into.error = type(exc).__name__
    if not into.error and into.ttft is None:
        into.error = "no token"
