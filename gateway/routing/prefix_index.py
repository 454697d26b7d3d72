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
from itertools import compress, repeat

# Measured with tracemalloc (benchmarks/routing.py --micro): an entry is a dict slot, its int
# key and its share of the float its record stored; a listed first block is an ordered-map
# node, its key and the small dict of endpoints recorded for it.
BYTES_PER_ENTRY = 90
BYTES_PER_ROOT = 250

_DEPTH = 1 << 32
_MISSING = -math.inf  # "touched" time of a hash an endpoint does not hold: older than any TTL


class PrefixHasher:
    """Chained block hashes of prompt text, at most `max_blocks` of them.

    The last `recent` prompts' hashed bytes and hashes are kept, by seed and first block: a
    prompt that starts like one of them (the next turn of a conversation, another question
    under the same system prompt) reuses the hashes of the blocks they share, found by
    comparing bytes (memcmp), and hashes only the rest. The hashes are the same either way."""

    def __init__(self, block_chars: int = 64, max_blocks: int = 256, recent: int = 128) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be positive")
        if max_blocks > 1 << 31:
            raise ValueError("max_blocks must be below 2**31 (the depth takes 32 bits)")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.recent = recent
        self._blocks = struct.Struct(f"{block_chars}s").iter_unpack
        self._recent: OrderedDict[tuple[int, bytes], tuple[bytes, list[int]]] = OrderedDict()

    def hashes(self, text: str, model: str, salt: str | None = None) -> list[int]:
        """Hashes of the full blocks of `text`; element k names the first k + 1 blocks."""
        size = self.block_chars
        # Only the first max_blocks blocks are hashed: encode no more characters than that
        # (a character is at least one byte, so this still covers every hashed block).
        data = text[: size * self.max_blocks].encode()
        count = min(len(data) // size, self.max_blocks)
        if not count:
            return []
        data = data[: count * size]
        seed = int.from_bytes(hashlib.blake2b(f"{model}\x00{salt or ''}".encode(),
                                              digest_size=8).digest(), "little")
        if not self.recent:
            return self._chain(data, seed, [])
        key = (seed, data[:size])
        seen = self._recent.get(key)
        if seen is None:
            hashes = self._chain(data, seed, [])
        else:
            before, known = seen
            shared = _shared_blocks(data, before, size)
            hashes = known if shared == count == len(known) else self._chain(
                data, seed, known[:shared])
            self._recent.move_to_end(key)
        self._recent[key] = (data, hashes)
        if len(self._recent) > self.recent:
            self._recent.popitem(last=False)
        return hashes

    def _chain(self, data: bytes, seed: int, known: list[int]) -> list[int]:
        """`known` (the hashes of data's first blocks) extended to every block of `data`."""
        size = self.block_chars
        done = len(known)
        count = len(data) // size
        first = ((seed >> 33) + done) * _DEPTH
        crc = known[-1] & 0xFFFFFFFF if known else seed & 0xFFFFFFFF
        crc32 = zlib.crc32
        known += [depth | (crc := crc32(block, crc))
                  for depth, (block,) in zip(range(first, first + (count - done) * _DEPTH,
                                                   _DEPTH),
                                              self._blocks(memoryview(data)[done * size:]),
                                              strict=True)]
        return known


def _shared_blocks(data: bytes, other: bytes, size: int) -> int:
    """How many leading `size`-byte blocks `data` and `other` have in common (C comparisons:
    one when one extends the other, else a binary search)."""
    blocks = min(len(data), len(other)) // size
    if data[: blocks * size] == other[: blocks * size]:
        return blocks
    low, high = 0, blocks - 1  # the answer lies in low .. high
    while low < high:
        middle = (low + high + 1) // 2
        if data[: middle * size] == other[: middle * size]:
            low = middle
        else:
            high = middle - 1
    return low


class EndpointBlocks:
    """Block hashes one endpoint probably holds, with the time each was last touched, in two
    generations: a touch puts its hashes in `young` (and takes them out of `old`); when `young`
    has no room for a record it becomes `old` and the previous `old` retires. So at most
    `capacity` hashes are held, once full at least about half of it (the most recently
    touched), and hashes untouched for `ttl` never match.

    Retired hashes are freed a few per record (as many as the record added, so a generation is
    gone before the next one retires): no record pays for freeing half the capacity at once.
    """

    __slots__ = ("_generation", "_old_touched", "_retiring", "_young_touched", "capacity",
                 "evictions", "old", "ttl", "young")

    def __init__(self, capacity: int, ttl: float) -> None:
        self.ttl = ttl
        self.evictions = 0
        self.young: dict[int, float] = {}
        self.old: dict[int, float] = {}
        self._retiring: dict[int, float] = {}
        self._young_touched = self._old_touched = _MISSING  # newest touch in each generation
        self.capacity = self._generation = 1
        self._set_capacity(capacity)

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.young or block_hash in self.old

    @property
    def stored(self) -> int:
        """Entries in memory: those held and those of a retired generation not freed yet."""
        return len(self.young) + len(self.old) + len(self._retiring)

    def record(self, hashes: Sequence[int], now: float) -> None:
        """Touch `hashes` (a chain, shallowest first) at `now`."""
        self._touch(hashes, repeat(now), now)

    def load(self, hashes: Sequence[int], touched: Sequence[float], now: float) -> None:
        """Touch `hashes`, oldest first, each at its own time in `touched` (a snapshot's
        `items()`, restored); expired ones and those beyond the capacity are not kept."""
        oldest = now - self.ttl
        fresh = [(h, at) for h, at in zip(hashes, touched, strict=True) if at >= oldest]
        fresh = fresh[len(fresh) - self.capacity:] if len(fresh) > self.capacity else fresh
        self.evictions += len(hashes) - len(fresh)
        step = max(1, self._generation // 2)
        for start in range(0, len(fresh), step):
            chunk = fresh[start:start + step]
            self._touch([h for h, _ in chunk], (at for _, at in chunk), max(at for _, at in chunk))

    def _touch(self, hashes: Sequence[int], times: Iterable[float], newest: float) -> None:
        if len(hashes) > self.capacity:
            hashes = hashes[: self.capacity]  # the shallowest blocks: still a held prefix
        young, old = self.young, self.old
        oldest = newest - self.ttl
        if old and self._old_touched < oldest:
            self._retire_old()  # every hash in it expired
            old = self.old
        if (len(young) + len(hashes) > self._generation
                or len(young) + len(old) + len(hashes) > self.capacity
                or self._young_touched < oldest):
            self._rotate()
            young, old = self.young, self.old
            if len(old) + len(hashes) > self.capacity or self._old_touched < oldest:
                self._retire_old()
                old = self.old
        size = len(young)
        young.update(zip(hashes, times, strict=False))
        if old:
            deque(map(old.pop, hashes, repeat(None)), 0)
        if newest > self._young_touched:
            self._young_touched = newest
        retiring = self._retiring
        if retiring:
            count = min(len(retiring), len(young) - size + 1)
            deque(map(dict.popitem, repeat(retiring, count)), 0)

    def _rotate(self) -> None:
        """`young` becomes `old`; the previous `old` retires."""
        self._retire_old()
        self.old, self.young = self.young, {}
        self._old_touched, self._young_touched = self._young_touched, _MISSING

    def _retire_old(self) -> None:
        old = self.old
        if not old:
            return
        self.evictions += len(old)
        if self._retiring:
            self._retiring.clear()  # only when generations retire back to back (resize, TTL)
        self._retiring, self.old = old, {}
        self._old_touched = _MISSING

    def evict(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            if self.young.pop(block_hash, None) is None:
                self.old.pop(block_hash, None)

    def clear(self) -> None:
        self.young.clear()
        self.old.clear()
        self._retiring.clear()
        self._young_touched = self._old_touched = _MISSING

    def resize(self, capacity: int, now: float) -> None:
        self._set_capacity(capacity)

    def _set_capacity(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._generation = max(1, self.capacity // 2)
        if len(self) > self.capacity:
            self._retire_old()
        excess = len(self.young) - self.capacity
        if excess > 0:  # the newest entries go: each chain's deepest blocks were added last
            deque(map(dict.popitem, repeat(self.young, excess)), 0)
            self.evictions += excess

    def items(self) -> list[tuple[int, float]]:
        """(hash, last touched) pairs, the older generation first."""
        return [*self.old.items(), *self.young.items()]

    def touched(self, block_hash: int) -> float:
        """When `block_hash` was last touched (minus infinity if it is not held)."""
        at = self.young.get(block_hash, _MISSING)
        return at if at != _MISSING else self.old.get(block_hash, _MISSING)

    def depth(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of `hashes` are held (binary search over the chain)."""
        if not hashes:
            return 0
        oldest = now - self.ttl
        touched = self.touched
        if touched(hashes[0]) < oldest:
            return 0  # the common case on a large fleet: one lookup, no search
        if touched(hashes[-1]) >= oldest:
            return len(hashes)  # the whole prompt is held: one more lookup, no search
        low, high = 1, len(hashes) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if touched(hashes[middle - 1]) >= oldest:
                low = middle
            else:
                high = middle - 1
        return low


_NOTHING_HELD = EndpointBlocks(1, 0.0)  # read (never written) for endpoints with no entries
_YOUNG = operator.attrgetter("young")
_OLD = operator.attrgetter("old")


def _held(tables: list[EndpointBlocks], block_hash: int, oldest: float) -> Iterator[bool]:
    """Whether each endpoint holds `block_hash`, touched at `oldest` or later (C loops over
    both generations)."""
    young = map(dict.get, map(_YOUNG, tables), repeat(block_hash), repeat(_MISSING))
    old = map(dict.get, map(_OLD, tables), repeat(block_hash), repeat(_MISSING))
    return map(partial(operator.le, oldest), map(max, young, old))


class PrefixIndex:
    """Per-endpoint `EndpointBlocks`, created on first use with `default_capacity`, and a map
    from each recently recorded chain's first block to the endpoints it was recorded on.

    That map lets `match` look only at the endpoints that may hold a prompt's first block
    instead of at every endpoint: for a prompt nobody holds, one lookup. It is a superset of
    the holders (an endpoint that evicted the block stays listed until `match` sees that) and
    keeps the last `max_roots` first blocks. When one is dropped while possibly still held,
    or entries arrive from a snapshot (whose chains are not known), the map is incomplete until
    those entries expire (`ttl`), and `match` looks at every endpoint meanwhile.
    """

    def __init__(self, default_capacity: int = 31_250, ttl: float = 600.0,
                 max_capacity: int = 1_000_000, max_roots: int = 16_384) -> None:
        self.default_capacity = default_capacity
        self.max_capacity = max_capacity
        self.ttl = ttl
        self.max_roots = max_roots
        self._blocks: dict[str, EndpointBlocks] = {}
        self._roots: OrderedDict[int, dict[str, EndpointBlocks]] = OrderedDict()
        self._incomplete_until = -math.inf  # until then an endpoint may hold an unlisted root

    def _for(self, endpoint: str) -> EndpointBlocks:
        blocks = self._blocks.get(endpoint)
        if blocks is None:
            blocks = self._blocks[endpoint] = EndpointBlocks(self.default_capacity, self.ttl)
        return blocks

    def match(self, hashes: Sequence[int], now: float | None = None) -> dict[str, int]:
        """Matched leading blocks of `hashes` on every endpoint that holds the first one.

        The endpoints listed for the first block (or, while that list may be incomplete,
        every endpoint) are checked for it in one C-level pass. The first that holds it
        binary-searches its depth d; endpoints that share a prefix mostly hold the same d
        blocks (one system prompt), so two more passes check "holds block d - 1 and not block
        d" on the others, and only those that differ search."""
        if not hashes:
            return {}
        now = time.monotonic() if now is None else now
        oldest = now - self.ttl
        listed = self._roots.get(hashes[0])
        if now < self._incomplete_until:
            names, tables = list(self._blocks), list(self._blocks.values())
        elif listed is None:
            return {}
        else:
            names, tables = list(listed), list(listed.values())
        first = list(_held(tables, hashes[0], oldest))
        if listed is not None and not all(first):
            for name, held in zip(names, first, strict=True):
                if not held:
                    listed.pop(name, None)  # evicted or expired there: forget it
        holders = list(compress(names, first))
        if not holders:
            return {}
        tables = list(compress(tables, first))
        depth = tables[0].depth(hashes, now)
        depths = dict.fromkeys(holders, depth)
        others = tables[1:]
        deeper = (_held(others, hashes[depth], oldest) if depth < len(hashes)
                  else repeat(False, len(others)))
        for name, blocks, same, more in zip(holders[1:], others,
                                            _held(others, hashes[depth - 1], oldest), deeper,
                                            strict=True):
            if not same or more:
                depths[name] = blocks.depth(hashes, now)
        return depths

    def record(self, endpoint: str, hashes: Sequence[int], now: float | None = None) -> None:
        """`endpoint` now holds the prefix `hashes` (a routing decision or an engine event)."""
        if not hashes:
            return
        now = time.monotonic() if now is None else now
        blocks = self._for(endpoint)
        blocks.record(hashes, now)
        roots = self._roots
        listed = roots.get(hashes[0])
        if listed is None:
            listed = roots[hashes[0]] = {}
            if len(roots) > self.max_roots:
                roots.popitem(last=False)
                self._incomplete_until = now + self.ttl
        else:
            roots.move_to_end(hashes[0])
        listed[endpoint] = blocks

    def load(self, endpoint: str, hashes: Sequence[int], touched: Sequence[float],
             now: float) -> None:
        """Restore `endpoint`'s entries from a snapshot (`EndpointBlocks.load`)."""
        self._for(endpoint).load(hashes, touched, now)
        if hashes:
            self._incomplete_until = max(self._incomplete_until, max(touched) + self.ttl)

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

    def stored(self) -> int:
        """Entries in memory, held or retired and not freed yet (see `EndpointBlocks`)."""
        return sum(b.stored for b in self._blocks.values())

    def evictions(self, endpoint: str) -> int:
        blocks = self._blocks.get(endpoint)
        return blocks.evictions if blocks is not None else 0

    @property
    def memory_bytes(self) -> int:
        """Estimated memory held by the index (stored entries and listed first blocks, times
        their measured sizes)."""
        return self.stored() * BYTES_PER_ENTRY + self.roots * BYTES_PER_ROOT

    @property
    def roots(self) -> int:
        """First blocks listed with the endpoints they were recorded on."""
        return len(self._roots)
