"""Decision-cost microbenchmark: how long kvgate's default policy takes to place one request
(8k-token prompts over 64 endpoints), what hashing costs, and what the prefix index costs in
memory and in garbage-collection time. In-process, no sockets.

    .venv/bin/python benchmarks/routing.py --micro
"""

from __future__ import annotations

import gc
import math
import random
import time
import tracemalloc
from typing import Any

from workloads import MODEL, words


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def p50_p99(samples: list[float]) -> dict[str, float]:
    return {"p50": _percentile(samples, 0.5), "p99": _percentile(samples, 0.99)}


def random_load(endpoints: list[Any], rng: random.Random) -> None:
    """Fresh telemetry and in-flight work on every endpoint, as a scrape leaves them."""
    from kvgate.routing.telemetry import EngineTelemetry

    now = time.monotonic()
    for e in endpoints:
        e.telemetry = EngineTelemetry(
            scraped_at=now,
            waiting=float(rng.randrange(4)),
            running=float(rng.randrange(40)),
            kv_usage=rng.random() * 0.85,
        )
        e.inflight, e.peer_inflight = rng.randrange(30), rng.randrange(5)


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
    from kvgate.types import RequestContext

    rng = random.Random(3)
    out: dict[str, Any] = {}
    text_32k = words(rng, 32_000)[:128_000]
    # Raw hashing: no reuse of recently hashed prompts (recent=0). The default span covers the
    # whole 32k-token prompt; 256 blocks was the default before.
    for label, hasher in (
        ("hash_32k_tokens_default_span_us", PrefixHasher(recent=0)),
        ("hash_32k_tokens_first_256_blocks_us", PrefixHasher(64, 256, recent=0)),
    ):
        samples = []
        for _ in range(300):
            t = time.perf_counter()
            hasher.hashes(text_32k, MODEL, "salt")
            samples.append((time.perf_counter() - t) * 1e6)
        out[label] = p50_p99(samples)

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

        def prompt(i: int) -> str:
            head = systems[i % 32] if shared else f"{i} " + tails[(i * 7) % 50]
            return head + f" {i} " + tails[i % 50]  # ≈ 8k tokens

        def timed(i: int) -> float:
            request = ctx(prompt(i))
            if i % 100 == 0:
                random_load(endpoints, rng)
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
        return p50_p99(samples), p50_p99(warmup), services.index

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
    hasher = PrefixHasher(max_blocks=256, recent=0)
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


def summary(out: dict[str, Any]) -> str:
    """One paragraph for RESULTS.md from `micro()`'s output."""
    return (
        "Decision cost (µs): "
        + ", ".join(
            f"{k} p50 {v['p50']:.0f} / p99 {v['p99']:.0f}"
            for k, v in out.items()
            if isinstance(v, dict)
        )
        + f"; prefix index ≈ {out['index_bytes_per_entry']:.0f} B per single-block "
        f"entry, {out['index_bytes_per_16_block_leaf']:.0f} B per 16-block leaf, "
        f"{out['index_bytes_per_256_block_leaf']:.0f} B per 256-block leaf "
        f"({out['index_bytes_per_256_block_unhashed_leaf']:.0f} B unhashed), "
        f"{out['index_bytes_per_root']:.0f} B per listed first block; a full garbage "
        "collection walks the index the shared / new prompts left in "
        f"{out['full_gc_ms_shared_prompts_index']:.0f} / "
        f"{out['full_gc_ms_new_prompts_index']:.0f} ms, "
        f"{out['full_gc_ms_shared_prompts_frozen']:.1f} / "
        f"{out['full_gc_ms_new_prompts_frozen']:.1f} ms for the whole process frozen."
    )
