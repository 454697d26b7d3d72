"""Routing quality: kvgate's policies beside round-robin, least-loaded and sglang-router's
cache-aware policy, each on a fresh simulated fleet with the same open-loop arrivals, at loads
the benchmark finds itself, beside the cache hit rates no router can beat.

    .venv/bin/python benchmarks/routing.py                   # everything, logged in history/
    .venv/bin/python benchmarks/routing.py --workloads azure,mooncake --loads 3x --no-micro
    .venv/bin/python benchmarks/routing.py --workloads shared --rates shared=12,56 \\
        --routers kvgate,round_robin --repeats 3
    .venv/bin/python benchmarks/routing.py --micro           # decision-cost microbenchmark only

Loads, per workload (workloads.py): `light` (the workload's `--light` rate; round-robin's TTFT
p90 there is the unloaded reference) and `3x` / `10x`, the rates at which round-robin's TTFT
p90 is 3 and 10 times that reference. A short search on round-robin finds them, printing every
probe: double the rate until the p90 passes the highest multiple asked for, then interpolate
log p90 against log rate and probe the estimate, at most `--search-probes` times per target,
keeping the probe closest to it above the lower target's rate (a probe within 25% ends the
search). Near overload round-robin's p90 climbs steeply with the rate, so the 10x rate is found
less precisely than the 3x one (every probe is printed). `--rates` gives the rates
instead. So a figure means the same on any machine: "where round-robin is 3x slower than
unloaded".

Every cell (workload x load x router) starts a fresh simulated fleet (realistic profile,
`--speed`, identical and cold) and the router in front of it, replays the workload open loop
(latency from each request's intended send time), then reads the engines' counters. The
round-robin cell at a searched load is the search's own probe at that rate (same requests,
fresh fleet). `--repeats N` runs each cell N times and reports the median of each figure
(failures: the sum). Routers: `random`, `round_robin`, `least_loaded` and `kvgate` are pool
policies of `kvgate serve`; `precise` is the `kvgate` policy routing on the engines' KV events
(the fleet started with `--kv-events`, the pool with the sim tokenizer); `sglang` is
sglang-router with `--policy cache_aware`
(peer_router.py). Ideals per workload and load (cache_ideals.py): the infinite-cache hit rate
and that of one LRU cache with the fleet's whole KV memory (engines x `--kv-blocks` x 16
tokens); each router's hit (cached_tokens over prompt tokens) is shown as a fraction of the
latter too. The TTFT floor per workload (cache_ideals.py): the p50 / p90 of each request's own
prefill of what the infinite cache misses, alone on an engine; no schedule goes below it, so a
target under it cannot be met. Beside it, what two idealised schedules of that same work would
give (schedule_estimates.py): every engine always on the requests with the least work left,
across the fleet (shortest first: what a gateway holding requests and releasing the shortest
first could at best approach), and least-work dispatch to engines that serve in arrival order.

With two or more CPUs the simulated fleet runs alone on the last one and the router and the
client share the others (`--no-pin`: everything shares every CPU), so that what a router spends
on CPU does not slow the engines it is measured on, as on a real fleet whose GPUs do not share
the gateway's cores. Simulator lag (event-loop oversleep in the fleet process) shows a
CPU-bound run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import cost_model_error
import decision_cost
import httpx
import peer_router
import precise_cost
import routing_report
import ttft_breakdown
from cache_ideals import CacheIdeals, cache_ideals
from chat_stream import Streamed, client_session, stream_chat
from routing_report import SLOW_TTFT_SECONDS, Row
from schedule_estimates import ScheduleEstimates, estimates
from services import (
    BENCH_DIR,
    PYTHON,
    append_results,
    free_port,
    gateway,
    machine,
    metric_samples,
    stop,
    this_command,
    wait_ready,
)
from workloads import MODEL, TRACE_OF, WORKLOADS, Planned, add_arguments

GATEWAY_POLICIES = ("random", "round_robin", "least_loaded", "kvgate")
# kvgate's policy routing on the engines' KV events (the simulator's `--kv-events`).
PRECISE = "precise"
ROUTERS = (*GATEWAY_POLICIES, PRECISE, peer_router.NAME)
LOADS = {"light": 1.0, "3x": 3.0, "10x": 10.0}
# Rates far under the fleet's capacity on each workload (the unloaded reference).
DEFAULT_LIGHT = "shared=12;sessions=12;mooncake=8;azure=10;agents=8"
# A probe whose p90 is within this factor of the target ends the search for it.
SEARCH_TOLERANCE = 1.25


# --- processes -----------------------------------------------------------------------------


def sim_cpus() -> tuple[set[int], set[int]]:
    """(the simulated fleet's CPUs, everyone else's): the last CPU this process may use for the
    fleet, the others for the router under test and the client. Empty sets with fewer than 2."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return set(), set()
    return {cpus[-1]}, set(cpus[:-1])


def serve_sim(args: argparse.Namespace) -> None:
    """Child process: a simulated fleet plus an event-loop lag probe written at exit."""
    from kvgate.sim import EngineOptions, SimFleet

    if args.pin_sim:
        os.sched_setaffinity(0, {int(cpu) for cpu in args.pin_sim.split(",")})

    async def main() -> list[float]:
        options = EngineOptions(
            profile="realistic",
            speed=args.speed,
            kv_blocks=args.kv_blocks,
            max_num_seqs=args.max_num_seqs,
            kv_events=args.kv_events,
            flavor=args.flavor,
        )
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, done.set)
        lags: list[float] = []
        async with SimFleet(args.engines, 0, options) as fleet:
            print(" ".join(fleet.urls), flush=True)
            events = [e.kv_events for e in fleet.engines]
            print(" ".join(f"{e.url},{e.replay_url}" for e in events if e is not None), flush=True)
            while not done.is_set():
                before = loop.time()
                await asyncio.sleep(0.02)
                lags.append(loop.time() - before - 0.02)
        return lags

    import uvloop

    lags = sorted(uvloop.run(main()))
    Path(args.lag_file).write_text(
        json.dumps(
            {
                "p50_ms": 1000 * lags[len(lags) // 2] if lags else 0,
                "p99_ms": 1000 * lags[int(len(lags) * 0.99)] if lags else 0,
            }
        )
    )


@contextlib.contextmanager
def sim_fleet(
    args: argparse.Namespace, lag_file: Path, kv_events: bool = False, flavor: str = "vllm"
) -> Iterator[tuple[list[str], list[str]]]:
    """The fleet's URLs and, with `kv_events`, each engine's "pub,replay" event sockets;
    `flavor`: the engines the simulator imitates."""
    proc = subprocess.Popen(
        [
            PYTHON,
            __file__,
            "--serve-sim",
            "--engines",
            str(args.engines),
            "--speed",
            str(args.speed),
            "--kv-blocks",
            str(args.kv_blocks),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--flavor",
            flavor,
            "--lag-file",
            str(lag_file),
            *(["--kv-events"] if kv_events else []),
            *(["--pin-sim", ",".join(map(str, args.sim_cpus))] if args.sim_cpus else []),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        urls = proc.stdout.readline().split()
        events = proc.stdout.readline().split()
        if len(urls) != args.engines:
            raise RuntimeError("the simulated fleet did not start")
        for url in urls:
            wait_ready(proc, int(url.rsplit(":", 1)[1]), "/health")
        yield urls, events
    finally:
        stop(proc)


def gateway_yaml(
    port: int,
    urls: list[str],
    policy: str,
    events: list[str] | None = None,
    explain: bool = False,
    max_kv_usage: float | None = None,
    engine: str = "vllm",
) -> str:
    """`events`: "pub,replay" per endpoint for precise routing (the sim tokenizer);
    `explain`: answer `x-kvgate-explain: 1` from anyone; `max_kv_usage`: the KV use above
    which an engine counts as saturated (`routing.saturation`; None: kvgate's default);
    `engine`: the pool's engine kind (the simulator's flavor)."""
    entries = []
    for i, url in enumerate(urls):
        if events:
            pub, replay = events[i].split(",")
            entries.append(f'{{url: "{url}", kv_events: {{url: "{pub}", replay_url: "{replay}"}}}}')
        else:
            entries.append(f'{{url: "{url}"}}')
    endpoints = ", ".join(entries)
    tokenizer = ", tokenizer: {kind: sim}" if events else ""
    routing = ["explain: always"] if explain else []
    if max_kv_usage is not None:
        routing.append(f"saturation: {{max_kv_usage: {max_kv_usage}}}")
    return (
        f"server: {{host: 127.0.0.1, port: {port}, access_log: false}}\n"
        "auth: none\n"
        f"pools:\n  - {{name: sim, engine: {engine}, models: [{MODEL}], policy: {policy}, "
        f"endpoints: [{endpoints}]{tokenizer}}}\n"
        + (f"routing: {{{', '.join(routing)}}}\n" if routing else "")
    )


@contextlib.contextmanager
def front(
    args: argparse.Namespace, router: str, urls: list[str], workdir: Path, events: list[str]
) -> Iterator[str]:
    """The router under test in front of the fleet at `urls`; yields its base URL."""
    if router == peer_router.NAME:
        with peer_router.sglang_router(urls, workdir) as base:
            yield base
        return
    port = free_port()
    config = workdir / "gateway.yaml"
    policy, published = ("kvgate", events) if router == PRECISE else (router, None)
    config.write_text(
        gateway_yaml(port, urls, policy, published, args.cost_model, args.max_kv_usage, args.flavor)
    )
    with gateway(config, port):
        yield f"http://127.0.0.1:{port}"


# --- replay ----------------------------------------------------------------------------------


async def replay(url: str, plans: list[Planned], explain: bool) -> tuple[list[Streamed], float]:
    headers = {"x-kvgate-explain": "1"} if explain else None
    async with client_session(url) as session:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2

        async def one(plan: Planned) -> Streamed:
            intended = start + plan.at
            await asyncio.sleep(max(0.0, intended - loop.time()))
            result = Streamed()
            await stream_chat(session, "/v1/chat/completions", plan.body, intended, result, headers)
            if not result.error and not result.prompt_tokens:
                result.error = "no usage"  # the hit rate could not count this request
            return result

        results = await asyncio.gather(*(one(p) for p in plans))
        return list(results), loop.time() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_cell(
    args: argparse.Namespace,
    router: str,
    plans: list[Planned],
    floors: Sequence[float] | None = None,
) -> dict[str, Any]:
    """One replay of `plans` through `router` on a fresh fleet: its figures, or
    `{"unavailable": reason}` when the router cannot run here. `floors`: each plan's TTFT
    floor, for the slowest tenth's breakdown."""
    explain = args.cost_model and router != peer_router.NAME
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        lag_file = workdir / "lag.json"
        try:
            with (
                sim_fleet(args, lag_file, router == PRECISE, args.flavor) as (urls, events),
                front(args, router, urls, workdir, events) as base,
            ):
                results, elapsed = asyncio.run(replay(base, plans, explain))
                engine_stats = [httpx.get(u + "/sim/stats").json() for u in urls]
                first_tokens = {
                    record["id"]: record
                    for u in urls
                    for record in httpx.get(u + "/sim/first-tokens").json()["first_tokens"]
                }
                metrics = httpx.get(base + "/metrics").text if router != peer_router.NAME else ""
        except peer_router.PeerUnavailable as exc:
            return {"unavailable": str(exc)}
        lag = json.loads(lag_file.read_text()) if lag_file.exists() else {}
    if args.by_engine:
        print_by_engine(router, plans, results)
    ok = [r for r in results if not r.error]
    if explain:
        explained = [
            cost_model_error.Explained(r.explain, r.endpoint, r.ttft, r.prompt_tokens)
            for r in ok
            if r.explain and r.ttft is not None
        ]
        print(f"  {router}: {cost_model_error.describe(cost_model_error.fit(explained))}")
        moved, counted, given_up = cost_model_error.placed_away(explained)
        print(
            f"  {router}: {moved} of {counted} requests placed away from the candidate holding"
            f" most of their prompt, giving up {given_up:.1%} of prompt tokens"
        )
        p90 = percentile([r.ttft for r in explained], 0.9)
        for label, chosen in (
            ("", explained),
            (" of the slowest tenth", [r for r in explained if r.ttft >= p90]),
        ):
            queued, counted, kept = cost_model_error.kept_behind_queue(chosen)
            print(
                f"  {router}: {queued} of {counted} requests{label} placed behind queued "
                f"prefill while a candidate had none, keeping a median {kept:.0f} prompt "
                "tokens of hit"
            )
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    loads = [s["requests_received"] for s in engine_stats]
    hits = sum(s["prefix_hit_tokens"] for s in engine_stats)
    queries = sum(s["prefix_queries"] for s in engine_stats)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error for r in results if r.error)),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "ttft_p99": percentile(ttfts, 0.99),
        "output_tok_s": sum(r.output_tokens for r in ok) / elapsed,
        "hit_engine": hits / queries if queries else 0.0,
        "hit_cached_tokens": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "max_over_mean_load": max(loads) / statistics.mean(loads) if any(loads) else math.nan,
        "loads": loads,
        "preemptions": sum(s["preemptions"] for s in engine_stats),
        "sim_lag_p99_ms": lag.get("p99_ms", math.nan),
        "index_drift": index_drift(metrics),
        "slow_client": sum(1 for t in ttfts if t > SLOW_TTFT_SECONDS),
        "slow_gateway": gateway_slow_ttfts(metrics, SLOW_TTFT_SECONDS),
        "elapsed": elapsed,
        **{
            f"slow_{key}": value
            for key, value in ttft_breakdown.slowest_tenth(results, floors, first_tokens).items()
        },
    }


def index_drift(metrics: str) -> float:
    """kvgate's prefix-index drift over the run, from its /metrics text: (predicted - cached
    tokens) ÷ predicted, summed over endpoints; NaN when nothing was predicted (a policy
    that does not route by prefix, or a peer router: no text)."""
    predicted = sum(v for _, v in metric_samples(metrics, "kvgate_prefix_predicted_tokens_total"))
    cached = sum(v for _, v in metric_samples(metrics, "kvgate_prefix_cached_tokens_total"))
    return (predicted - cached) / predicted if predicted else math.nan


def gateway_slow_ttfts(metrics: str, seconds: float) -> float:
    """Streams whose time to first token the gateway itself measured above `seconds` (a bucket
    edge of `kvgate_time_to_first_token_seconds`), from its /metrics text; NaN without one.
    Set beside the client's own count it shows where slow first tokens were lost: a gap means
    the time was spent outside the gateway (the load generator or the sockets to it)."""
    buckets = list(metric_samples(metrics, "kvgate_time_to_first_token_seconds_bucket"))
    if not buckets:
        return math.nan
    total = sum(v for labels, v in buckets if labels["le"] == "+Inf")
    return total - sum(v for labels, v in buckets if float(labels["le"]) == seconds)


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs of one cell; failures summed; every run's TTFT
    p90 kept too (a median hides a cell whose runs split between two outcomes)."""
    if any("unavailable" in run for run in runs):
        return next(run for run in runs if "unavailable" in run)
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if key == "failures":
            total: Counter[str] = Counter()
            for run in runs:
                total.update(run[key])
            out[key] = dict(total)
        elif key == "failed":
            out[key] = sum(run[key] for run in runs)
        elif isinstance(value, int | float):
            out[key] = statistics.median(run[key] for run in runs)
        else:
            out[key] = value
    out["repeats"] = len(runs)
    out["ttft_p90_runs"] = [run["ttft_p90"] for run in runs]
    return out


def print_by_engine(label: str, plans: list[Planned], results: list[Streamed]) -> None:
    """Per engine (kvgate columns only, from `x-kvgate-endpoint`): requests, TTFT p50/p90 and
    uncached prompt tokens; then TTFT p50 by arrival decile (does the queue build on one engine
    or on all?)."""
    for name in sorted({r.endpoint for r in results}):
        mine = [r for r in results if r.endpoint == name and r.ttft is not None]
        ttfts = [r.ttft for r in mine if r.ttft is not None]
        print(
            f"  {label} {name or '?'}: {len(mine)} requests, TTFT p50 "
            f"{percentile(ttfts, 0.5):.2f} p90 {percentile(ttfts, 0.9):.2f} s, uncached prompt "
            f"tokens {sum(r.prompt_tokens - r.cached_tokens for r in mine)}",
            flush=True,
        )
    arrivals = sorted(
        (p.at, r.ttft) for p, r in zip(plans, results, strict=True) if r.ttft is not None
    )
    deciles = [arrivals[k * len(arrivals) // 10 : (k + 1) * len(arrivals) // 10] for k in range(10)]
    print(
        f"  {label} TTFT p50 by arrival decile: "
        + " ".join(f"{percentile([t for _, t in d], 0.5):.2f}" for d in deciles if d),
        flush=True,
    )


# --- loads -----------------------------------------------------------------------------------


def per_workload(spec: str, workload: str) -> list[float] | None:
    """`12,40` (every workload) or `shared=12,40;sessions=12` (per workload; None if absent).
    A rate may carry the load it stands for, `3x:40`, as found by an earlier search."""
    labelled = labelled_rates(spec, workload)
    return None if labelled is None else [rate for _, rate in labelled]


def labelled_rates(spec: str, workload: str) -> list[tuple[str, float]] | None:
    """`per_workload` with each rate's label: its load (`3x:40`) or `40 req/s`."""
    if not spec:
        return None
    rates = spec
    if "=" in spec:
        found = [
            p.partition("=")[2] for p in spec.split(";") if p.partition("=")[0].strip() == workload
        ]
        if not found:
            return None
        rates = found[0]
    out = []
    for item in rates.split(","):
        label, _, rate = item.rpartition(":")
        out.append((label or f"{float(rate):g} req/s", float(rate)))
    return out


def _interpolate(probes: dict[float, float], target: float) -> float:
    """The rate where p90 reaches `target`: log-log between the first bracketing probes (kept
    within the middle of the bracket, and halving it where p90 jumps more than tenfold, as at
    the edge of overload), or double the highest rate if no probe reaches it yet."""
    ordered = sorted(probes.items())
    for (r1, p1), (r2, p2) in itertools.pairwise(ordered):
        if p1 < target <= p2:
            share = (math.log(target) - math.log(p1)) / (math.log(p2) - math.log(p1))
            share = 0.5 if p2 > 10 * p1 else min(0.8, max(0.2, share))
            return float(f"{math.exp(math.log(r1) + share * math.log(r2 / r1)):.3g}")
    if ordered[-1][1] < target:
        return ordered[-1][0] * 2
    return ordered[0][0]


def search_loads(
    args: argparse.Namespace, workload: str, light: float, multiples: list[float]
) -> tuple[dict[float, float], dict[float, dict[str, Any]]]:
    """Round-robin probes from `light`: the rate found for each multiple of the unloaded p90,
    and every probe's figures by rate."""
    probes: dict[float, dict[str, Any]] = {}

    def probe(rate: float) -> float:
        stats = run_cell(args, "round_robin", WORKLOADS[workload](rate, args))
        probes[rate] = stats
        unloaded = probes[light]["ttft_p90"]
        print(
            f"search {workload}: round_robin at {rate:g} req/s: TTFT p90 "
            f"{stats['ttft_p90']:.3f} s = {stats['ttft_p90'] / unloaded:.1f}x unloaded, "
            f"{stats['failed']} failed",
            flush=True,
        )
        return stats["ttft_p90"]

    unloaded = probe(light)
    p90s = {light: unloaded}
    rate = light
    while multiples and max(p90s.values()) < max(multiples) * unloaded:
        if rate >= light * 2**args.search_doublings:
            break
        rate *= 2
        p90s[rate] = probe(rate)
    found: dict[float, float] = {}
    below = light  # each multiple's rate lies above the previous one's
    for multiple in sorted(multiples):
        target = multiple * unloaded

        def error(r: float, target: float = target) -> float:
            return abs(math.log(p90s[r] / target))

        def closest(below: float = below) -> float:
            above = [r for r in p90s if r > below]
            return min(above, key=error) if above else max(p90s)

        for _ in range(args.search_probes):
            if error(closest()) <= math.log(SEARCH_TOLERANCE):
                break
            above = {r: p for r, p in p90s.items() if r >= below}
            estimate = _interpolate(above, target)
            if estimate in p90s:
                break
            p90s[estimate] = probe(estimate)
        found[multiple] = below = closest()
    return found, probes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)}")
    p.add_argument(
        "--routers",
        default="round_robin,least_loaded,kvgate,precise,sglang",
        help=f"of {','.join(ROUTERS)}, or a kvgate policy file (.yaml)",
    )
    p.add_argument("--loads", default="light,3x,10x", help="of light,3x,10x")
    p.add_argument(
        "--rates",
        default="",
        help="req/s instead of the search: '12,40' for every workload or "
        "'shared=12,40;azure=10,30'; '3x:40' labels a rate with the load an earlier search "
        "found it for (then the targets are checked)",
    )
    p.add_argument("--light", default=DEFAULT_LIGHT, help="light rate: '8' or 'shared=12;...'")
    p.add_argument("--search-doublings", type=int, default=6, help="highest probe: light x 2^N")
    p.add_argument("--search-probes", type=int, default=4, help="refining probes per target")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (median reported)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--speed", type=float, default=2.0)
    p.add_argument("--kv-blocks", type=int, default=1400, help="per engine, 16 tokens each")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--flavor",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the engines the simulator imitates (sglang: caches a prefill once computed, not "
        "when scheduled; its metric names); kvgate's pool says the same engine",
    )
    add_arguments(p)
    p.add_argument("--micro", action="store_true", help="decision-cost microbenchmark only")
    p.add_argument("--no-micro", action="store_true", help="skip the decision-cost microbenchmark")
    p.add_argument(
        "--out",
        type=Path,
        help="the plot (default: beside RESULTS.md, named by date so older sections keep "
        "theirs; none with --no-results)",
    )
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/history/")
    p.add_argument(
        "--by-engine",
        action="store_true",
        help="print each run's per-engine TTFT and uncached work",
    )
    p.add_argument(
        "--cost-model",
        action="store_true",
        help="kvgate columns explain every decision; print how well the cost model predicted "
        "each request's TTFT and what placing requests away from their prefix's holder gave up "
        "(cost_model_error.py)",
    )
    p.add_argument(
        "--max-kv-usage",
        type=float,
        help="kvgate's routing.saturation.max_kv_usage (default: kvgate's own, 1.0: KV use "
        "saturates nothing)",
    )
    p.add_argument(
        "--estimates",
        action="store_true",
        help="run no router: print each --rates cell's cache ideals, TTFT floor and schedule "
        "estimates (schedule_estimates.py)",
    )
    p.add_argument("--serve-sim", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="let the simulated fleet share every CPU with the router and the client",
    )
    p.add_argument("--pin-sim", default="", help=argparse.SUPPRESS)
    p.add_argument("--lag-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--kv-events", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for name, known in (("workloads", WORKLOADS), ("routers", ROUTERS), ("loads", LOADS)):
        unknown = set(getattr(args, name).split(",")) - set(known)
        if name == "routers":  # a kvgate policy file is a router too
            unknown = {r for r in unknown if not (r.endswith(".yaml") and Path(r).is_file())}
        if unknown:
            p.error(f"--{name}: unknown {', '.join(sorted(unknown))}")
    args.routers = ",".join(
        str(Path(r).resolve()) if r.endswith(".yaml") else r for r in args.routers.split(",")
    )
    return args


def run_workload(args: argparse.Namespace, workload: str) -> tuple[list[Row], str]:
    """Every load x router cell of one workload, and the search's probes in one line."""
    routers = args.routers.split(",")
    rates = labelled_rates(args.rates, workload)
    probes: dict[float, dict[str, Any]] = {}
    if rates is not None:
        loads = rates
    else:
        wanted = args.loads.split(",")
        light = (per_workload(args.light, workload) or [8.0])[0]
        multiples = [LOADS[name] for name in wanted if name != "light"]
        found, probes = search_loads(args, workload, light, multiples)
        found[1.0] = light
        loads = [(name, found[LOADS[name]]) for name in wanted]
    rows = []
    for label, rate in loads:
        plans = WORKLOADS[workload](rate, args)
        ideals, schedules = offline_figures(args, plans)
        for router in routers:
            runs = [probes[rate]] if router == "round_robin" and rate in probes else []
            while len(runs) < args.repeats:
                runs.append(run_cell(args, router, plans, ideals.ttft_floors))
            row = Row(workload, label, rate, router, median_of(runs), ideals, schedules)
            rows.append(row)
            print(routing_report.progress(row), flush=True)
    search = ""
    if probes:
        unloaded = next(iter(probes.values()))["ttft_p90"]
        search = ", ".join(
            f"{rate:g} req/s → {stats['ttft_p90']:.3f} s ({stats['ttft_p90'] / unloaded:.1f}x)"
            for rate, stats in probes.items()
        )
    return rows, search


def offline_figures(
    args: argparse.Namespace, plans: list[Planned]
) -> tuple[CacheIdeals, ScheduleEstimates]:
    """What no router can beat on `plans` (cache_ideals.py) and what two idealised schedules
    of the same work would give (schedule_estimates.py), on the fleet of `args`."""
    ideals = cache_ideals([p.body for p in plans], args.engines * args.kv_blocks, speed=args.speed)
    return ideals, estimates([p.at for p in plans], ideals.ttft_floors, args.engines)


def _missing_trace(args: argparse.Namespace, workload: str) -> bool:
    """Whether `workload` needs a trace file that is not there (said, and skipped)."""
    trace = getattr(args, TRACE_OF.get(workload, ""), None)
    if trace is not None and not trace.exists():
        print(f"skipping {workload}: {trace} not found", flush=True)
        return True
    return False


def print_estimates(args: argparse.Namespace) -> None:
    """`--estimates`: what no router can beat and what two idealised schedules would give,
    per workload and rate of `--rates`, without running anything."""
    for workload in args.workloads.split(","):
        if _missing_trace(args, workload):
            continue
        for label, rate in labelled_rates(args.rates, workload) or []:
            ideals, schedules = offline_figures(args, WORKLOADS[workload](rate, args))
            print(
                f"{workload} {label} ({rate:g} req/s): TTFT p50 / p90 s: floor "
                f"{ideals.ttft_floor(0.5):.3f} / {ideals.ttft_floor(0.9):.3f}, shortest first "
                f"{schedules.srpt(0.5):.3f} / {schedules.srpt(0.9):.3f}, least-work FCFS "
                f"{schedules.fcfs(0.5):.3f} / {schedules.fcfs(0.9):.3f}; hit ideals: infinite "
                f"{ideals.infinite_hit:.3f}, fleet LRU {ideals.fleet_lru_hit:.3f}",
                flush=True,
            )


def main() -> int:
    args = parse_args()
    if args.serve_sim:
        serve_sim(args)
        return 0
    if args.estimates:
        print_estimates(args)
        return 0
    args.sim_cpus, others = (set(), set()) if args.no_pin else sim_cpus()
    if others:  # the gateway, the peer router and their children inherit it
        os.sched_setaffinity(0, others)
    micro_out = {} if args.no_micro else {**decision_cost.micro(), **precise_cost.micro()}
    if micro_out:
        print(json.dumps(micro_out, indent=1), flush=True)
    rows: list[Row] = []
    searches: dict[str, str] = {}
    if not args.micro:
        for workload in args.workloads.split(","):
            if _missing_trace(args, workload):
                continue
            mine, searches[workload] = run_workload(args, workload)
            rows += mine
    command = this_command()
    section = [
        f"## {datetime.date.today()}: "
        + (
            "routing decision cost"
            if args.micro
            else "routing quality beside sglang-router and the cache ideals"
        ),
        "",
        f"Machine: {machine()}; sglang-router {peer_router.version()}. Command: {command}",
        "",
    ]
    if micro_out:
        section += [decision_cost.summary(micro_out), "", precise_cost.summary(micro_out), ""]
    if rows:
        section += routing_report.sections(rows, args, searches)
        out = args.out
        if out is None and not args.no_results:
            out = BENCH_DIR / f"routing-{datetime.date.today()}.png"
        if out is not None and routing_report.plot(rows, out):
            # The section goes to history/; the plot lies beside RESULTS.md.
            section += [f"![routing](../{out.name})", ""]
    text = "\n".join(section)
    print(text)
    if not args.no_results:
        append_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
