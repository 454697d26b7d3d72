"""Memory per open stream: hold many idle streams open through a gateway and read its RSS.

Used by overhead.py against an upstream that sends its first event at once and then one event
every few hundred ms (fast_upstream.py with a long gap), so every stream is committed and
relaying, yet nearly idle. The RSS delta counts everything a held stream costs the gateway:
its client and upstream connections, buffers, tasks and per-request state.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from urllib.parse import urlsplit

from loadgen import request_body
from services import rss_bytes

CONNECT_CONCURRENCY = 64
WARMUP_STREAMS = 100


@dataclass(frozen=True)
class HeldStreams:
    wanted: int
    held: int
    rss_before: int
    rss_held: int

    @property
    def mb_per_thousand(self) -> float:
        return (self.rss_held - self.rss_before) / 2**20 * 1000 / max(1, self.held)


async def _open_stream(
    host: str, port: int, request: bytes, gate: asyncio.Semaphore, patience: float
) -> asyncio.StreamWriter | None:
    """A connection whose stream has delivered its first event (None if it did not in time)."""
    async with gate:
        writer = None
        try:
            async with asyncio.timeout(patience):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise ValueError(head[:40])
                await reader.readuntil(b"data:")
            return writer
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
            if writer is not None:
                writer.close()
            return None


async def _hold(url: str, count: int, patience: float) -> list[asyncio.StreamWriter]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = request_body(stream=True)
    request = (
        f"POST {parts.path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
    opened = await asyncio.gather(
        *(_open_stream(host, port, request, gate, patience) for _ in range(count))
    )
    return [w for w in opened if w is not None]


async def _release(writers: list[asyncio.StreamWriter]) -> None:
    for writer in writers:
        writer.close()
    for writer in writers:
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def measure(url: str, pid: int, count: int, patience: float = 30.0) -> HeldStreams:
    """Open `count` streams to `url` (served by process `pid`), read its RSS while all are
    held, then close them. A first batch of streams, opened and closed, warms the process up."""
    await _release(await _hold(url, WARMUP_STREAMS, patience))
    await asyncio.sleep(1.0)
    before = rss_bytes(pid)
    writers = await _hold(url, count, patience)
    await asyncio.sleep(1.0)  # the gateway relays a few more events on every stream
    held = 0
    for _ in range(3):
        held = max(held, rss_bytes(pid))
        await asyncio.sleep(0.2)
    await _release(writers)
    return HeldStreams(count, len(writers), before, held)
