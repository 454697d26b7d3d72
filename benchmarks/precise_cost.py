"""Precise routing's decision cost and memory (issue 15): kvgate's default policy placing
≈ 8k-token chat prompts over 64 endpoints in precise mode, tokenization (the simulator's
tokenizer and template) included, and the precise index's bytes per block. In-process: the
64 subscribers run against a replay socket that answers "nothing sent yet" (so every endpoint
starts precise) and the index is fed through the subscribers' sink, as events would: 32
system prompts held by two engines each, filler blocks, and after every decision the chosen
engine's BlockStored for the prompt (and BlockRemoved for its oldest kept request).

    .venv/bin/python benchmarks/precise_cost.py          # also part of routing.py --micro
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import time
import tracemalloc
from collections import deque
from typing import Any

import zmq
import zmq.asyncio
from decision_cost import p50_p99, random_load
from services import free_port
from workloads import MODEL, words

ENDPOINTS = 64
BLOCK = 16
FILLER_BLOCKS = 5_000  # per endpoint, besides the shared system prompts
# Each engine keeps the blocks of its last this many requests, then evicts the oldest
# (BlockRemoved): the speculative entries are confirmed as in a running fleet.
KEPT_REQUESTS = 8


async def _answer_nothing_sent(router: zmq.asyncio.Socket) -> None:
    """A replay socket whose publisher has sent nothing yet: every subscriber starts precise."""
    end = (-1).to_bytes(8, "big", signed=True)
    while True:
        identity, delimiter, _ = await router.recv_multipart()
        await router.send_multipart([identity, delimiter, end, b""])


def _stored_runs(ids: list[int], rng: random.Random, run: int = 64) -> list[Any]:
    """BlockStored events for the full blocks of `ids`, `run` blocks per event, chained."""
    from kvgate.routing.kv_events import BlockStored

    blocks = len(ids) // BLOCK
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    events = []
    for first in range(0, blocks, run):
        last = min(blocks, first + run)
        events.append(
            BlockStored(
                tuple(hashes[first:last]),
                hashes[first - 1] if first else None,
                tuple(ids[first * BLOCK : last * BLOCK]),
                BLOCK,
            )
        )
    return events


def silent_event_urls(count: int) -> list[str]:
    """`count` distinct KV-event URLs on free ports where nobody publishes (the index is fed
    directly): each endpoint's stream must be its own, or the config is refused."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return [f"tcp://127.0.0.1:{port}" for port in sorted(ports)]


def gateway_config(replay: str, event_urls: list[str]) -> dict[str, Any]:
    """One pool of `len(event_urls)` endpoints in precise mode (the simulator's tokenizer),
    each on its own KV-event URL, all sharing the replay socket `replay`."""
    return {
        "routing": {"scrape_interval": 1000},  # no stall within the run
        "pools": [
            {
                "name": "p",
                "models": [MODEL],
                "tokenizer": {"kind": "sim"},
                "endpoints": [
                    {
                        "url": f"http://127.0.0.1:{20_000 + i}",
                        "kv_events": {"url": url, "replay_url": replay},
                    }
                    for i, url in enumerate(event_urls)
                ],
            }
        ],
    }


async def _decisions(out: dict[str, Any]) -> None:
    from kvgate.config import parse_config
    from kvgate.ingress import request_context
    from kvgate.routing.endpoints import Fleet, build_pool
    from kvgate.routing.kv_events import BlockRemoved
    from kvgate.routing.policy_catalog import builtin_policy
    from kvgate.routing.precise import PreciseRouting
    from kvgate.routing.prompt_tokens import SimTokenizer
    from kvgate.routing.router import PolicyPicker
    from kvgate.routing.services import RoutingServices

    rng = random.Random(15)
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    config = parse_config(gateway_config(replay, silent_event_urls(ENDPOINTS)))
    fleet = Fleet(build_pool(p, config.routing) for p in config.pools)
    endpoints = fleet.endpoints
    services = RoutingServices.from_config(config.routing)
    services.index.add_endpoints(e.name for e in endpoints)
    # The default speculative TTL is the stall limit, 3 scrape intervals: 3 s at the default
    # interval, which this run raised so that its silent streams never count as stalled.
    precise = PreciseRouting(fleet, config, speculative_ttl=3.0)
    services.precise = precise
    picker = PolicyPicker(fleet, "p", builtin_policy("kvgate"), services)
    serving = asyncio.create_task(_answer_nothing_sent(router))
    precise.start()
    try:
        while precise.approximate_endpoints():  # noqa: ASYNC110 (no event to wait on)
            await asyncio.sleep(0.05)
        tokenizer = SimTokenizer()
        systems = [words(rng, 6_000) for _ in range(32)]
        tails = [words(rng, 2_000) for _ in range(50)]
        for i, system in enumerate(systems):  # each system prompt held by two engines
            held = {"messages": [{"role": "system", "content": system}]}
            ids = tokenizer.prompt_ids("chat", {**held, "add_generation_prompt": False})
            assert ids is not None
            for holder in (endpoints[(2 * i) % ENDPOINTS], endpoints[(2 * i + 1) % ENDPOINTS]):
                for event in _stored_runs(ids, rng):
                    precise.stored(holder.name, event)
        for endpoint in endpoints:
            filler = [rng.getrandbits(32) for _ in range(FILLER_BLOCKS * BLOCK)]
            for event in _stored_runs(filler, rng):
                precise.stored(endpoint.name, event)
        out["precise_index_blocks_total"] = sum(precise.index.blocks(e.name) for e in endpoints)
        gc.collect()
        gc.freeze()  # as the gateway does at startup

        def payload(i: int, system: str) -> dict[str, Any]:
            question = f"{i} " + tails[i % 50]
            return {
                "model": MODEL,
                "stream": True,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
            }

        kept: dict[str, deque[tuple[Any, ...]]] = {e.name: deque() for e in endpoints}

        def engine_caches(name: str, body: dict[str, Any]) -> None:
            """The chosen engine stores the prompt's blocks and evicts its oldest request's."""
            ids = tokenizer.prompt_ids("chat", body)
            assert ids is not None
            events = _stored_runs(ids[: (len(ids) - 1) // BLOCK * BLOCK], rng)
            for event in events:
                precise.stored(name, event)
            kept[name].append(tuple(h for event in events for h in event.block_hashes))
            if len(kept[name]) > KEPT_REQUESTS:
                precise.removed(name, BlockRemoved(kept[name].popleft()))

        decisions: list[float] = []
        tokenize_shared: list[float] = []
        tokenize_new: list[float] = []
        holders_found = 0
        for i in range(3_500):
            if i % 100 == 0:
                random_load(endpoints, rng)
            body = payload(i, systems[i % 32])
            ctx = request_context("chat", body, upstream_path="/")
            started = time.perf_counter()
            chosen = picker.choose(ctx)
            elapsed = (time.perf_counter() - started) * 1e6
            engine_caches(chosen.name, body)
            if i < 500:
                continue  # warm-up: the message memo and the vocabulary fill
            decisions.append(elapsed)
            exact = ctx.prefix.exact if ctx.prefix is not None else None
            holders_found += exact is not None and max(exact.held.values()) > 0
            asked = payload(i + 1_000_000, systems[i % 32])  # a known system, a new question
            started = time.perf_counter()
            tokenizer.prompt_ids("chat", asked)
            tokenize_shared.append((time.perf_counter() - started) * 1e6)
            if i % 10 == 0:
                fresh = payload(i, words(rng, 6_000))
                started = time.perf_counter()
                SimTokenizer().prompt_ids("chat", fresh)
                tokenize_new.append((time.perf_counter() - started) * 1e6)
        gc.unfreeze()
        out["precise_decision_8k_tokens_64_endpoints_us"] = p50_p99(decisions)
        out["precise_decisions_finding_a_holder"] = holders_found / len(decisions)
        out["sim_tokenize_8k_chat_shared_system_us"] = p50_p99(tokenize_shared)
        out["sim_tokenize_8k_chat_all_new_us"] = p50_p99(tokenize_new)
    finally:
        await precise.stop()
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        router.close(linger=0)
        context.term()


def _bytes_per_block(out: dict[str, Any]) -> None:
    from kvgate.routing.precise_index import PreciseIndex

    rng = random.Random(16)
    tokens = [rng.getrandbits(32) for _ in range(100_000 * BLOCK)]
    events = _stored_runs(tokens, rng)
    del tokens
    for holders in (1, 2):
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        index = PreciseIndex()
        for name in ("a", "b")[:holders]:
            index.add_endpoint(name)
            for event in events:
                index.stored(name, event)
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        out[f"precise_index_bytes_per_block_{holders}_holder"] = (after - before) / (
            holders * 100_000
        )
        del index


def micro() -> dict[str, Any]:
    out: dict[str, Any] = {}
    asyncio.run(_decisions(out))
    _bytes_per_block(out)
    return out


def summary(out: dict[str, Any]) -> str:
    """One paragraph for RESULTS.md from `micro()`'s output."""
    decision = out["precise_decision_8k_tokens_64_endpoints_us"]
    shared = out["sim_tokenize_8k_chat_shared_system_us"]
    new = out["sim_tokenize_8k_chat_all_new_us"]
    return (
        f"Precise decision (8k-token chat, 64 endpoints in precise mode, "
        f"{out['precise_index_blocks_total']:,} blocks indexed, tokenization included): "
        f"p50 {decision['p50']:.0f} / p99 {decision['p99']:.0f} µs; sim tokenization alone "
        f"p50 {shared['p50']:.0f} / p99 {shared['p99']:.0f} µs with a known system prompt, "
        f"p50 {new['p50']:.0f} / p99 {new['p99']:.0f} µs all new; precise index "
        f"{out['precise_index_bytes_per_block_1_holder']:.0f} B per block held by one endpoint, "
        f"{out['precise_index_bytes_per_block_2_holder']:.0f} B per (block, endpoint) when two "
        "hold it."
    )


if __name__ == "__main__":
    argparse.ArgumentParser(
        description="Precise-mode decision cost (in-process, about 20 s); also run by "
        "`routing.py --micro`."
    ).parse_args()
    result = micro()
    print(json.dumps(result, indent=1))
    print(summary(result))
