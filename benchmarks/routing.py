"""Routing quality and decision cost: kvgate's default policy against random, round-robin and
least-loaded, on fresh simulated fleets, side by side in one run.

    .venv/bin/python benchmarks/routing.py                  # everything, logged in history/
    .venv/bin/python benchmarks/routing.py --micro          # decision-cost microbenchmark only
    .venv/bin/python benchmarks/routing.py --workloads shared --rates 4,12 \\
        --policies kvgate,round_robin

For each workload x rate x policy: start a fresh simulated fleet (realistic profile, `--speed`)
and a gateway whose pool uses that policy, replay the workload open-loop (latency measured from
each request's intended send time), then read the engines' counters. Workloads:
  shared   groups of prompts sharing a long system prompt (`--groups` x `--per-group`)
  sessions multi-turn chats whose context grows turn by turn (`--requests` / `--turns`
           sessions, each with its own system prompt, a turn every `--turn-gap` seconds, as an
           agent loop does; the `user` field names the session)
  mooncake the Mooncake synthetic trace (`--trace`: `synthetic_trace.jsonl`, the public file
           from the Mooncake project, github.com/kvcache-ai/Mooncake; the default is where the
           benchmark machine keeps a copy, and the workload is skipped when it is absent):
           each hash_id becomes a fixed block of synthetic text (`--block-chars`), so shared
           ids are shared text; lengths scaled down (a 512-token hash block becomes ~17 tokens)
The defaults size every workload so that its reusable working set exceeds one engine's KV
cache and fits the fleet's (printed with the results). The ideal hit rate is what one engine
with an infinite cache would reuse (prefix blocks seen before, in arrival order). Simulator lag
(event-loop oversleep in the fleet process) is reported so a CPU-bound run shows itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import random
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
from typing import Any

import httpx
import orjson
from services import BENCH_DIR, PYTHON, append_results, free_port, gateway, stop, wait_ready

DEFAULT_TRACE = Path("/work/shared/data/mooncake/synthetic_trace.jsonl")
MODEL = "sim-model"
POLICIES = ["random", "round_robin", "least_loaded", "kvgate"]
# The low rate is the unloaded reference; the high one is where round-robin's TTFT p90 is well
# past 5x its unloaded value on this benchmark's fleet (4 engines, speed 2, 1,400 KV blocks).
DEFAULT_RATES = "shared=12,56;sessions=12,80,100;mooncake=8,100,120"
_WORD_TEXT = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
    "zulu engine cache token prefix router stream window batch"
)
WORDS = tuple(_WORD_TEXT.split())


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` simulator tokens of text (one word ≈ one token)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


@dataclass(slots=True)
class Planned:
    at: float  # seconds from the start
    body: dict[str, Any]


def _chat(
    messages: list[dict[str, str]], max_tokens: int, user: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if user:
        body["user"] = user
    return body


def shared_prefix(rate: float, args: argparse.Namespace) -> list[Planned]:
    rng = random.Random(1)
    systems = [words(rng, args.system_tokens) for _ in range(args.groups)]
    order = [(g, i) for g in range(args.groups) for i in range(args.per_group)]
    rng.shuffle(order)
    arrivals = _poisson(len(order), rate, rng)
    return [
        Planned(
            t,
            _chat(
                [
                    {"role": "system", "content": systems[g]},
                    {"role": "user", "content": f"{i}: " + words(rng, 128)},
                ],
                args.output_tokens,
            ),
        )
        for t, (g, i) in zip(arrivals, order, strict=True)
    ]


def sessions(rate: float, args: argparse.Namespace) -> list[Planned]:
    rng = random.Random(2)
    turns, gap = args.turns, args.turn_gap
    count = max(1, round(args.requests / turns))
    starts = _poisson(count, rate / turns, rng)
    plans = []
    for s, start in enumerate(starts):
        history = [{"role": "system", "content": words(rng, args.session_system_tokens)}]
        for t in range(turns):
            history = [*history, {"role": "user", "content": words(rng, 96)}]
            plans.append(
                Planned(
                    start + t * gap, _chat(list(history), args.output_tokens, user=f"session-{s}")
                )
            )
            history.append({"role": "assistant", "content": words(rng, args.output_tokens)})
    return sorted(plans, key=lambda p: p.at)


def mooncake(rate: float, args: argparse.Namespace) -> list[Planned]:
    lines = args.trace.read_text().splitlines()[
        args.trace_offset : args.trace_offset + args.requests
    ]
    rows = [json.loads(line) for line in lines]
    blocks: dict[int, str] = {}

    def block(hash_id: int) -> str:
        if hash_id not in blocks:
            blocks[hash_id] = words(random.Random(hash_id), args.block_chars // 5)
        return blocks[hash_id]

    span = max(1.0, (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000)
    scale = (len(rows) / rate) / span
    plans = []
    for row in rows:
        text = " ".join(block(h) for h in row["hash_ids"])
        output = max(1, min(args.output_tokens, row["output_length"] // 16))
        plans.append(
            Planned(
                (row["timestamp"] - rows[0]["timestamp"]) / 1000 * scale,
                _chat([{"role": "user", "content": text}], output),
            )
        )
    return plans


WORKLOADS = {"shared": shared_prefix, "sessions": sessions, "mooncake": mooncake}


def _poisson(count: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def ideal_reuse(plans: list[Planned], block_chars: int = 64) -> tuple[float, float]:
    """The fraction of prompt text one engine with an infinite cache would reuse, and the
    reusable working set in simulator tokens: the text of every distinct block reused at least
    once, counted with the simulator's tokenizer."""
    from kvgate.prompt_view import prompt_text
    from kvgate.routing.prefix_hasher import PrefixHasher
    from kvgate.sim.tokenizer import count_tokens

    hasher = PrefixHasher(block_chars, max_blocks=1_000_000)
    seen: set[int] = set()
    reused_blocks: set[int] = set()
    reused = total = 0
    for plan in plans:
        text = prompt_text(plan.body)
        hashes = hasher.hashes(text, MODEL)
        depth = 0
        while depth < len(hashes) and hashes[depth] in seen:
            depth += 1
        reused_blocks.update(hashes[:depth])
        reused += depth * block_chars
        total += len(text.encode())
        seen.update(hashes)
    sample = "".join(prompt_text(plan.body) for plan in plans[:64])
    tokens_per_byte = count_tokens(sample) / max(1, len(sample.encode()))
    return (reused / total if total else 0.0), len(reused_blocks) * block_chars * tokens_per_byte


# --- processes -----------------------------------------------------------------------------


def serve_sim(args: argparse.Namespace) -> None:
    """Child process: a simulated fleet plus an event-loop lag probe written at exit."""
    from kvgate.sim import EngineOptions, SimFleet

    async def main() -> list[float]:
        options = EngineOptions(
            profile="realistic",
            speed=args.speed,
            kv_blocks=args.kv_blocks,
            max_num_seqs=args.max_num_seqs,
        )
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, done.set)
        lags: list[float] = []
        async with SimFleet(args.engines, 0, options) as fleet:
            print(" ".join(fleet.urls), flush=True)
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
def sim_fleet(args: argparse.Namespace, lag_file: Path) -> Iterator[list[str]]:
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
            "--lag-file",
            str(lag_file),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        urls = proc.stdout.readline().split()
        if len(urls) != args.engines:
            raise RuntimeError("the simulated fleet did not start")
        for url in urls:
            wait_ready(proc, int(url.rsplit(":", 1)[1]), "/health")
        yield urls
    finally:
        stop(proc)


def gateway_yaml(port: int, urls: list[str], policy: str) -> str:
    endpoints = ", ".join(f'{{url: "{u}"}}' for u in urls)
    return (
        f"server: {{host: 127.0.0.1, port: {port}, access_log: false}}\n"
        "auth: none\n"
        f"pools:\n  - {{name: sim, engine: vllm, models: [{MODEL}], policy: {policy}, "
        f"endpoints: [{endpoints}]}}\n"
    )


# --- replay ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    endpoint: str = ""
    error: str = ""


async def replay(url: str, plans: list[Planned]) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2

        async def one(plan: Planned) -> Result:
            await asyncio.sleep(max(0.0, start + plan.at - loop.time()))
            intended = start + plan.at
            result = Result()
            try:
                async with client.stream(
                    "POST", "/v1/chat/completions", json=plan.body
                ) as response:
                    result.endpoint = response.headers.get("x-kvgate-endpoint", "")
                    if response.status_code != 200:
                        result.error = f"http {response.status_code}"
                        await response.aread()
                        return result
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = orjson.loads(line[6:])
                        choices = event.get("choices") or [{}]
                        # The first token, not the role-only event some engines send first.
                        if result.ttft is None and (choices[0].get("delta") or {}).get("content"):
                            result.ttft = loop.time() - intended
                        usage = event.get("usage")
                        if usage:
                            result.output_tokens = usage.get("completion_tokens", 0)
                            result.prompt_tokens = usage.get("prompt_tokens", 0)
                            details = usage.get("prompt_tokens_details") or {}
                            result.cached_tokens = details.get("cached_tokens") or 0
            except httpx.HTTPError as exc:
                result.error = type(exc).__name__
            return result

        results = await asyncio.gather(*(one(p) for p in plans))
        return list(results), loop.time() - start


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Row:
    workload: str
    rate: float
    policy: str
    stats: dict[str, Any] = field(default_factory=dict)


def run_one(
    args: argparse.Namespace, workload: str, rate: float, policy: str, plans: list[Planned]
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        lag_file = Path(tmp) / "lag.json"
        with sim_fleet(args, lag_file) as urls:
            port = free_port()
            config = Path(tmp) / "gateway.yaml"
            config.write_text(gateway_yaml(port, urls, policy))
            with gateway(config, port):
                results, elapsed = asyncio.run(replay(f"http://127.0.0.1:{port}", plans))
            engine_stats = [httpx.get(u + "/sim/stats").json() for u in urls]
        lag = json.loads(lag_file.read_text()) if lag_file.exists() else {}
    ok = [r for r in results if not r.error and r.ttft is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    if args.by_engine:
        print_by_engine(f"{workload} {rate:g} req/s {policy}", plans, results)
    per_engine = Counter(r.endpoint for r in results)
    loads = [per_engine.get(f"sim-{i}", 0) for i in range(args.engines)]
    hits = sum(s["prefix_hit_tokens"] for s in engine_stats)
    queries = sum(s["prefix_queries"] for s in engine_stats)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "ttft_p50": _percentile(ttfts, 0.5),
        "ttft_p90": _percentile(ttfts, 0.9),
        "ttft_p99": _percentile(ttfts, 0.99),
        "output_tok_s": sum(r.output_tokens for r in ok) / elapsed,
        "hit_engine": hits / queries if queries else 0.0,
        "hit_cached_tokens": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "max_over_mean_load": max(loads) / statistics.mean(loads) if any(loads) else math.nan,
        "loads": loads,
        "sim_lag_p99_ms": lag.get("p99_ms", math.nan),
        "elapsed": elapsed,
    }


def print_by_engine(label: str, plans: list[Planned], results: list[Result]) -> None:
    """Per engine: requests, TTFT p50/p90 and uncached prompt tokens; then TTFT p50 by
    arrival decile (does the queue build on one engine or on all?)."""
    for name in sorted({r.endpoint for r in results}):
        mine = [r for r in results if r.endpoint == name and r.ttft is not None]
        ttfts = [r.ttft for r in mine if r.ttft is not None]
        print(
            f"  {label} {name}: {len(mine)} requests, TTFT p50 {_percentile(ttfts, 0.5):.2f}"
            f" p90 {_percentile(ttfts, 0.9):.2f} s, uncached prompt tokens "
            f"{sum(r.prompt_tokens - r.cached_tokens for r in mine)}",
            flush=True,
        )
    arrivals = sorted(
        (p.at, r.ttft) for p, r in zip(plans, results, strict=True) if r.ttft is not None
    )
    deciles = [arrivals[k * len(arrivals) // 10 : (k + 1) * len(arrivals) // 10] for k in range(10)]
    print(
        f"  {label} TTFT p50 by arrival decile: "
        + " ".join(f"{_percentile([t for _, t in d], 0.5):.2f}" for d in deciles if d),
        flush=True,
    )


# --- microbenchmark ------------------------------------------------------------------------


def _p50_p99(samples: list[float]) -> dict[str, float]:
    return {"p50": _percentile(samples, 0.5), "p99": _percentile(samples, 0.99)}


def micro() -> dict[str, Any]:
    from kvgate.ingress import request_context
    from kvgate.routing.endpoints import Endpoint, Fleet, Pool
    from kvgate.routing.policy_catalog import builtin_policy
    from kvgate.routing.prefix_hasher import PrefixHasher
    from kvgate.routing.prefix_index import PrefixIndex
    from kvgate.routing.prefix_tree import EndpointBlocks
    from kvgate.routing.router import PolicyPicker
    from kvgate.routing.services import RoutingServices
    from kvgate.routing.settings import RoutingConfig
    from kvgate.routing.telemetry import EngineTelemetry
    from kvgate.types import RequestContext

    rng = random.Random(3)
    out: dict[str, Any] = {}
    text_32k = words(rng, 32_000)[:128_000]
    # Raw hashing: no reuse of recently hashed prompts (recent=0).
    for label, hasher in (
        ("hash_32k_tokens_default_cap_us", PrefixHasher(recent=0)),
        ("hash_32k_tokens_uncapped_us", PrefixHasher(64, 2048, recent=0)),
    ):
        samples = []
        for _ in range(300):
            t = time.perf_counter()
            hasher.hashes(text_32k, MODEL, "salt")
            samples.append((time.perf_counter() - t) * 1e6)
        out[label] = _p50_p99(samples)

    def ctx(text: str) -> RequestContext:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        return request_context("chat", {**payload, "stream": True}, upstream_path="/")

    def decisions(shared: bool) -> tuple[dict[str, float], dict[str, float], PrefixIndex]:
        """3,000 decisions for ≈ 8k-token prompts over 64 endpoints: 32 shared system prompts
        with their own questions, or every prompt new. Measured in the steady state, after
        2,000 decisions and, for new prompts, once every endpoint's index is full (until then
        the index tables grow by doubling, which a long-running gateway does once); the
        decisions before that are returned too."""
        endpoints = [
            Endpoint(
                name=f"e{i}",
                url=f"http://e{i}",
                pool="p",
                engine="vllm",
                configured_models=frozenset({MODEL}),
            )
            for i in range(64)
        ]
        fleet = Fleet([Pool("p", "vllm", "kvgate", endpoints)])
        services = RoutingServices.from_config(RoutingConfig())
        services.index.add_endpoints(e.name for e in endpoints)
        picker = PolicyPicker(fleet, "p", builtin_policy("kvgate"), services)
        systems = [words(rng, 6_000) for _ in range(32)]
        tails = [words(rng, 2000) for _ in range(50)]
        gc.collect()
        gc.freeze()  # as the gateway does at startup

        def scrape() -> None:  # fresh telemetry and in-flight work on every endpoint
            now = time.monotonic()
            for e in endpoints:
                e.telemetry = EngineTelemetry(
                    scraped_at=now,
                    waiting=float(rng.randrange(4)),
                    running=float(rng.randrange(40)),
                    kv_usage=rng.random() * 0.85,
                )
                e.inflight, e.peer_inflight = rng.randrange(30), rng.randrange(5)

        def prompt(i: int) -> str:
            head = systems[i % 32] if shared else f"{i} " + tails[(i * 7) % 50]
            return head + f" {i} " + tails[i % 50]  # ≈ 8k tokens

        def timed(i: int) -> float:
            request = ctx(prompt(i))
            if i % 100 == 0:
                scrape()
            t = time.perf_counter()
            picker.choose(request)
            return (time.perf_counter() - t) * 1e6

        def warming(i: int) -> bool:
            if i < 2000:
                return True
            full = services.index.default_capacity
            return (
                not shared
                and i < 40_000
                and any(services.index.entries(e.name) < full for e in endpoints)
            )

        warmup: list[float] = []
        while warming(len(warmup)):
            warmup.append(timed(len(warmup)))
        samples = [timed(len(warmup) + i) for i in range(3000)]
        gc.unfreeze()
        return _p50_p99(samples), _p50_p99(warmup), services.index

    def collection_ms() -> float:
        """The fastest of three full collections (after one that frees what it can)."""
        gc.collect()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            gc.collect()
            times.append((time.perf_counter() - t) * 1e3)
        return min(times)

    def index_walk(name: str, index: PrefixIndex) -> None:
        """What an index adds to a full garbage collection: walked by the collector, and
        frozen out of its reach as the gateway does at startup (the whole process then)."""
        alive = collection_ms()
        gc.freeze()
        out[f"full_gc_ms_{name}_frozen"] = collection_ms()
        gc.unfreeze()
        for i in range(64):
            index.clear(f"e{i}")
        out[f"full_gc_ms_{name}_index"] = max(0.0, alive - collection_ms())

    out["decision_8k_tokens_64_endpoints_us"], _, index = decisions(shared=True)
    out["index_entries_total_after_warmup"] = index.entries()
    out["index_memory_bytes_reported"] = index.memory_bytes
    index_walk("shared_prompts", index)
    (
        out["decision_8k_tokens_64_endpoints_new_prompts_us"],
        out["decision_8k_tokens_64_endpoints_new_prompts_while_the_index_fills_us"],
        index,
    ) = decisions(shared=False)
    out["index_entries_total_new_prompts"] = index.entries()
    out["index_memory_bytes_reported_new_prompts"] = index.memory_bytes
    index_walk("new_prompts", index)
    del index
    # Bytes per single-block entry (a snapshot's blocks, loaded one by one), per leaf and per
    # block in a leaf (prompts nobody shares, recorded whole).
    tracemalloc.start()
    blocks = EndpointBlocks(capacity=200_000, ttl=600)
    before = tracemalloc.get_traced_memory()[0]
    singles = [rng.getrandbits(64) for _ in range(100_000)]
    blocks.load(singles, [float(at) for at in range(len(singles))], now=0.0)
    del singles
    after = tracemalloc.get_traced_memory()[0]
    out["index_bytes_per_entry"] = (after - before) / len(blocks)
    for length in (16, 256):
        leaves = EndpointBlocks(capacity=200_000, ttl=600)
        before = tracemalloc.get_traced_memory()[0]
        for at in range(100_000 // length):
            leaves.record([rng.getrandbits(64) for _ in range(length)], now=float(at))
        after = tracemalloc.get_traced_memory()[0]
        out[f"index_bytes_per_{length}_block_leaf"] = (after - before) / leaves.sizes()[1]
    # A leaf that keeps its prompt's bytes: prompts nobody shares, recorded unhashed.
    texts = [words(rng, 4_000) for _ in range(100)]
    hasher = PrefixHasher(recent=0)
    leaves = EndpointBlocks(capacity=200_000, ttl=600)
    before = tracemalloc.get_traced_memory()[0]
    for at, text in enumerate(texts):
        leaves.record(hasher.chain(text, MODEL), now=float(at))
    after = tracemalloc.get_traced_memory()[0]
    out["index_bytes_per_256_block_unhashed_leaf"] = (after - before) / leaves.sizes()[1]
    del texts
    tracemalloc.stop()
    chains = [[rng.getrandbits(64)] for _ in range(10_000)]
    listing = []
    for max_roots in (0, len(chains)):  # without and with each first block listed
        tracemalloc.start()
        empty = tracemalloc.get_traced_memory()[0]
        roots = PrefixIndex(max_roots=max_roots)
        for i, chain in enumerate(chains):
            roots.record(f"e{i % 64}", chain, now=1.0)
        listing.append(tracemalloc.get_traced_memory()[0] - empty)
        tracemalloc.stop()
        del roots
    out["index_bytes_per_root"] = (listing[1] - listing[0]) / len(chains)
    return out


# --- report ----------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 2) -> str:
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.{digits}f}"
    )


def table(rows: list[Row], ideal: dict[str, float]) -> str:
    head = (
        "| workload | rate (req/s) | policy | n | failed | TTFT p50 s | TTFT p90 s "
        "| TTFT p99 s | output tok/s | hit (engine) | hit (cached_tokens) | ideal hit "
        "| max/mean load | sim lag p99 ms |"
    )
    lines = [head, "|" + "---|" * 14]
    for row in rows:
        s = row.stats
        lines.append(
            f"| {row.workload} | {row.rate:g} | {row.policy} | {s['requests']} | {s['failed']} "
            f"| {_fmt(s['ttft_p50'])} | {_fmt(s['ttft_p90'])} | {_fmt(s['ttft_p99'])} "
            f"| {_fmt(s['output_tok_s'], 0)} | {_fmt(s['hit_engine'])} "
            f"| {_fmt(s['hit_cached_tokens'])} | {_fmt(ideal[row.workload])} "
            f"| {_fmt(s['max_over_mean_load'])} | {_fmt(s['sim_lag_p99_ms'], 0)} |"
        )
    return "\n".join(lines)


def targets(rows: list[Row], ideal: dict[str, float]) -> str:
    """The issue's targets, checked per workload."""
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        by = {(r.policy, r.rate): r.stats for r in mine}
        rates = sorted({r.rate for r in mine})
        low = rates[0]
        if ("round_robin", low) not in by or ("kvgate", low) not in by:
            continue
        rr_unloaded = by[("round_robin", low)]["ttft_p90"]
        loaded = [
            rate
            for rate in rates
            if by.get(("round_robin", rate), {}).get("ttft_p90", 0) >= 5 * rr_unloaded
        ]
        kv = by[("kvgate", low)]
        best_p50 = min(by[(p, low)]["ttft_p50"] for p in POLICIES if (p, low) in by)
        out.append(
            f"- **{workload}**: low-load TTFT p50 kvgate {kv['ttft_p50']:.3f} s vs best "
            f"{best_p50:.3f} s → {'holds' if kv['ttft_p50'] <= 1.1 * best_p50 else 'misses'}"
            " (within 10%)"
        )
        if not loaded:
            out.append(
                f"  - no rate reached round-robin TTFT p90 ≥ 5x unloaded "
                f"({rr_unloaded:.3f} s): load targets not exercised at these rates"
            )
        for rate in loaded:
            k, rr = by[("kvgate", rate)], by[("round_robin", rate)]
            ll = by.get(("least_loaded", rate))
            checks = [
                f"p90 kvgate {k['ttft_p90']:.2f} s vs round-robin {rr['ttft_p90']:.2f} s "
                f"({'holds' if k['ttft_p90'] <= rr['ttft_p90'] / 3 else 'misses'} ≤ 1/3)"
            ]
            if ll:
                checks.append(
                    f"vs least-loaded {ll['ttft_p90']:.2f} s "
                    f"({'holds' if k['ttft_p90'] <= ll['ttft_p90'] / 2 else 'misses'}"
                    " ≤ 1/2)"
                )
            ratio = k["hit_engine"] / ideal[workload] if ideal[workload] else math.nan
            checks.append(
                f"hit rate {k['hit_engine']:.2f} = {ratio:.0%} of ideal "
                f"({'holds' if ratio >= 0.8 else 'misses'} ≥ 80%)"
            )
            checks.append(
                f"max/mean load {k['max_over_mean_load']:.2f} "
                f"({'holds' if k['max_over_mean_load'] <= 2 else 'misses'} ≤ 2)"
            )
            out.append(f"  - at {rate:g} req/s: " + "; ".join(checks))
    return "\n".join(out)


def plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = list(dict.fromkeys(r.workload for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 8), squeeze=False)
    for col, workload in enumerate(workloads):
        for policy in POLICIES:
            mine = sorted(
                (r for r in rows if r.workload == workload and r.policy == policy),
                key=lambda r: r.rate,
            )
            if not mine:
                continue
            axes[0][col].plot(
                [r.rate for r in mine],
                [r.stats["ttft_p90"] for r in mine],
                marker="o",
                label=policy,
            )
            axes[1][col].plot(
                [r.rate for r in mine],
                [r.stats["hit_engine"] for r in mine],
                marker="o",
                label=policy,
            )
        axes[0][col].set_title(f"{workload}: TTFT p90 (s)")
        axes[0][col].set_yscale("log")
        axes[1][col].set_title(f"{workload}: prefix hit rate (engine)")
        axes[1][col].set_xlabel("request rate (req/s)")
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def workload_rates(spec: str, workload: str) -> list[float]:
    """`12,40` (every workload) or `shared=12,40;sessions=12,80` (per workload)."""
    if "=" not in spec:
        return [float(r) for r in spec.split(",")]
    for part in spec.split(";"):
        name, _, rates = part.partition("=")
        if name.strip() == workload:
            return [float(r) for r in rates.split(",")]
    raise SystemExit(f"--rates names no rates for the workload '{workload}'")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="shared,sessions,mooncake")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument(
        "--rates",
        default=DEFAULT_RATES,
        help="req/s: '12,40' for every workload or 'shared=12,40;sessions=...'; the "
        "lowest rate is the unloaded reference",
    )
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--speed", type=float, default=2.0)
    p.add_argument("--kv-blocks", type=int, default=1400, help="per engine, 16 tokens each")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=384, help="sessions and mooncake")
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--turn-gap", type=float, default=0.4, help="seconds between a session's turns")
    p.add_argument("--session-system-tokens", type=int, default=512)
    p.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="Mooncake synthetic trace (JSONL), the public file from the Mooncake project",
    )
    p.add_argument(
        "--trace-offset",
        type=int,
        default=3712,
        help="first Mooncake row to replay (later rows reuse more)",
    )
    p.add_argument(
        "--block-chars",
        type=int,
        default=96,
        help="text per Mooncake hash_id (512 tokens scaled to ~17)",
    )
    p.add_argument("--micro", action="store_true", help="decision-cost microbenchmark only")
    p.add_argument("--no-micro", action="store_true", help="skip the decision-cost microbenchmark")
    p.add_argument("--out", type=Path, default=BENCH_DIR / "routing")
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/history/")
    p.add_argument(
        "--by-engine",
        action="store_true",
        help="print each run's per-engine TTFT and uncached work",
    )
    p.add_argument("--serve-sim", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lag-file", default="", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.serve_sim:
        serve_sim(args)
        return 0
    micro_out = {} if args.no_micro else micro()
    print(json.dumps(micro_out, indent=1), flush=True)
    rows: list[Row] = []
    ideal: dict[str, float] = {}
    working_sets: dict[str, float] = {}
    if not args.micro:
        for workload in args.workloads.split(","):
            if workload == "mooncake" and not args.trace.exists():
                print(f"skipping mooncake: {args.trace} not found", flush=True)
                continue
            for rate in workload_rates(args.rates, workload):
                plans = WORKLOADS[workload](rate, args)
                ideal[workload], working_sets[workload] = ideal_reuse(plans)
                for policy in args.policies.split(","):
                    row = Row(workload, rate, policy, run_one(args, workload, rate, policy, plans))
                    rows.append(row)
                    s = row.stats
                    print(
                        f"{workload} {rate:g} req/s {policy}: p50 {s['ttft_p50']:.3f} "
                        f"p90 {s['ttft_p90']:.3f} hit {s['hit_engine']:.2f} "
                        f"loads {s['loads']} failed {s['failed']} "
                        f"lag p99 {s['sim_lag_p99_ms']:.0f} ms",
                        flush=True,
                    )
    command = "python benchmarks/routing.py " + " ".join(sys.argv[1:])
    section = [
        f"## Routing quality and decision cost ({datetime.date.today()})",
        "",
        f"Machine: {machine()}. Command: `{command}`",
        "",
    ]
    if micro_out:
        section += [
            "Decision cost (µs): "
            + ", ".join(
                f"{k} p50 {v['p50']:.0f} / p99 {v['p99']:.0f}"
                for k, v in micro_out.items()
                if isinstance(v, dict)
            )
            + f"; prefix index ≈ {micro_out['index_bytes_per_entry']:.0f} B per single-block "
            f"entry, {micro_out['index_bytes_per_16_block_leaf']:.0f} B per 16-block leaf, "
            f"{micro_out['index_bytes_per_256_block_leaf']:.0f} B per 256-block leaf "
            f"({micro_out['index_bytes_per_256_block_unhashed_leaf']:.0f} B unhashed), "
            f"{micro_out['index_bytes_per_root']:.0f} B per listed first block; a full garbage "
            "collection walks the index the shared / new prompts left in "
            f"{micro_out['full_gc_ms_shared_prompts_index']:.0f} / "
            f"{micro_out['full_gc_ms_new_prompts_index']:.0f} ms, "
            f"{micro_out['full_gc_ms_shared_prompts_frozen']:.1f} / "
            f"{micro_out['full_gc_ms_new_prompts_frozen']:.1f} ms for the whole process "
            "frozen.",
            "",
        ]
    if rows:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        png = args.out.with_suffix(".png")
        plotted = plot(rows, png)
        section += [
            f"{args.engines} engines, speed {args.speed}, {args.kv_blocks} KV blocks "
            f"each, max_num_seqs {args.max_num_seqs}, {args.output_tokens} output "
            "tokens. Reusable working set (prompt text reused at least once, in "
            "16-token KV blocks) against one engine's KV and the fleet's: "
            + "; ".join(
                f"{w} {n / 16:.0f} blocks ({n / 16 / args.kv_blocks:.1f}x one engine, "
                f"{n / 16 / (args.kv_blocks * args.engines):.0%} of the fleet)"
                for w, n in working_sets.items()
            )
            + ".",
            "",
            table(rows, ideal),
            "",
            "Targets:",
            "",
            targets(rows, ideal),
            "",
        ]
        if plotted:
            section += [f"![routing]({png.name})", ""]
    text = "\n".join(section)
    print(text)
    if not args.no_results:
        append_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
