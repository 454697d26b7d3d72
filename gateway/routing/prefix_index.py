"""Approximate prefix-cache index: which endpoint probably holds which prompt prefix.

Prompts are cut into fixed blocks of `block_chars` UTF-8 bytes (64 by default, about 16 tokens)
and each full block gets a chained 64-bit hash that names the whole prefix up to its end:
`(offset + k) << 32 | crc` for block k, where `crc` is the CRC-32 of the block continued from
block k - 1's. The chain's seed is a 64-bit BLAKE2b of the model and the tenant's cache salt:
its low 32 bits start the CRC and its top 31 bits are `offset`. So element k names the first
k + 1 blocks, prefixes of different lengths under one seed never share a hash, prefixes of other
models or of tenants whose KV the engines keep apart meet only by a chance collision (below),
and the hashes are deterministic across processes (no `PYTHONHASHSEED`), which lets replicas
exchange them.

Why one CRC-32 per block and not 64 bits of checksum: hashing runs on every routing decision
and the CRC call is most of its cost; a second checksum per block (`adler32`, as before) makes
it about 20% slower for bits routing does not need. A probe for a prefix that an endpoint does
not hold hits falsely only if the endpoint holds another prefix with the same high word (the
same length and seed, or by rare coincidence another seed's offset plus length) and the same
32-bit CRC: probability n / 2**32, with n the number of entries with that high word. At the
`max_capacity` of one million entries that is at most 2.3e-4 (every entry one block long) and
about 1e-6 when they spread over 256 depths; and CRC-32 never confuses two prefixes that differ
in one run of up to 32 bits (an edited character or number). A false hit only overstates one
endpoint's cached prefix in one decision: the engine checks its cache by its own hashes, so no
answer changes. The blocks are cut by `struct` and hashed in one comprehension, with no
per-block slicing or function calls of our own.

Per endpoint the index keeps an LRU of block hashes (an `OrderedDict`, least recently touched
first) with the time each was last touched, bounded by a capacity, with a TTL. A request's
blocks are touched last-block-first, so a prefix's first blocks are the most recently used and
the deepest ones are evicted first, as engines free them; that keeps "holds block k" implying
"holds every block before k", which lets `match` binary-search the depth. Touching a block is
two C calls (set its time, move it to the end); with 64 endpoints holding thousands of blocks
each this is bound by memory access, and the alternatives measured worse: bulk C passes over the
hashes touch each entry's memory twice, and a plain dict reordered by pop and re-insert was a
fifth faster at the median but three times slower at p99 (its removed slots make the dict
rebuild itself every few dozen records). Trimming drops expired and over-capacity entries from
the front in one C loop.

The update API is a stream of small events — `record(endpoint, hashes)`, `evict(endpoint,
hashes)`, `clear(endpoint)` — so that replicas can later share the index as deltas.
"""

from __future__ import annotations

import hashlib
import math
import operator
import struct
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from itertools import compress, repeat, takewhile

# Measured with tracemalloc for OrderedDict[int, float]: key int, float value, dict slot and
# the ordering link (see benchmarks/routing.py --micro).
BYTES_PER_ENTRY = 150

_DEPTH = 1 << 32
_MISSING = -math.inf  # "touched" time of a hash an endpoint does not hold: older than any TTL


class PrefixHasher:
    """Chained block hashes of prompt text, at most `max_blocks` of them."""

    def __init__(self, block_chars: int = 64, max_blocks: int = 256) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be positive")
        if max_blocks > 1 << 31:
            raise ValueError("max_blocks must be below 2**31 (the depth takes 32 bits)")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._blocks = struct.Struct(f"{block_chars}s").iter_unpack

    def hashes(self, text: str, model: str, salt: str | None = None) -> list[int]:
        """Hashes of the full blocks of `text`; element k names the first k + 1 blocks."""
        size = self.block_chars
        # Only the first max_blocks blocks are hashed: encode no more characters than that
        # (a character is at least one byte, so this still covers every hashed block).
        data = text[: size * self.max_blocks].encode()
        count = min(len(data) // size, self.max_blocks)
        seed = int.from_bytes(hashlib.blake2b(f"{model}\x00{salt or ''}".encode(),
                                              digest_size=8).digest(), "little")
        crc = seed & 0xFFFFFFFF
        first = (seed >> 33) * _DEPTH
        crc32 = zlib.crc32
        return [depth | (crc := crc32(block, crc))
                for depth, (block,) in zip(range(first, first + count * _DEPTH, _DEPTH),
                                            self._blocks(memoryview(data)[: count * size]),
                                            strict=True)]


class EndpointBlocks:
    """Block hashes one endpoint probably holds, least recently touched first, with the time
    each was last touched: at most `capacity` of them, and those untouched for `ttl` never
    match (they are dropped on the next `record` after they expire)."""

    __slots__ = ("_entries", "_sweep_at", "capacity", "evictions", "ttl")

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity = max(1, capacity)
        self.ttl = ttl
        self.evictions = 0
        self._entries: OrderedDict[int, float] = OrderedDict()
        self._sweep_at = math.inf  # no entry expires before this time

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def record(self, hashes: Sequence[int], now: float) -> None:
        """Touch `hashes` (deepest first, so the first blocks end most recent) and trim."""
        entries = self._entries
        move_to_end = entries.move_to_end
        for block_hash in reversed(hashes):
            entries[block_hash] = now
            move_to_end(block_hash)
        if now + self.ttl < self._sweep_at:
            self._sweep_at = now + self.ttl
        if len(entries) > self.capacity or now >= self._sweep_at:
            self._trim(now)

    def evict(self, hashes: Iterable[int]) -> None:
        deque(map(self._entries.pop, hashes, repeat(None)), 0)

    def clear(self) -> None:
        self._entries.clear()
        self._sweep_at = math.inf

    def resize(self, capacity: int, now: float) -> None:
        self.capacity = max(1, capacity)
        if len(self._entries) > self.capacity:
            self._trim(now)

    def items(self) -> list[tuple[int, float]]:
        """(hash, last touched) pairs, least recently touched first."""
        return list(self._entries.items())

    def load(self, hashes: Sequence[int], touched: Sequence[float], now: float) -> None:
        """Touch `hashes`, oldest first, each at its own time in `touched` (a snapshot's
        `items()`, restored); then trim like `record`."""
        if not hashes:
            return
        entries = self._entries
        move_to_end = entries.move_to_end
        for block_hash, at in zip(hashes, touched, strict=True):
            entries[block_hash] = at
            move_to_end(block_hash)
        self._sweep_at = min(self._sweep_at, min(touched) + self.ttl)
        if len(entries) > self.capacity or now >= self._sweep_at:
            self._trim(now)

    def depth(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of `hashes` are held (binary search over the chain)."""
        entries = self._entries
        oldest = now - self.ttl
        if not hashes:
            return 0
        if entries.get(hashes[0], _MISSING) < oldest:
            return 0  # the common case on a large fleet: one lookup, no search
        if entries.get(hashes[-1], _MISSING) >= oldest:
            return len(hashes)  # the whole prompt is held: one more lookup, no search
        low, high = 1, len(hashes) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if entries.get(hashes[middle - 1], _MISSING) >= oldest:
                low = middle
            else:
                high = middle - 1
        return low

    def _trim(self, now: float) -> None:
        """Drop the oldest entries while they are expired or over capacity, in C loops."""
        entries = self._entries
        expired = len(list(takewhile(partial(operator.gt, now - self.ttl), entries.values())))
        drop = max(expired, len(entries) - self.capacity)
        if drop > 0:
            deque(map(entries.popitem, repeat(False, drop)), 0)
            self.evictions += drop
        self._sweep_at = next(iter(entries.values()), math.inf) + self.ttl


class PrefixIndex:
    """Per-endpoint `EndpointBlocks`, created on first use with `default_capacity`."""

    def __init__(self, default_capacity: int = 31_250, ttl: float = 600.0,
                 max_capacity: int = 1_000_000) -> None:
        self.default_capacity = default_capacity
        self.max_capacity = max_capacity
        self.ttl = ttl
        self._blocks: dict[str, EndpointBlocks] = {}
        self._tables: dict[str, OrderedDict[int, float]] = {}  # each EndpointBlocks' dict, by name

    def _for(self, endpoint: str) -> EndpointBlocks:
        blocks = self._blocks.get(endpoint)
        if blocks is None:
            blocks = self._blocks[endpoint] = EndpointBlocks(self.default_capacity, self.ttl)
            self._tables[endpoint] = blocks._entries
        return blocks

    def match(self, hashes: Sequence[int], endpoints: Iterable[str],
              now: float | None = None) -> dict[str, int]:
        """Matched leading blocks per endpoint (0 for endpoints holding none).

        One C-level pass looks the first block up on every endpoint. The first endpoint that
        holds it binary-searches its depth d; endpoints that share a prefix mostly hold the
        same d blocks (one system prompt), so two more passes check "holds block d - 1 and not
        block d" on the others, and only those that differ search."""
        names = list(endpoints)
        depths = dict.fromkeys(names, 0)
        if not hashes:
            return depths
        now = time.monotonic() if now is None else now
        oldest = now - self.ttl
        holders = list(compress(names, self._held(names, hashes[0], oldest)))
        if not holders:
            return depths
        blocks = self._blocks
        depth = depths[holders[0]] = blocks[holders[0]].depth(hashes, now)
        others = holders[1:]
        deeper = (self._held(others, hashes[depth], oldest) if depth < len(hashes)
                  else repeat(False, len(others)))
        for name, same, more in zip(others, self._held(others, hashes[depth - 1], oldest),
                                    deeper, strict=True):
            depths[name] = depth if same and not more else blocks[name].depth(hashes, now)
        return depths

    def _held(self, names: list[str], block_hash: int, oldest: float) -> Iterator[bool]:
        """Whether each endpoint holds `block_hash`, touched at `oldest` or later (C loops)."""
        touched = map(dict.get, map(self._tables.get, names, repeat({})),
                      repeat(block_hash), repeat(_MISSING))
        return map(partial(operator.le, oldest), touched)

    def record(self, endpoint: str, hashes: Sequence[int], now: float | None = None) -> None:
        """`endpoint` now holds the prefix `hashes` (a routing decision or an engine event)."""
        if hashes:
            self._for(endpoint).record(hashes, time.monotonic() if now is None else now)

    def evict(self, endpoint: str, hashes: Iterable[int]) -> None:
        """`endpoint` no longer holds these blocks (an engine's BlockRemoved event)."""
        blocks = self._blocks.get(endpoint)
        if blocks is not None:
            blocks.evict(hashes)

    def clear(self, endpoint: str) -> None:
        """`endpoint` holds nothing any more (restart, AllBlocksCleared)."""
        blocks = self._blocks.get(endpoint)
        if blocks is not None:
            blocks.clear()

    def set_capacity(self, endpoint: str, capacity: int) -> None:
        """Bound `endpoint`'s entries (from the engine's KV size), capped at `max_capacity`."""
        self._for(endpoint).resize(min(capacity, self.max_capacity), time.monotonic())

    def capacity(self, endpoint: str) -> int:
        return self._for(endpoint).capacity

    def entries(self, endpoint: str | None = None) -> int:
        if endpoint is not None:
            blocks = self._blocks.get(endpoint)
            return len(blocks) if blocks is not None else 0
        return sum(len(b) for b in self._blocks.values())

    def evictions(self, endpoint: str) -> int:
        blocks = self._blocks.get(endpoint)
        return blocks.evictions if blocks is not None else 0

    @property
    def memory_bytes(self) -> int:
        """Estimated memory held by the index (entries x measured bytes per entry)."""
        return self.entries() * BYTES_PER_ENTRY
