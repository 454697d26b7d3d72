"""Open-loop HTTP/1.1 load generator on raw asyncio protocols (uvloop), for gateway benchmarks.

    .venv/bin/python benchmarks/loadgen.py --target direct=http://127.0.0.1:9001 \\
        --target gateway=http://127.0.0.1:8080 --rate 300 --duration 10 [--stream]

Requests fire at scheduled times whatever the answers do (Poisson arrivals by default, or
uniform); every latency is measured from the request's *intended* send time, so queueing in
the generator or the server shows up instead of being hidden. Each target gets a keep-alive
connection pool (TCP_NODELAY) that grows whenever a request is due and no connection is idle.
Targets run one after another in ABBA order (`--rounds`), each segment on the same arrival
schedule, so drift on a noisy machine cancels. Prints one JSON summary per target.

Streams: TTFT is the arrival of the first SSE data event; if the events carry a send stamp
(`"id":"bench-<monotonic ns>"`, see fast_upstream.py) the per-chunk delivery delay is
arrival - stamp. Send lag (when the scheduler fired the request - its intended time; waiting
for a free or new connection is not lag, it is the target's latency) shows the generator's own
limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import random
import socket
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import orjson
import uvloop
from fast_upstream import STAMP_PREFIX

MAX_CONNECTIONS = 4096
GRACE_SECONDS = 10.0
_NS = 1_000_000_000


@dataclass(slots=True)
class Sample:
    """One request's timeline, in time.monotonic_ns() units."""

    intended: int
    fired: int = 0
    status: int = 0
    first_event: int = 0
    done: int = 0
    error: str = ""
    chunk_delays: list[int] = field(default_factory=list)


class _ResponseParser:
    """Incremental HTTP/1.1 response parser (Content-Length or chunked) with an SSE scanner."""

    __slots__ = (
        "_buf",
        "_events",
        "_remaining",
        "_state",
        "keep_alive",
        "sample",
        "saw_done",
        "stream",
    )

    def __init__(self, sample: Sample, stream: bool) -> None:
        self.sample = sample
        self.stream = stream
        self.keep_alive = True
        self.saw_done = False
        self._buf = b""
        self._events = b""
        self._remaining = 0
        self._state = "head"

    def feed(self, data: bytes, now: int) -> bool:
        """Consume `data` that arrived at `now`; True once the response is complete."""
        self._buf += data
        while True:
            step = getattr(self, "_" + self._state)(now)
            if step is not None:
                return step

    def _head(self, now: int) -> bool | None:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = self._buf[:end].split(b"\r\n")
        self._buf = self._buf[end + 4 :]
        self.sample.status = int(lines[0][9:12])
        self._state = "length"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                self._remaining = int(value)
            elif name == b"transfer-encoding" and value == b"chunked":
                self._state = "size"
            elif name == b"connection" and value == b"close":
                self.keep_alive = False
        return None

    def _length(self, now: int) -> bool | None:
        self._body(self._take(), now)
        return self._remaining == 0

    def _size(self, now: int) -> bool | None:
        end = self._buf.find(b"\r\n")
        if end < 0:
            return False
        self._remaining = int(self._buf[:end].split(b";")[0], 16)
        self._buf = self._buf[end + 2 :]
        self._state = "data" if self._remaining else "trailer"
        return None

    def _data(self, now: int) -> bool | None:
        self._body(self._take(), now)
        if self._remaining:
            return False
        self._state = "crlf"
        return None

    def _crlf(self, now: int) -> bool | None:
        if len(self._buf) < 2:
            return False
        self._buf = self._buf[2:]
        self._state = "size"
        return None

    def _trailer(self, now: int) -> bool | None:
        end = self._buf.find(b"\r\n")
        if end < 0:
            return False
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        return True if not line else None

    def _take(self) -> bytes:
        part = self._buf[: self._remaining]
        self._buf = self._buf[len(part) :]
        self._remaining -= len(part)
        return part

    def _body(self, part: bytes, now: int) -> None:
        if not self.stream or not part:
            return
        events = (self._events + part).split(b"\n\n")
        self._events = events.pop()
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: int) -> None:
        if not event.startswith(b"data:"):
            return
        if event[5:].strip() == b"[DONE]":
            self.saw_done = True
            return
        if b'"error"' in event:
            self.sample.error = "error event"
        if not self.sample.first_event:
            self.sample.first_event = now
        at = event.find(STAMP_PREFIX)
        if at >= 0:
            start = at + len(STAMP_PREFIX)
            stamp = int(event[start : event.index(b'"', start)])
            self.sample.chunk_delays.append(now - stamp)


class _Connection(asyncio.Protocol):
    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser: _ResponseParser | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = cast(asyncio.Transport, transport)

    def start(self, sample: Sample) -> None:
        assert self.transport is not None
        self.parser = _ResponseParser(sample, self.pool.stream)
        self.transport.write(self.pool.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        parser = self.parser
        if parser is None:
            return
        try:
            complete = parser.feed(data, now)
        except ValueError:
            parser.sample.error = "malformed response"
            complete = True
        if not complete:
            return
        sample = parser.sample
        sample.done = now
        # Only a 200 stream must end with [DONE]; any other status is reported as "http N".
        if parser.stream and sample.status == 200 and not parser.saw_done and not sample.error:
            sample.error = "stream without [DONE]"
        self.parser = None
        self.pool.finished(self, sample, parser.keep_alive and sample.error == "")

    def connection_lost(self, exc: Exception | None) -> None:
        parser, self.parser = self.parser, None
        self.pool.lost(self, parser.sample if parser else None)


class ConnectionPool:
    """Keep-alive connections to one target; grows when a request is due and none is idle."""

    def __init__(self, url: str, body: bytes, stream: bool) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.stream = stream
        self.request = (
            f"POST {parts.path or '/v1/chat/completions'} HTTP/1.1\r\n"
            f"host: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.idle: list[_Connection] = []
        self.waiting: deque[Sample] = deque()
        self.connections: set[_Connection] = set()
        self.connecting = 0
        self.outstanding = 0
        self.drained = asyncio.Event()
        self.drained.set()
        self._tasks: set[asyncio.Task[None]] = set()

    def fire(self, sample: Sample) -> None:
        sample.fired = time.monotonic_ns()
        self.outstanding += 1
        self.drained.clear()
        if self.idle:
            self.idle.pop().start(sample)
        else:
            self.waiting.append(sample)
            self._grow()

    def finished(self, conn: _Connection, sample: Sample, reusable: bool) -> None:
        self._settle(sample)
        if reusable:
            self._next(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def lost(self, conn: _Connection, sample: Sample | None) -> None:
        self.connections.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)
        if sample is not None:
            sample.error = sample.error or "connection lost"
            self._settle(sample)
        self._grow()

    def close(self) -> None:
        for conn in list(self.connections):
            conn.parser = None
            if conn.transport is not None:
                conn.transport.close()
        self.waiting.clear()
        self.outstanding = 0
        self.drained.set()

    def _settle(self, sample: Sample) -> None:
        if not sample.done:
            sample.done = time.monotonic_ns()
        self.outstanding -= 1
        if self.outstanding <= 0:
            self.drained.set()

    def _next(self, conn: _Connection) -> None:
        if self.waiting:
            conn.start(self.waiting.popleft())
        else:
            self.idle.append(conn)

    def _grow(self) -> None:
        room = MAX_CONNECTIONS - len(self.connections) - self.connecting
        for _ in range(min(room, len(self.waiting) - self.connecting)):
            self.connecting += 1
            task = asyncio.get_running_loop().create_task(self._connect())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError as exc:
            self.connecting -= 1
            if self.waiting:
                sample = self.waiting.popleft()
                sample.error = f"connect: {exc.strerror or exc}"
                self._settle(sample)
            return
        self.connecting -= 1
        self.connections.add(conn)
        self._next(conn)


def arrival_offsets(rate: float, seconds: float, arrivals: str, seed: int) -> list[int]:
    """Intended send offsets in ns: Poisson (exponential gaps) or uniform spacing."""
    if arrivals == "uniform":
        return [round(i * _NS / rate) for i in range(int(rate * seconds))]
    rng = random.Random(seed)
    offsets: list[int] = []
    t = rng.expovariate(rate)
    while t < seconds:
        offsets.append(round(t * _NS))
        t += rng.expovariate(rate)
    return offsets


async def run_segment(pool: ConnectionPool, offsets: list[int]) -> list[Sample]:
    """Fire one request per offset at its intended time; wait (bounded) for every answer."""
    start = time.monotonic_ns() + 20_000_000
    samples = [Sample(intended=start + off) for off in offsets]
    for sample in samples:
        delay = sample.intended - time.monotonic_ns()
        if delay > 0:
            await asyncio.sleep(delay / _NS)
        pool.fire(sample)
    try:
        async with asyncio.timeout(GRACE_SECONDS):
            await pool.drained.wait()
    except TimeoutError:
        for sample in samples:
            if not sample.done:
                sample.error = "timeout"
        pool.close()
    return samples


def request_body(stream: bool, prompt_bytes: int = 0) -> bytes:
    """The chat request every segment sends; with `prompt_bytes`, a user message of about that
    many bytes of plain words (~4 bytes a token) instead of the short greeting."""
    content = "Say hello."
    if prompt_bytes > 0:
        words = " ".join(f"w{i % 9973}" for i in range(prompt_bytes // 5 + 1))
        content = words[:prompt_bytes]
    payload: dict[str, Any] = {
        "model": "bench-model",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": content}],
    }
    if stream:
        payload.update(stream=True, stream_options={"include_usage": True})
    return orjson.dumps(payload)


def percentiles(values: list[int], scale: float = 1e6) -> dict[str, float]:
    """Nearest-rank p50/p90/p99/p99.9/max of ns values, in ms (empty → {})."""
    if not values:
        return {}
    ordered = sorted(values)
    last = len(ordered) - 1
    out = {
        f"p{q:g}": ordered[min(last, int(q / 100 * len(ordered)))] / scale
        for q in (50, 90, 99, 99.9)
    }
    out["max"] = ordered[last] / scale
    return out


def summarize(samples: list[Sample], elapsed_ns: int, seconds: float) -> dict[str, Any]:
    """Percentiles in ms over `samples`, fired over `elapsed_ns` (first intended to last fired)
    of a `seconds`-long schedule."""
    ok = [s for s in samples if s.status == 200 and not s.error]
    failures = Counter(s.error or f"http {s.status}" for s in samples if s.status != 200 or s.error)
    fired = sum(1 for s in samples if s.fired)
    summary: dict[str, Any] = {
        "count": len(samples),
        "ok": len(ok),
        "failures": dict(failures),
        "target_rate": len(samples) / seconds if seconds else 0.0,
        "achieved_rate": fired * _NS / elapsed_ns if elapsed_ns else 0.0,
        "send_lag": percentiles([s.fired - s.intended for s in samples if s.fired]),
        "latency": percentiles([s.done - s.intended for s in ok]),
    }
    if any(s.first_event for s in ok):
        summary["ttft"] = percentiles([s.first_event - s.intended for s in ok])
        summary["chunk_delay"] = percentiles([d for s in ok for d in s.chunk_delays])
    return summary


def _send_span(samples: list[Sample]) -> int:
    """From the first intended send to the last fired one (ns); grows when firing falls behind."""
    fired = [s.fired for s in samples if s.fired]
    return max(fired) - samples[0].intended if fired else 0


async def run_plan(
    targets: dict[str, str],
    rate: float,
    duration: float,
    stream: bool,
    rounds: int = 2,
    warmup: float = 1.0,
    arrivals: str = "poisson",
    seed: int = 1,
    prompt_bytes: int = 0,
) -> dict[str, dict[str, Any]]:
    """ABBA...: `rounds` rounds over the targets, reversing the order every other round; each
    segment is `warmup` s (discarded) then `duration / rounds` s measured. Same schedule for
    every target within a round."""
    body = request_body(stream, prompt_bytes)
    pools = {name: ConnectionPool(url, body, stream) for name, url in targets.items()}
    measured: dict[str, list[Sample]] = {name: [] for name in targets}
    elapsed = dict.fromkeys(targets, 0)
    seconds = duration / rounds
    for r in range(rounds):
        offsets = arrival_offsets(rate, warmup + seconds, arrivals, seed + r)
        cut = sum(1 for off in offsets if off < warmup * _NS)
        order = list(targets) if r % 2 == 0 else list(reversed(targets))
        for name in order:
            gc.collect()
            gc.disable()
            try:
                samples = await run_segment(pools[name], offsets)
            finally:
                gc.enable()
            measured[name].extend(samples[cut:])
            elapsed[name] += _send_span(samples[cut:])
    for pool in pools.values():
        pool.close()
    return {name: summarize(samples, elapsed[name], duration) for name, samples in measured.items()}


def _target(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not url.startswith("http://"):
        raise argparse.ArgumentTypeError("expected NAME=http://HOST:PORT[/path]")
    return name, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target",
        type=_target,
        action="append",
        required=True,
        help="NAME=URL (repeat); default path /v1/chat/completions",
    )
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument(
        "--duration",
        type=float,
        default=10.0,
        help="measured seconds per target (split over the rounds)",
    )
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=1.0, help="discarded s per segment")
    parser.add_argument("--arrivals", choices=["poisson", "uniform"], default="poisson")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--prompt-bytes", type=int, default=0, help="long user message of about this many bytes"
    )
    args = parser.parse_args()
    result = uvloop.run(
        run_plan(
            dict(args.target),
            args.rate,
            args.duration,
            args.stream,
            args.rounds,
            args.warmup,
            args.arrivals,
            args.seed,
            args.prompt_bytes,
        )
    )
    sys.stdout.buffer.write(orjson.dumps(result) + b"\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
