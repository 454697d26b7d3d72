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
answer changes. The blocks are cut by one `struct` call and hashed in one comprehension, with no
per-block slicing or function calls of our own.

Hashing is lazy (`PrefixHasher.chain`): the first block is hashed at once — it finds the
endpoints that may hold the prompt — and the rest when something needs it. A prompt nobody
holds is recorded as a leaf that keeps its bytes; a later prompt that starts like it is
compared with it by bytes (memcmp), so a conversation that only grows, or a prompt never seen
again, is never hashed past its first block. The rest is hashed when a later prompt shares a
part of it and then leaves it (the shared blocks become entries of their own), or when a
replica needs the hashes (`SharedPrefixIndex` hashes every prompt it records).

Per endpoint the index keeps an LRU of block hashes (an `OrderedDict`, least recently touched
first) with the time each was last touched, bounded by a capacity in blocks, with a TTL, shaped
as a prefix tree (`EndpointBlocks`): blocks that two recorded chains share are entries of their
own, and the rest of a chain is one entry, a leaf holding its hashes in an array. A request's
blocks are touched last-block-first, so a prefix's first blocks are the most recently used and
the deepest ones are evicted first, as engines free them; that keeps "holds block k" implying
"holds every block before k", which lets `match` binary-search the depth among the entries and
then compare the chain in a leaf (element k of two chains is equal only if every element
before it is). Why leaves: an entry per block costs one touch and later one eviction per
block, and with 64 endpoints holding 31,250 blocks each nearly every touch misses the CPU's
caches — about 150 µs for a 256-block prompt nobody shares, whatever the structure (an
`OrderedDict`, a plain dict reordered by pop and re-insert, a dict with a queue of records all
measured 100 to 150 µs); a leaf is one entry for the whole prompt. Only blocks that turn out to be
shared are ever touched one by one. Leaves also hold 8 bytes a block instead of ≈ 200 and give
the garbage collector nothing to walk. The tree answers exactly as an LRU of single blocks
would (tested against one). Generations of plain dicts, measured before, forgot
prefixes the engines still held (hit rates fell by a tenth in `benchmarks/routing.py`). For
each recorded chain's first block the index lists the endpoints it went to, so `match` asks
only those (see `PrefixIndex`).

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
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from heapq import heapify, heappop, heappush, heapreplace
from itertools import compress, repeat
from typing import overload

# Measured with tracemalloc (benchmarks/routing.py --micro): a single-block entry is an
# ordered-dict slot and link and its int key (140-210 B with the table's fill; the float is
# shared by a record); a leaf adds its float object and array header to that, and 8 B a block;
# a leaf that keeps its prompt's bytes (a `PromptChain`) holds 64 B a block instead;
# a listed first block is an ordered-map node, its key and the small dict of its endpoints.
BYTES_PER_ENTRY = 200
BYTES_PER_LEAF = 330
BYTES_PER_LEAF_BLOCK = 8
BYTES_PER_TEXT_BLOCK = 64
BYTES_PER_ROOT = 310

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
        # One struct per block count: cuts `count` blocks in one C call (bytes objects).
        self._cutters: dict[int, Callable[[bytes, int], tuple[bytes, ...]]] = {}
        self._recent: OrderedDict[tuple[int, bytes], tuple[bytes, PromptChain]] = OrderedDict()

    def hashes(self, text: str, model: str, salt: str | None = None) -> list[int]:
        """Hashes of the full blocks of `text`; element k names the first k + 1 blocks."""
        return self.chain(text, model, salt).hashes()

    def chain(self, text: str, model: str, salt: str | None = None) -> PromptChain:
        """The same hashes as `hashes`, computed when first needed past the first block: a
        prompt nobody holds is routed and recorded on its first block alone."""
        size = self.block_chars
        # Only the first max_blocks blocks are hashed: encode no more characters than that
        # (a character is at least one byte, so this still covers every hashed block).
        data = text[: size * self.max_blocks].encode()
        count = min(len(data) // size, self.max_blocks)
        data = data[: count * size]
        seed = int.from_bytes(
            hashlib.blake2b(f"{model}\x00{salt or ''}".encode(), digest_size=8).digest(), "little"
        )
        if not count or not self.recent:
            return PromptChain(self, data, seed, [])
        key = (seed, data[:size])
        seen = self._recent.get(key)
        if seen is None:
            chain = PromptChain(self, data, seed, [])
        else:
            before, known = seen
            shared = _shared_blocks(data, before, size)
            chain = (
                known
                if shared == count == len(known)
                else PromptChain(self, data, seed, known.prefix(shared))
            )
            self._recent.move_to_end(key)
        self._recent[key] = (data, chain)
        if len(self._recent) > self.recent:
            self._recent.popitem(last=False)
        return chain

    def _chain(self, data: bytes, seed: int, known: list[int]) -> list[int]:
        """`known` (the hashes of data's first blocks) extended to every block of `data`."""
        size = self.block_chars
        done = len(known)
        count = len(data) // size
        first = ((seed >> 33) + done) * _DEPTH
        crc = known[-1] & 0xFFFFFFFF if known else seed & 0xFFFFFFFF
        cut = self._cutters.get(count - done)
        if cut is None:
            cut = self._cutters[count - done] = struct.Struct(
                f"{size}s" * (count - done)
            ).unpack_from
        crc32 = zlib.crc32
        known += [
            depth | (crc := crc32(block, crc))
            for depth, block in zip(
                range(first, first + (count - done) * _DEPTH, _DEPTH),
                cut(data, done * size),
                strict=True,
            )
        ]
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


class PromptChain(Sequence[int]):
    """A prompt's chained block hashes (`PrefixHasher.chain`), hashed when something first
    needs one past the first block; until then it keeps the prompt's bytes. Slicing from the
    start keeps it unhashed; a leaf that holds it compares it with another unhashed chain by
    their bytes (`_common_prefix`), so a prompt that is only ever extended or repeated, or never
    seen again, is never hashed past its first block."""

    __slots__ = ("_hasher", "_hashes", "_known", "_seed", "data", "first")

    def __init__(self, hasher: PrefixHasher, data: bytes, seed: int, known: list[int]) -> None:
        self._hasher = hasher
        self.data = data
        self._seed = seed
        self._hashes: list[int] | None = None
        if not known and data:
            known = hasher._chain(data[: hasher.block_chars], seed, [])
        self._known = known  # the hashes of the first blocks, at least the first
        self.first = known[0] if known else -1

    def __len__(self) -> int:
        return len(self.data) // self._hasher.block_chars

    @property
    def block_chars(self) -> int:
        return self._hasher.block_chars

    @property
    def hashed(self) -> bool:
        return self._hashes is not None

    def hashes(self) -> list[int]:
        """Every block's hash (hashing the rest now, once)."""
        if self._hashes is None:
            self._hashes = self.peek()
        return self._hashes

    def peek(self) -> list[int]:
        """Every block's hash, leaving the chain as it was (hashed or not)."""
        if self._hashes is not None:
            return self._hashes
        known = self._known
        if len(known) == len(self):
            return known
        return self._hasher._chain(self.data, self._seed, list(known))

    def prefix(self, count: int) -> list[int]:
        """The first `count` hashes, hashing no further than that."""
        if self._hashes is not None:
            return self._hashes[:count]
        if len(self._known) < count:
            self._known = self._hasher._chain(
                self.data[: count * self._hasher.block_chars], self._seed, list(self._known)
            )
        return self._known[:count]

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if type(index) is int:
            return self.first if index == 0 else self.hashes()[index]
        assert isinstance(index, slice)
        start, stop, step = index.indices(len(self))
        if self._hashes is None and start == 0 and step == 1:
            if stop == len(self):
                return self
            if stop <= 0:
                return []
            # The first `stop` blocks, still unhashed.
            return PromptChain(
                self._hasher,
                self.data[: stop * self._hasher.block_chars],
                self._seed,
                self._known[:stop],
            )
        return self.hashes()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.hashes())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.hashes())


def hashed(hashes: Sequence[int]) -> Sequence[int]:
    """`hashes` with every hash computed (a `PromptChain`'s list)."""
    return hashes.hashes() if type(hashes) is PromptChain else hashes


def _leaf_chain(hashes: Sequence[int]) -> array[int] | PromptChain:
    """What a leaf keeps: an unhashed prompt chain as it is, hashes in an array."""
    if type(hashes) is array:
        return hashes
    if type(hashes) is PromptChain and not hashes.hashed:
        return hashes
    return array("Q", hashed(hashes))


class _Leaf(float):
    """The blocks of one chain from its first unshared block on, as one entry: the time they
    were last touched (the float value, so the entry compares like any other) and their hashes
    in an array (`hashes[0]` is the entry's key): 8 bytes a block, and nothing for the garbage
    collector to walk; or the unhashed `PromptChain` of a prompt nobody else had."""

    __slots__ = ("hashes",)
    hashes: array[int] | PromptChain

    def __new__(cls, touched: float, hashes: array[int] | PromptChain) -> _Leaf:
        leaf = super().__new__(cls, touched)
        leaf.hashes = hashes
        return leaf


_is_leaf = partial(operator.is_, _Leaf)


class EndpointBlocks:
    """Block hashes one endpoint probably holds, least recently touched first, with the time
    each was last touched: at most `capacity` blocks, and those untouched for `ttl` never
    match (they are dropped on the next `record` after they expire).

    A prefix tree in an `OrderedDict`: a block that two recorded chains share is an entry of
    its own (an inner node), and the rest of a chain, from its first block nobody else has, is
    one entry, a `_Leaf`, keyed by that block. A prompt nobody shares costs one entry, not one
    per block; a leaf splits when a later chain turns or stops inside it (the shared blocks become
    single entries; the untouched rest keeps its time and, through a heap of displaced
    leaves, its place in the eviction order) and grows when a chain goes on from its end (the
    next turn of a conversation). A block inside a leaf is never a key of its own."""

    __slots__ = (
        "_displaced",
        "_entries",
        "_in_leaves",
        "_leaves",
        "_sweep_at",
        "_unhashed",
        "capacity",
        "evictions",
        "ttl",
    )

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity = max(1, capacity)
        self.ttl = ttl
        self.evictions = 0
        self._entries: OrderedDict[int, float] = OrderedDict()  # or a _Leaf for several blocks
        self._leaves = 0
        self._in_leaves = 0  # blocks in leaves, their keys included
        self._unhashed = 0  # of those, blocks in leaves that keep a prompt's bytes
        self._displaced: list[tuple[float, int, _Leaf]] = []  # a heap: leaves out of order
        self._sweep_at = math.inf  # no entry expires before this time

    def __len__(self) -> int:
        """Blocks held (what the capacity bounds)."""
        return len(self._entries) - self._leaves + self._in_leaves

    def holds_start(self, block_hash: int) -> bool:
        """Whether a chain starting with this block is held (a chain's first block is always
        an entry of its own)."""
        return block_hash in self._entries

    def sizes(self) -> tuple[int, int, int]:
        """(single-block entries, leaves, blocks in leaves)."""
        return len(self._entries) - self._leaves, self._leaves, self._in_leaves

    @property
    def unhashed(self) -> int:
        """Blocks in leaves that keep their prompt's bytes (64 bytes a block, not 8)."""
        return self._unhashed

    def record(self, hashes: Sequence[int], now: float) -> None:
        """`hashes` were all touched now: the blocks this endpoint held already are touched
        (deepest first, so the first blocks end most recent), the rest becomes a leaf, older
        than the blocks before it; then trim."""
        entries = self._entries
        held = self._keys_held(hashes, now)
        inner = held  # hashes[:inner] become (or stay) single entries, hashes[inner:] a leaf
        if held:
            leaf = entries[hashes[held - 1]]
            if type(leaf) is _Leaf:
                start = held - 1
                self._drop(hashes[start])
                shared = _common_prefix(leaf.hashes, hashes, start)
                if shared == len(leaf.hashes):  # the chain goes on from the leaf's end
                    inner = start
                else:  # it stops or turns inside: the shared blocks become single entries
                    hashes = hashed(hashes)
                    self._add_rest(leaf.hashes[shared:], float(leaf))
                    inner = start + shared
                    for block_hash in hashes[start + 1 : inner]:
                        self._drop(block_hash)  # a stale key (after `evict`), if any
        if inner < len(hashes):
            self._add_leaf(hashes[inner:], now)
        move_to_end = entries.move_to_end
        for block_hash in reversed(hashes[:inner]):
            entries[block_hash] = now
            move_to_end(block_hash)
        if now + self.ttl < self._sweep_at:
            self._sweep_at = now + self.ttl
        if len(self) > self.capacity or now >= self._sweep_at:
            self._trim(now)

    def _add_leaf(self, hashes: Sequence[int], touched: float) -> None:
        chain = _leaf_chain(hashes)
        self._drop(chain[0])
        leaf = self._entries[chain[0]] = _Leaf(touched, chain)
        self._count(leaf, 1)

    def _count(self, leaf: _Leaf, sign: int) -> None:
        """A leaf comes in (sign 1) or goes (-1)."""
        blocks = sign * len(leaf.hashes)
        self._leaves += sign
        self._in_leaves += blocks
        if type(leaf.hashes) is PromptChain:
            self._unhashed += blocks

    def _add_rest(self, hashes: Sequence[int], touched: float) -> None:
        """The untouched rest of a split leaf: it keeps its older time, and the heap of
        displaced leaves keeps its place in the eviction order (it goes in behind newer
        entries). The heap holds live leaves and stale ones (refreshed or gone since); it is
        rebuilt when the stale ones outnumber the leaves."""
        self._add_leaf(hashes, touched)
        displaced = self._displaced
        heappush(displaced, (touched, hashes[0], self._entries[hashes[0]]))
        if len(displaced) > 2 * self._leaves + 64:
            entries = self._entries
            self._displaced = [d for d in displaced if entries.get(d[1]) is d[2]]
            heapify(self._displaced)

    def _drop(self, key: int) -> None:
        """Remove the entry `key`, if any (a stale one where a new one goes)."""
        value = self._entries.pop(key, None)
        if type(value) is _Leaf:
            self._count(value, -1)

    def evict(self, hashes: Iterable[int]) -> None:
        """These blocks are no longer held. One inside a leaf cuts the leaf there (the blocks
        after it in that chain can no longer match); those are found by looking through the
        leaves, one pass."""
        inside = set()
        for block_hash in hashes:
            if block_hash in self._entries:
                self._drop(block_hash)
            else:
                inside.add(block_hash)
        if not inside:
            return
        for key, value in list(self._entries.items()):
            if type(value) is _Leaf and not inside.isdisjoint(value.hashes):
                cut = next(i for i, h in enumerate(value.hashes) if h in inside)
                self._count(value, -1)
                self._entries[key] = shorter = _Leaf(value, _leaf_chain(value.hashes[:cut]))
                self._count(shorter, 1)
                heappush(self._displaced, (float(value), key, shorter))  # if it was displaced

    def clear(self) -> None:
        self._entries.clear()
        self._displaced.clear()
        self._leaves = self._in_leaves = self._unhashed = 0
        self._sweep_at = math.inf

    def resize(self, capacity: int, now: float) -> None:
        self.capacity = max(1, capacity)
        if len(self) > self.capacity:
            self._trim(now)

    def items(self) -> list[tuple[int, float]]:
        """(hash, last touched) pairs, least recently touched first (a leaf's deepest first),
        except that the rest of a split leaf comes where it was split, with its older time."""
        out: list[tuple[int, float]] = []
        for key, touched in self._entries.items():
            if type(touched) is _Leaf:
                chain = touched.hashes
                hashes = chain.peek() if type(chain) is PromptChain else chain
                out += zip(reversed(hashes), repeat(float(touched)))
            else:
                out.append((key, touched))
        return out

    def load(self, hashes: Sequence[int], touched: Sequence[float], now: float) -> None:
        """Touch `hashes`, oldest first, each at its own time in `touched` (a snapshot's
        `items()`, restored), as single entries: a snapshot has no chains. The leaves held
        already become single entries first, so that no loaded block lands inside one."""
        if not hashes:
            return
        entries = self._entries
        if self._leaves:
            singles = self.items()
            entries.clear()
            entries.update(singles)
            self._displaced.clear()
            self._leaves = self._in_leaves = self._unhashed = 0
        move_to_end = entries.move_to_end
        for block_hash, at in zip(hashes, touched, strict=True):
            entries[block_hash] = at
            move_to_end(block_hash)
        self._sweep_at = min(self._sweep_at, min(touched) + self.ttl)
        if len(self) > self.capacity or now >= self._sweep_at:
            self._trim(now)

    def depth(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of `hashes` are held."""
        held = self._keys_held(hashes, now)
        if not held:
            return 0
        leaf = self._entries[hashes[held - 1]]
        if type(leaf) is not _Leaf:
            return held
        return held - 1 + _common_prefix(leaf.hashes, hashes, held - 1)

    def _keys_held(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of `hashes` are keys touched within the TTL (a binary
        search: the keys along a chain are a prefix of it, and a leaf's key is the last)."""
        entries = self._entries
        oldest = now - self.ttl
        if not hashes:
            return 0
        start = entries.get(hashes[0], _MISSING)
        if start < oldest:
            return 0  # the common case on a large fleet: one lookup, no search
        if type(start) is _Leaf or len(hashes) == 1:
            return 1
        if entries.get(hashes[-1], _MISSING) >= oldest:
            return len(hashes)  # every block is a key: one more lookup, no search
        low, high = 1, len(hashes) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if entries.get(hashes[middle - 1], _MISSING) >= oldest:
                low = middle
            else:
                high = middle - 1
        return low

    def _trim(self, now: float) -> None:
        """Drop the oldest entries while they are expired or over capacity — the front of
        the ordered dict or the oldest displaced leaf, whichever was touched first; a leaf over
        capacity by fewer blocks than it has loses its deepest ones and keeps its place."""
        entries = self._entries
        displaced = self._displaced
        oldest = now - self.ttl
        over = len(self) - self.capacity
        while entries:
            while displaced and entries.get(displaced[0][1]) is not displaced[0][2]:
                heappop(displaced)  # refreshed, replaced or evicted since
            key, touched = next(iter(entries.items()))
            rest = bool(displaced) and displaced[0][0] < touched
            if rest:
                _, key, touched = displaced[0]
            expired = touched < oldest
            if not expired and over <= 0:
                break
            if type(touched) is _Leaf:
                weight = len(touched.hashes)
                if not expired and weight > over:
                    self._count(touched, -1)
                    entries[key] = shorter = _Leaf(
                        touched, _leaf_chain(touched.hashes[: weight - over])
                    )
                    self._count(shorter, 1)
                    if rest:
                        heapreplace(displaced, (float(touched), key, shorter))
                    self.evictions += over
                    break
                self._count(touched, -1)
            else:
                weight = 1
            if rest:
                heappop(displaced)
                del entries[key]
            else:
                entries.popitem(last=False)
            self.evictions += weight
            over -= weight
        front = next(iter(entries.values()), math.inf)
        self._sweep_at = min(front, displaced[0][0] if displaced else math.inf) + self.ttl


def _common_prefix(chain: Sequence[int], hashes: Sequence[int], start: int) -> int:
    """How many leading elements of `chain` equal `hashes[start:]`, `chain[0]` being equal.
    Both are chains of hashes, each naming the whole prefix up to its block, so equal elements
    at k mean equal elements before k: a binary search over single elements. Two unhashed
    prompt chains compare their bytes instead (memcmp), without hashing."""
    if (
        start == 0
        and type(chain) is PromptChain
        and type(hashes) is PromptChain
        and not chain.hashed
    ):
        return max(1, _shared_blocks(hashes.data, chain.data, chain.block_chars))
    size = min(len(chain), len(hashes) - start)
    if chain[size - 1] == hashes[start + size - 1]:
        return size
    low, high = 0, size - 1  # the answer lies in low .. high
    while low < high:
        middle = (low + high + 1) // 2
        if chain[middle - 1] == hashes[start + middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low


_ENTRIES = operator.attrgetter("_entries")


def _touched(tables: list[EndpointBlocks], block_hash: int) -> Iterator[float]:
    """When each endpoint last touched `block_hash` (-inf if it does not hold it), in C loops."""
    return map(dict.get, map(_ENTRIES, tables), repeat(block_hash), repeat(_MISSING))


def _held(tables: list[EndpointBlocks], block_hash: int, oldest: float) -> Iterator[bool]:
    """Whether each endpoint holds `block_hash`, touched at `oldest` or later (C loops)."""
    return map(partial(operator.le, oldest), _touched(tables, block_hash))


class PrefixIndex:
    """Per-endpoint `EndpointBlocks`, created on first use with `default_capacity`, and a map
    from each recently recorded chain's first block to the endpoints it was recorded on.

    That map lets `match` look only at the endpoints that may hold a prompt's first block
    instead of at every endpoint: for a prompt nobody holds, one lookup. It is a superset of
    the holders (an endpoint that evicted the block stays listed until `match` sees that) and
    keeps the last `max_roots` first blocks. When one is dropped while an endpoint still holds
    it, or entries arrive from a snapshot (whose chains are not known), the map is incomplete
    until those entries expire (`ttl`), and `match` looks at every endpoint meanwhile.
    """

    def __init__(
        self,
        default_capacity: int = 31_250,
        ttl: float = 600.0,
        max_capacity: int = 1_000_000,
        max_roots: int = 16_384,
    ) -> None:
        self.default_capacity = default_capacity
        self.max_capacity = max_capacity
        self.ttl = ttl
        self.max_roots = max_roots
        self._blocks: dict[str, EndpointBlocks] = {}
        self._roots: OrderedDict[int, dict[str, EndpointBlocks]] = OrderedDict()
        self._incomplete_until = -math.inf  # until then an endpoint may hold an unlisted root

    def add_endpoints(self, endpoints: Iterable[str]) -> None:
        """Make the endpoints' tables now (at startup), so that they are among the objects the
        gateway freezes out of the garbage collector's reach (`GatewayApp.startup`): a full
        collection walks every entry of a tracked ordered dict (one per single-block entry or
        leaf: up to ≈ 50 ms for 64 endpoints whose blocks are all shared), and their entries
        are ints, floats and leaves of arrays, which never form cycles."""
        for endpoint in endpoints:
            self._for(endpoint)

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
        starts = list(_touched(tables, hashes[0]))
        first = list(map(partial(operator.le, oldest), starts))
        if listed is not None and not all(first):
            for name, held in zip(names, first, strict=True):
                if not held:
                    listed.pop(name, None)  # evicted or expired there: forget it
        holders = list(compress(names, first))
        if not holders:
            return {}
        tables = list(compress(tables, first))
        starts = list(compress(starts, first))
        depths = {}
        leaves = list(map(_is_leaf, map(type, starts)))
        if any(leaves):  # the prompt's first block starts a leaf there: compare the chains
            for name, leaf in compress(zip(holders, starts, strict=True), leaves):
                depths[name] = _common_prefix(leaf.hashes, hashes, 0)
            inner = list(map(operator.not_, leaves))
            holders, tables = list(compress(holders, inner)), list(compress(tables, inner))
            if not holders:
                return depths
        depth = tables[0].depth(hashes, now)
        depths.update(dict.fromkeys(holders, depth))
        others = tables[1:]
        # The others differ unless block depth - 1 is a single entry there (not a leaf's key,
        # which may go on) and block depth is not held.
        last = list(_touched(others, hashes[depth - 1]))
        differ = map(
            operator.or_, map(partial(operator.gt, oldest), last), map(_is_leaf, map(type, last))
        )
        if depth < len(hashes):
            differ = map(operator.or_, differ, _held(others, hashes[depth], oldest))
        for name, blocks in compress(zip(holders[1:], others, strict=True), differ):
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
                dropped, holders = roots.popitem(last=False)
                if any(holder.holds_start(dropped) for holder in holders.values()):
                    self._incomplete_until = now + self.ttl  # still held, no longer listed
        else:
            roots.move_to_end(hashes[0])
        listed[endpoint] = blocks

    def load(
        self, endpoint: str, hashes: Sequence[int], touched: Sequence[float], now: float
    ) -> None:
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

    def evictions(self, endpoint: str) -> int:
        blocks = self._blocks.get(endpoint)
        return blocks.evictions if blocks is not None else 0

    @property
    def memory_bytes(self) -> int:
        """Estimated memory held by the index (entries, leaves and listed first blocks, times
        their measured sizes)."""
        total = self.roots * BYTES_PER_ROOT
        for blocks in self._blocks.values():
            singles, leaves, in_leaves = blocks.sizes()
            total += (
                singles * BYTES_PER_ENTRY
                + leaves * BYTES_PER_LEAF
                + in_leaves * BYTES_PER_LEAF_BLOCK
                + blocks.unhashed * (BYTES_PER_TEXT_BLOCK - BYTES_PER_LEAF_BLOCK)
            )
        return total

    @property
    def roots(self) -> int:
        """First blocks listed with the endpoints they were recorded on."""
        return len(self._roots)
