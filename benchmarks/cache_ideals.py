"""What no router can beat: prefix-cache hit rates computed offline from a workload's requests.

Prompts are rendered and tokenized exactly as the simulated engines do (`kvgate.sim`'s chat
template and tokenizer) and cut into the engine's chained blocks of `block_size` tokens, so the
rates compare with `usage.prompt_tokens_details.cached_tokens` over `prompt_tokens`. As in the
engine, a prompt's hit is its longest run of leading blocks found in the cache, excluding the
block holding its last token (at least one token is always computed); requests are taken in
arrival order, each seeing every earlier one complete (no request in flight holds memory).

The same pass gives a floor under time to first token: each request's own prefill of what even
the infinite cache misses, on an engine that does nothing else (the simulator's step cost,
chunked at `max_num_batched_tokens`). Every schedule's TTFT for that request is at least this,
so every percentile of a router's TTFT is at least the same percentile of the floors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvgate.sim.kv_cache import extend_block_hashes
from kvgate.sim.options import BLOCK_SIZE, PROFILES, EngineOptions, TimingProfile
from kvgate.sim_chat_template import render_chat
from kvgate.sim_tokenizer import tokenize


@dataclass(frozen=True, slots=True)
class CacheIdeals:
    infinite_hit: float  # every block ever seen is a hit when seen again
    fleet_lru_hit: float  # one LRU cache as large as the fleet's whole KV memory
    reused_blocks: int  # distinct blocks hit at least once with an infinite cache
    prompt_tokens: int
    # Each request's prefill of the tokens the infinite cache misses, alone on its engine (s).
    ttft_floors: tuple[float, ...] = ()

    def ttft_floor(self, q: float) -> float:
        """The q-quantile (nearest rank) of the requests' TTFT floors: no schedule's TTFT
        quantile q is lower."""
        ordered = sorted(self.ttft_floors)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def prefill_seconds(
    tokens: int, speed: float, chunk_tokens: int, timing: TimingProfile = PROFILES["realistic"]
) -> float:
    """A simulated engine's time to prefill `tokens` with nothing else in its steps: one step
    per `chunk_tokens` (the fixed step cost each) plus the per-token cost, over `speed`."""
    steps = -(-tokens // chunk_tokens)
    return (steps * timing.step_seconds + tokens * timing.prefill_token_seconds) / speed


def prompt_blocks(body: dict[str, Any], block_size: int = BLOCK_SIZE) -> tuple[list[int], int]:
    """The chained hashes of a chat request's full prompt blocks, and its prompt tokens."""
    prompt = render_chat(body["messages"], add_generation_prompt=True, continue_final_message=False)
    tokens = tokenize(prompt)
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, len(tokens), block_size, None)
    return hashes, len(tokens)


def cache_ideals(
    bodies: list[dict[str, Any]],
    capacity_blocks: int,
    block_size: int = BLOCK_SIZE,
    speed: float = 1.0,
    chunk_tokens: int = EngineOptions.max_num_batched_tokens,
) -> CacheIdeals:
    """Hit rates of an infinite cache and of one LRU cache of `capacity_blocks` blocks over
    `bodies` (chat requests in arrival order), and each request's TTFT floor on engines of
    `speed` prefilling at most `chunk_tokens` a step. The LRU cache touches a prompt's blocks
    last to first, so a prompt's head outlives its tail, as when an engine frees a sequence's
    blocks tail first."""
    seen: set[int] = set()
    reused: set[int] = set()
    lru: OrderedDict[int, None] = OrderedDict()
    infinite = bounded = total = 0
    floors: list[float] = []
    for body in bodies:
        hashes, tokens = prompt_blocks(body, block_size)
        total += tokens
        lookable = hashes[: (tokens - 1) // block_size]
        depth = 0
        while depth < len(lookable) and lookable[depth] in seen:
            depth += 1
        infinite += depth * block_size
        floors.append(prefill_seconds(tokens - depth * block_size, speed, chunk_tokens))
        reused.update(lookable[:depth])
        seen.update(hashes)
        depth = 0
        while depth < len(lookable) and lookable[depth] in lru:
            depth += 1
        bounded += depth * block_size
        for block_hash in reversed(hashes):
            lru[block_hash] = None
            lru.move_to_end(block_hash)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return CacheIdeals(
        infinite_hit=infinite / total if total else 0.0,
        fleet_lru_hit=bounded / total if total else 0.0,
        reused_blocks=len(reused),
        prompt_tokens=total,
        ttft_floors=tuple(floors),
    )
