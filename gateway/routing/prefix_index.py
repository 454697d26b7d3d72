"""Approximate prefix-cache index: which endpoint probably holds which prompt prefix.

Prompts are cut into fixed blocks of `block_chars` UTF-8 bytes (64 by default, about 16 tokens)
and each full block gets a chained 64-bit hash that names the whole prefix up to its end:
`crc32` and `adler32` of the block, each continued from the previous block's value, so the pair
is a hash of the prefix computed at C speed, one call per block and no per-character Python.
The chain is seeded with the model and the tenant's cache salt, so tenants whose KV the engines
keep apart never appear to share a prefix. Hashes are deterministic across processes (no
`PYTHONHASHSEED`), which lets replicas exchange them.

Per endpoint the index keeps a bounded LRU of block hashes with a TTL. A request's blocks are
touched last-block-first, so a prefix's first blocks are the most recently used and the deepest
ones are evicted first, as engines free them; that keeps "holds block k" implying "holds every
block before k", which lets `match` binary-search the depth.

The update API is a stream of small events — `record(endpoint, hashes)`, `evict(endpoint,
hashes)`, `clear(endpoint)` — so that replicas can later share the index as deltas.
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

# Measured with tracemalloc for OrderedDict[int, float]: key int, float value, dict slot and
# the ordering link (see benchmarks/routing.py --micro).
BYTES_PER_ENTRY = 150


class PrefixHasher:
    """Chained block hashes of prompt text, at most `max_blocks` of them."""

    def __init__(self, block_chars: int = 64, max_blocks: int = 256) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be positive")
        self.block_chars = block_chars
        self.max_blocks = max_blocks

    def hashes(self, text: str, model: str, salt: str | None = None) -> list[int]:
        """Hashes of the full blocks of `text`; element k names the first k + 1 blocks."""
        size = self.block_chars
        # Only the first max_blocks blocks are hashed: encode no more characters than that
        # (a character is at least one byte, so this still covers every hashed block).
        data = text[: size * self.max_blocks].encode()
        count = min(len(data) // size, self.max_blocks)
        seed = f"{model}\x00{salt or ''}".encode()
        crc = zlib.crc32(seed)
        adler = zlib.adler32(seed)
        crc32, adler32 = zlib.crc32, zlib.adler32
        view = memoryview(data)
        out: list[int] = []
        append = out.append
        for start in range(0, count * size, size):
            block = view[start:start + size]
            crc = crc32(block, crc)
            adler = adler32(block, adler)
            append((crc << 32) | adler)
        return out


class EndpointBlocks:
    """Block hashes one endpoint probably holds: an LRU bounded by `capacity`, with a TTL."""

    __slots__ = ("_entries", "capacity", "evictions", "ttl")

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity = max(1, capacity)
        self.ttl = ttl
        self.evictions = 0
        self._entries: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def record(self, hashes: Sequence[int], now: float) -> None:
        """Touch `hashes` (deepest first, so the first blocks end most recent) and trim."""
        entries = self._entries
        for block_hash in reversed(hashes):
            if block_hash in entries:
                entries.move_to_end(block_hash)
            entries[block_hash] = now
        self._trim(now)

    def evict(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            self._entries.pop(block_hash, None)

    def clear(self) -> None:
        self._entries.clear()

    def resize(self, capacity: int, now: float) -> None:
        self.capacity = max(1, capacity)
        self._trim(now)

    def depth(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of `hashes` are held (binary search over the chain)."""
        entries = self._entries
        oldest = now - self.ttl
        if not hashes:
            return 0
        first = entries.get(hashes[0])
        if first is None or first < oldest:
            return 0  # the common case on a large fleet: one lookup, no search
        low, high = 1, len(hashes)
        while low < high:
            middle = (low + high + 1) // 2
            touched = entries.get(hashes[middle - 1])
            if touched is not None and touched >= oldest:
                low = middle
            else:
                high = middle - 1
        return low

    def _trim(self, now: float) -> None:
        entries = self._entries
        oldest = now - self.ttl
        while entries:
            block_hash, touched = next(iter(entries.items()))
            if len(entries) <= self.capacity and touched >= oldest:
                break
            del entries[block_hash]
            self.evictions += 1


class PrefixIndex:
    """Per-endpoint `EndpointBlocks`, created on first use with `default_capacity`."""

    def __init__(self, default_capacity: int = 31_250, ttl: float = 600.0,
                 max_capacity: int = 1_000_000) -> None:
        self.default_capacity = default_capacity
        self.max_capacity = max_capacity
        self.ttl = ttl
        self._blocks: dict[str, EndpointBlocks] = {}

    def _for(self, endpoint: str) -> EndpointBlocks:
        blocks = self._blocks.get(endpoint)
        if blocks is None:
            blocks = self._blocks[endpoint] = EndpointBlocks(self.default_capacity, self.ttl)
        return blocks

    def match(self, hashes: Sequence[int], endpoints: Iterable[str],
              now: float | None = None) -> dict[str, int]:
        """Matched leading blocks per endpoint (0 for endpoints holding none)."""
        if not hashes:
            return {name: 0 for name in endpoints}
        now = time.monotonic() if now is None else now
        blocks = self._blocks
        return {name: (blocks[name].depth(hashes, now) if name in blocks else 0)
                for name in endpoints}

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
