"""Fault matrix: what clients see when engines fail, under steady open-loop load.

    .venv/bin/python benchmarks/faults.py [--rate 20] [--seconds 6] [--speed 4] [--output FILE]

A pool of 4 simulated engines (realistic profile, `--speed`) runs in this process (in its own
thread, so faults — `refuse` included — are set directly); the gateway runs as a separate
`kvgate serve` process, fresh for every scenario (fresh breakers, budgets and throttles).
Streamed chat requests arrive open loop (Poisson, `--rate` per second) through three phases:
`--seconds` healthy, `--seconds` with the fault, `--seconds` after it is cleared. Each
scenario reports:

- lost: accepted requests that ended with neither a complete answer ([DONE], no error) nor a
  well-formed OpenAI error (HTTP error body or final error event);
- wrong text: complete answers whose text differs from the engine's uninterrupted answer
  (the simulator is deterministic), i.e. duplicated or missing text;
- amplification: requests the engines received / requests sent (from /sim/stats);
- detect: seconds from the fault to the gateway's first reaction (breaker opened, throttle
  engaged, a retry dispatched or the health check marking an endpoint down, polled from
  /metrics every 100 ms);
- recover: seconds from clearing the fault to the first intended send time after which every
  request completed.

Then the bursts (issue 16): on a fresh pool of 3 (or 8) engines and a fresh gateway, round
robin, 30 (or 200) streamed requests sent at once while one engine resets connections before
its first byte, refuses them, or answers 503, and a 503 storm on every engine. Each reports
the outcomes as above, the HTTP statuses and the amplification (engine requests / sent). The
rows are named B1..B5, so `--only B` runs the bursts alone.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from services import BENCH_DIR, free_port, gateway, machine, this_command

sys.path.insert(0, str(BENCH_DIR.parent))
from kvgate.sim import EngineOptions, SimFleet

MODEL = "sim-model"
PROMPTS = [f"Tell me a story about river number {i}." for i in range(8)]
MAX_TOKENS = 24


@dataclass
class Scenario:
    name: str
    faults: dict[int, dict[str, Any]]
    criterion: str
    resume: bool = False
    gateway_yaml: str = ""
    disconnect_fraction: float = 0.0


SCENARIOS = [
    Scenario(
        "1 crash before first byte",
        {0: {"mode": "reset_before_first_byte"}},
        "retried elsewhere; lost = 0",
    ),
    Scenario(
        "2a crash mid-stream (default)",
        {0: {"mode": "crash_after_tokens", "tokens": 8}},
        "error event; lost = 0",
    ),
    Scenario(
        "2b crash mid-stream (resume)",
        {0: {"mode": "crash_after_tokens", "tokens": 8}},
        "text identical; lost = 0",
        resume=True,
    ),
    Scenario(
        "3a slow first token",
        {0: {"mode": "slow_first_token", "delay_ms": 5000}},
        "timeout, retry, traffic shifts away",
    ),
    Scenario(
        "3b stall after 4 tokens",
        {0: {"mode": "stall_after_tokens", "tokens": 4, "delay_ms": 5000}},
        "stall timeout: error event; lost = 0",
    ),
    Scenario(
        "4 5xx storm (all engines)",
        {i: {"mode": "http_error", "status": 503} for i in range(4)},
        "amplification <= 1.2; fast 503 + Retry-After",
    ),
    Scenario("5 connection refused", {0: {"mode": "refuse"}}, "retried at once; ejected"),
    Scenario(
        "6 malformed SSE",
        {0: {"mode": "malformed_sse", "tokens": 4}},
        "backend failure (error event), never garbage",
    ),
    Scenario(
        "7 client disconnect (30%)",
        {},
        "upstream aborted; no breaker opens",
        disconnect_fraction=0.3,
    ),
    Scenario(
        "8 429/503 with Retry-After",
        {
            0: {"mode": "http_error", "status": 429, "retry_after": 2},
            1: {"mode": "http_error", "status": 503, "retry_after": 2},
        },
        "honoured (held), budgeted; lost = 0",
    ),
]


@dataclass
class Burst:
    """Issue 16's burst: `at_once` streamed requests sent together to a fresh gateway over a
    fresh pool of `engines` (round robin) while `faulted` engines have `fault`."""

    name: str
    engines: int
    at_once: int
    fault: dict[str, Any]
    faulted: int
    criterion: str


BURSTS = [
    Burst(
        "B1 burst, 1 of 3 resets before first byte",
        3,
        30,
        {"mode": "reset_before_first_byte"},
        1,
        "lost = 0, every answer complete",
    ),
    Burst(
        "B2 burst, 1 of 3 refuses connections",
        3,
        30,
        {"mode": "refuse"},
        1,
        "lost = 0, every answer complete",
    ),
    Burst(
        "B3 burst, 1 of 3 answers 503",
        3,
        30,
        {"mode": "http_error", "status": 503},
        1,
        "lost = 0, every answer complete",
    ),
    Burst(
        "B4 burst, 1 of 8 resets, 200 at once",
        8,
        200,
        {"mode": "reset_before_first_byte"},
        1,
        "lost = 0, every answer complete",
    ),
    Burst(
        "B5 burst, 503 storm on all 3",
        3,
        60,
        {"mode": "http_error", "status": 503},
        3,
        "fast 503s; amplification <= 1.1",
    ),
]


@dataclass
class Sample:
    intended: float
    prompt: int
    outcome: str = "pending"  # complete | error | lost | disconnected
    text: str = ""
    status: int = 0
    retry_after: bool = False


@dataclass
class Report:
    scenario: Scenario
    samples: list[Sample] = field(default_factory=list)
    received: int = 0
    detect: float | None = None
    recover: float | None = None
    aborted: int = 0
    opened: int = 0


def gateway_yaml(port: int, urls: list[str], resume: bool) -> str:
    endpoints = "\n".join(f'      - {{url: "{u}"}}' for u in urls)
    return f"""server: {{host: 127.0.0.1, port: {port}, access_log: false}}
auth: none
timeouts: {{first_token: 1.0, stall: 1.0, total: 30}}
health: {{interval: 1.0}}
pools:
  - name: sim
    engine: vllm
    models: [{MODEL}]
    policy: round_robin
    resume: {str(resume).lower()}
    endpoints:
{endpoints}
resilience:
  breaker: {{base_ejection: 5, max_ejection: 30, probe_timeout: 2}}
  throttle: {{window: 5, min_requests: 20}}
"""


def classify(response_status: int, body: bytes) -> tuple[str, str]:
    if response_status != 200:
        try:
            error = orjson.loads(body)["error"]
            ok = set(error) == {"message", "type", "param", "code"}
        except (orjson.JSONDecodeError, KeyError, TypeError):
            ok = False
        return ("error" if ok else "lost"), ""
    text: list[str] = []
    events = [e for e in body.split(b"\n\n") if e.strip()]
    for index, event in enumerate(events):
        if not event.startswith(b"data: "):
            return "lost", "".join(text)
        data = event[6:]
        last = index == len(events) - 1
        if data == b"[DONE]":
            return ("complete" if last else "lost"), "".join(text)
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "lost", "".join(text)
        if "error" in chunk:
            ok = last and set(chunk["error"]) == {"message", "type", "param", "code"}
            return ("error" if ok else "lost"), "".join(text)
        for choice in chunk.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "lost", "".join(text)


def body_for(prompt: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": PROMPTS[prompt]}],
    }


async def one(
    client: httpx.AsyncClient, url: str, sample: Sample, origin: float, disconnect: bool
) -> None:
    await asyncio.sleep(max(0.0, origin + sample.intended - time.monotonic()))
    try:
        async with client.stream("POST", url, json=body_for(sample.prompt)) as response:
            sample.status = response.status_code
            sample.retry_after = "retry-after" in response.headers
            chunks = []
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                if disconnect:
                    sample.outcome = "disconnected"
                    return
            sample.outcome, sample.text = classify(response.status_code, b"".join(chunks))
    except httpx.HTTPError:
        sample.outcome = "lost"


def counters(metrics: str) -> float:
    """Sum of the gateway's reactions: retries, throttling, breakers opened, endpoints the
    health check marked down."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("kvgate_endpoint_healthy{") and line.endswith(" 0.0"):
            total += 1
        elif (
            line.startswith("kvgate_throttled_attempts_total")
            or line.startswith("kvgate_retries_total")
            or (line.startswith("kvgate_breaker_transitions_total") and 'to_state="open"' in line)
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def opened(metrics: str) -> int:
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kvgate_breaker_transitions_total") and 'to_state="open"' in line
        )
    )


async def watch(
    client: httpx.AsyncClient,
    url: str,
    origin: float,
    fault_at: float,
    report: Report,
    stop: asyncio.Event,
) -> None:
    baseline: float | None = None
    while not stop.is_set():
        try:
            value = counters((await client.get(url + "/metrics")).text)
        except httpx.HTTPError:
            value = None
        now = time.monotonic() - origin
        if value is not None:
            if now < fault_at:
                baseline = value
            elif report.detect is None and baseline is not None and value > baseline:
                report.detect = now - fault_at
        await asyncio.sleep(0.1)


async def run_scenario(
    scenario: Scenario, fleet: SimFleet, args: argparse.Namespace, workdir: Path
) -> Report:
    port = free_port()
    config = workdir / "gateway.yaml"
    config.write_text(gateway_yaml(port, fleet.urls, scenario.resume))
    report = Report(scenario)
    rng = random.Random(7)
    duration = 3 * args.seconds
    at = rng.expovariate(args.rate)
    while at < duration:
        report.samples.append(Sample(at, rng.randrange(len(PROMPTS))))
        at += rng.expovariate(args.rate)
    url = f"http://127.0.0.1:{port}"
    with gateway(config, port):
        before = sum(e.stats()["requests_received"] for e in fleet.engines)
        aborted = sum(e.stats()["requests_aborted"] for e in fleet.engines)
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            origin = time.monotonic()
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(client, url, origin, args.seconds, report, stop))
            loop = asyncio.get_running_loop()

            def set_faults() -> None:
                for index, fault in scenario.faults.items():
                    fleet.engines[index].set_fault(fault)

            def clear_faults() -> None:
                for index in scenario.faults:
                    fleet.engines[index].clear_fault()

            fault_timer = loop.call_at(
                loop.time() + args.seconds, lambda: loop.run_in_executor(None, set_faults)
            )
            clear_timer = loop.call_at(
                loop.time() + 2 * args.seconds, lambda: loop.run_in_executor(None, clear_faults)
            )
            try:
                await asyncio.gather(
                    *(
                        one(
                            client,
                            url + "/v1/chat/completions",
                            s,
                            origin,
                            rng.random() < scenario.disconnect_fraction,
                        )
                        for s in report.samples
                    )
                )
            finally:
                fault_timer.cancel()
                clear_timer.cancel()
                await asyncio.sleep(0.5)
                clear_faults()
                stop.set()
                await watcher
            report.opened = opened((await client.get(url + "/metrics")).text)
        report.received = sum(e.stats()["requests_received"] for e in fleet.engines) - before
        report.aborted = sum(e.stats()["requests_aborted"] for e in fleet.engines) - aborted
    cleared = 2 * args.seconds
    bad = [
        s.intended
        for s in report.samples
        if s.intended >= cleared and s.outcome not in ("complete", "disconnected")
    ]
    report.recover = (max(bad) - cleared) if bad else 0.0
    return report


async def references(fleet: SimFleet) -> list[str]:
    async with httpx.AsyncClient(timeout=30) as client:
        texts = []
        for i in range(len(PROMPTS)):
            answer = (
                await client.post(
                    fleet.urls[0] + "/v1/chat/completions", json={**body_for(i), "stream": False}
                )
            ).json()
            texts.append(answer["choices"][0]["message"]["content"])
        return texts


def row(report: Report, expected: list[str]) -> str:
    samples = report.samples
    sent = len(samples)
    counts = {
        k: sum(s.outcome == k for s in samples)
        for k in ("complete", "error", "lost", "disconnected")
    }
    wrong = sum(1 for s in samples if s.outcome == "complete" and s.text != expected[s.prompt])
    errors = [s for s in samples if s.outcome == "error" and s.status != 200]
    with_retry_after = sum(s.retry_after for s in errors)
    detect = f"{report.detect:.2f}" if report.detect is not None else "-"
    recover = f"{report.recover:.2f}" if report.recover is not None else "-"
    http_errors = f"{len(errors)} ({with_retry_after} w/ Retry-After)"
    return (
        f"| {report.scenario.name} | {sent} | {counts['complete']} | {counts['error']} | "
        f"{http_errors} | {counts['lost']} | {wrong} | {report.received / sent:.2f} | "
        f"{report.opened} | {report.aborted} | {detect} | {recover} | "
        f"{report.scenario.criterion} |"
    )


async def run_burst(burst: Burst, speed: float, workdir: Path) -> str:
    """One burst on its own fleet and gateway; its table row."""
    options = EngineOptions(profile="realistic", speed=speed)
    with SimFleet.in_thread(engines=burst.engines, options=options) as fleet:
        expected = await references(fleet)
        port = free_port()
        config = workdir / "gateway.yaml"
        config.write_text(gateway_yaml(port, fleet.urls, resume=False))
        with gateway(config, port):
            for index in range(burst.faulted):
                fleet.engines[index].set_fault(burst.fault)
            before = sum(e.stats()["requests_received"] for e in fleet.engines)
            samples = [Sample(0.0, i % len(PROMPTS)) for i in range(burst.at_once)]
            limits = httpx.Limits(max_connections=burst.at_once)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                origin = time.monotonic()
                await asyncio.gather(*(one(client, url, s, origin, False) for s in samples))
            received = sum(e.stats()["requests_received"] for e in fleet.engines) - before
            for index in range(burst.faulted):
                fleet.engines[index].clear_fault()
    counts = {k: sum(s.outcome == k for s in samples) for k in ("complete", "error", "lost")}
    wrong = sum(1 for s in samples if s.outcome == "complete" and s.text != expected[s.prompt])
    statuses = ", ".join(
        f"{status}: {sum(s.status == status for s in samples)}"
        for status in sorted({s.status for s in samples})
    )
    return (
        f"| {burst.name} | {burst.engines} | {burst.at_once} | {counts['complete']} | "
        f"{counts['error']} | {statuses} | {counts['lost']} | {wrong} | "
        f"{received / burst.at_once:.2f} | {burst.criterion} |"
    )


async def bursts_table(args: argparse.Namespace) -> str:
    lines = [
        "| burst | engines | at once | complete | error | HTTP status: count | lost | "
        "wrong text | amplification | criterion |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for burst in BURSTS:
            if args.only and not burst.name.startswith(args.only):
                continue
            lines.append(await run_burst(burst, args.speed, Path(tmp)))
            print(lines[-1], flush=True)
    return "\n".join(lines)


async def matrix_table(args: argparse.Namespace) -> str:
    options = EngineOptions(profile="realistic", speed=args.speed)
    lines = [
        "| scenario | sent | complete | error | of which HTTP errors | lost | wrong text | "
        "amplification | breakers opened | upstream aborted | detect s | recover s | "
        "criterion |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with (
        SimFleet.in_thread(engines=4, options=options) as fleet,
        tempfile.TemporaryDirectory() as tmp,
    ):
        expected = await references(fleet)
        for scenario in SCENARIOS:
            if args.only and not scenario.name.startswith(args.only):
                continue
            report = await run_scenario(scenario, fleet, args, Path(tmp))
            lines.append(row(report, expected))
            print(lines[-1], flush=True)
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> tuple[str, str]:
    """The matrix and the bursts tables (empty when `--only` selects none of their rows)."""
    wanted = [s for s in SCENARIOS if s.name.startswith(args.only)]
    matrix = await matrix_table(args) if wanted else ""
    wanted_bursts = [b for b in BURSTS if b.name.startswith(args.only)]
    bursts = await bursts_table(args) if wanted_bursts else ""
    return matrix, bursts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each phase")
    parser.add_argument("--speed", type=float, default=4.0, help="simulator speed factor")
    parser.add_argument("--only", default="", help="run the scenarios whose name starts so")
    parser.add_argument("--output", type=Path, help="append the results section to FILE")
    args = parser.parse_args()
    matrix, bursts = asyncio.run(main_async(args))
    command = this_command()
    section = (
        f"\n## Fault matrix ({datetime.date.today().isoformat()})\n\n"
        f"Machine: {machine()}. Command: {command}.\n"
    )
    if matrix:
        section += (
            f"\nPool of 4 simulated engines (realistic, speed {args.speed}), {args.rate:g} req/s "
            f"open loop, streamed chat ({MAX_TOKENS} tokens), phases of {args.seconds:g} s: "
            "healthy, faulted, cleared.\n\n" + matrix + "\n"
        )
    if bursts:
        section += (
            f"\nBursts: streamed chat ({MAX_TOKENS} tokens), all requests sent at once to a "
            f"fresh gateway (round robin) over a fresh pool (realistic, speed {args.speed}), "
            "the fault already on.\n\n" + bursts + "\n"
        )
    print(section)
    if args.output:
        with args.output.open("a") as out:
            out.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
