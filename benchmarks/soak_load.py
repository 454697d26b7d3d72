"""The soak's load generator: an open-loop Poisson schedule split across worker processes.

One Python process could not hold the soak's rate on a 2-core machine (at 80 req/s it sat at
100% of a core, fell minutes behind its schedule and sent what it owed in bursts of hundreds),
so `generate` starts `workers` processes, each with an independent Poisson schedule of
rate / workers (together a Poisson schedule of the whole rate), its own aiohttp session (not
httpx: httpcore's pool costs CPU in proportion to its connections on every request) and one
shared clock: `time.monotonic()` is the system's monotonic clock, the same in every process.

Each worker records its lag (actual minus intended send time) and reports it per minute of
the schedule; `generate` merges the minutes, prints one line each when asked (so a reader can
see the rate was held), and merges every request's outcome at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import random
import statistics
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.queues import Queue

import aiohttp
import orjson
from faults import classify

MODEL = "sim-model"
SYSTEMS = [f"You are assistant number {i}. Answer briefly and stay on topic." for i in range(4)]
# Lag is reported per minute of the schedule (or per run, when shorter).
MINUTE = 60.0
# The workers' schedules start this long after `generate` is called, so the spawned
# processes' start-up (imports, session) is not counted as lag.
START_MARGIN = 3.0
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class Outcome:
    sent: float  # intended send time, seconds since the start of the run
    ended: float
    kind: str  # stream | plain | drop
    outcome: str  # complete | error | lost | disconnected
    code: str = ""


@dataclass
class Generated:
    outcomes: list[Outcome] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    # Per minute of the schedule: (minute, sent, lag p50, lag p99, lag max), seconds.
    minutes: list[tuple[int, int, float, float, float]] = field(default_factory=list)


def body_for(rng: random.Random, stream: bool, max_tokens: int) -> bytes:
    system = rng.choice(SYSTEMS)
    question = f"Question {rng.randrange(5000)}: tell me about rivers."
    return orjson.dumps(
        {
            "model": MODEL,
            "stream": stream,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
        }
    )


def plain_outcome(status: int, body: bytes) -> tuple[str, str]:
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "lost", ""
    if status == 200:
        return ("complete" if answer.get("choices") else "lost"), ""
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}:
        return "error", str(error["code"])
    return "lost", ""


def stream_code(body: bytes) -> str:
    """The `code` of a stream's final error event."""
    for event in reversed(body.split(b"\n\n")):
        if event.startswith(b"data: {"):
            with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError):
                return str(orjson.loads(event[6:])["error"]["code"])
            return ""
    return ""


async def one(
    session: aiohttp.ClientSession, url: str, kind: str, body: bytes, origin: float, sent: float
) -> Outcome:
    """One request; a `drop` leaves after its first chunk, which closes the connection (aiohttp
    does not reuse a connection whose body was not read to the end)."""
    try:
        async with session.post(url, data=body) as response:
            chunks = []
            async for chunk in response.content.iter_any():
                chunks.append(chunk)
                if kind == "drop" and response.status == 200:
                    return Outcome(sent, time.monotonic() - origin, kind, "disconnected")
            raw = b"".join(chunks)
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as error:
        return Outcome(sent, time.monotonic() - origin, kind, "lost", type(error).__name__)
    if kind == "plain":
        outcome, code = plain_outcome(status, raw)
    else:
        outcome = classify(status, raw)[0]
        code = stream_code(raw) if status == 200 else ""
        if status != 200 and outcome == "error":
            code = plain_outcome(status, raw)[1]
    return Outcome(sent, time.monotonic() - origin, kind, outcome, code)


def session_for(api_key: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60),
        headers={"authorization": f"Bearer {api_key}", "content-type": "application/json"},
    )


async def schedule(
    url: str, api_key: str, rate: float, seconds: float, seed: int, origin: float, report: Queue
) -> list[Outcome]:
    """One worker's open-loop Poisson arrivals for `seconds` from `origin`; puts each finished
    minute's lags on `report` as ("lag", minute, [seconds]); waits for every request to end.
    Traffic: 60% streamed chat, 25% non-streamed, 15% streams dropped after the first chunk."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    pending: set[asyncio.Task[Outcome]] = set()
    lags: list[float] = []
    minute = 0

    def done(task: asyncio.Task[Outcome]) -> None:
        pending.discard(task)
        outcomes.append(task.result())

    async with session_for(api_key) as session:
        at = rng.expovariate(rate)
        while at < seconds:
            await asyncio.sleep(max(0.0, origin + at - time.monotonic()))
            while at >= MINUTE * (minute + 1):
                report.put(("lag", minute, lags))
                lags, minute = [], minute + 1
            lags.append(time.monotonic() - origin - at)
            draw = rng.random()
            kind = "stream" if draw < 0.6 else "plain" if draw < 0.85 else "drop"
            body = body_for(rng, kind != "plain", rng.choice((16, 24, 32)))
            task = asyncio.create_task(one(session, url + CHAT, kind, body, origin, at))
            pending.add(task)
            task.add_done_callback(done)
            at += rng.expovariate(rate)
        for last in range(minute, minutes_in(seconds)):
            report.put(("lag", last, lags if last == minute else []))
        if pending:
            await asyncio.wait(set(pending))
    return outcomes


def work(
    url: str, api_key: str, rate: float, seconds: float, seed: int, origin: float, report: Queue
) -> None:
    """A worker process's body: its schedule, then ("done", outcomes as tuples) on `report`,
    or ("failed", traceback) so the parent never waits for a dead worker."""
    try:
        outcomes = asyncio.run(schedule(url, api_key, rate, seconds, seed, origin, report))
        report.put(("done", [(o.sent, o.ended, o.kind, o.outcome, o.code) for o in outcomes]))
    except BaseException:
        report.put(("failed", traceback.format_exc()))
        raise


def minutes_in(seconds: float) -> int:
    return max(1, math.ceil(seconds / MINUTE))


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def lag_line(minute: int, sent: int, span: float, ordered: list[float]) -> str:
    return (
        f"minute {minute + 1}: {sent} sent ({sent / span:.1f}/s); generator lag "
        f"p50 {1000 * percentile(ordered, 0.5):.1f} ms, p99 {1000 * percentile(ordered, 0.99):.1f}"
        f" ms, max {1000 * (ordered[-1] if ordered else 0.0):.1f} ms"
    )


async def generate(
    url: str,
    api_key: str,
    rate: float,
    seconds: float,
    seed: int,
    origin: float,
    workers: int,
    live: bool = False,
) -> Generated:
    """`rate` req/s for `seconds` from `origin` (a `time.monotonic()` value at least
    START_MARGIN ahead) across `workers` processes; returns when every request has ended.
    `live`: print each minute's lag line as soon as every worker has reported it."""
    context = multiprocessing.get_context("spawn")
    report: Queue = context.Queue()
    processes = [
        context.Process(
            target=work,
            args=(url, api_key, rate / workers, seconds, seed * 1000 + i, origin, report),
            daemon=True,
        )
        for i in range(workers)
    ]
    for process in processes:
        process.start()
    generated = Generated()
    by_minute: dict[int, list[float]] = {}
    reported: dict[int, int] = {}
    finished = 0
    try:
        while finished < workers:
            message = await asyncio.to_thread(report.get)
            if message[0] == "failed":
                raise RuntimeError(f"a load worker failed:\n{message[1]}")
            if message[0] == "done":
                generated.outcomes += [Outcome(*row) for row in message[1]]
                finished += 1
                continue
            _, minute, lags = message
            by_minute.setdefault(minute, []).extend(lags)
            reported[minute] = reported.get(minute, 0) + 1
            if reported[minute] == workers:
                ordered = sorted(by_minute.pop(minute))
                span = min(MINUTE, seconds - MINUTE * minute)
                generated.lag += ordered
                generated.minutes.append(
                    (
                        minute,
                        len(ordered),
                        percentile(ordered, 0.5),
                        percentile(ordered, 0.99),
                        ordered[-1] if ordered else 0.0,
                    )
                )
                if live:
                    print(lag_line(minute, len(ordered), span, ordered), flush=True)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
    generated.lag.sort()
    return generated


def lag_summary(generated: Generated) -> str:
    """Generator lag over the whole run and its worst minute, in ms."""
    ordered = generated.lag
    if not ordered:
        return "no requests sent"
    worst = max(generated.minutes, key=lambda m: m[3])
    mean = statistics.fmean(ordered)
    return (
        f"p50 {1000 * percentile(ordered, 0.5):.1f} ms, p99 {1000 * percentile(ordered, 0.99):.1f}"
        f" ms, max {1000 * ordered[-1]:.1f} ms, mean {1000 * mean:.1f} ms; worst minute "
        f"{worst[0] + 1} (p99 {1000 * worst[3]:.1f} ms)"
    )
