"""The block hashes one endpoint probably holds: a prefix-tree LRU with a TTL.

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
prefixes the engines still held (hit rates fell by a tenth in `benchmarks/routing.py`).
"""

from __future__ import annotations

import math
import operator
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import partial
from heapq import heapify, heappop, heappush, heapreplace
from itertools import repeat
from typing import cast

from kvgate.routing.prefix_hasher import PromptChain, hashed, shared_blocks

# Measured with tracemalloc (benchmarks/routing.py --micro): a single-block entry is an
# ordered-dict slot and link and its int key (140-210 B with the table's fill; the float is
# shared by a record); a leaf adds its float object and array header to that, and 8 B a block;
# a leaf that keeps its prompt's bytes (a `PromptChain`) holds 64 B a block instead.
BYTES_PER_ENTRY = 200
BYTES_PER_LEAF = 330
BYTES_PER_LEAF_BLOCK = 8
BYTES_PER_TEXT_BLOCK = 64

MISSING = -math.inf  # "touched" time of a hash an endpoint does not hold: older than any TTL


def _leaf_chain(hashes: Sequence[int]) -> array[int] | PromptChain:
    """What a leaf keeps: an unhashed prompt chain as it is, hashes in an array."""
    if type(hashes) is array:
        return hashes
    if type(hashes) is PromptChain and not hashes.hashed:
        return hashes
    return array("Q", hashed(hashes))


class Leaf(float):
    """The blocks of one chain from its first unshared block on, as one entry: the time they
    were last touched (the float value, so the entry compares like any other) and their hashes
    in an array (`hashes[0]` is the entry's key): 8 bytes a block, and nothing for the garbage
    collector to walk; or the unhashed `PromptChain` of a prompt nobody else had."""

    __slots__ = ("hashes",)
    hashes: array[int] | PromptChain

    def __new__(cls, touched: float, hashes: array[int] | PromptChain) -> Leaf:
        leaf = super().__new__(cls, touched)
        leaf.hashes = hashes
        return leaf


is_leaf = partial(operator.is_, Leaf)


class EndpointBlocks:
    """Block hashes one endpoint probably holds, least recently touched first, with the time
    each was last touched: at most `capacity` blocks, and those untouched for `ttl` never
    match (they are dropped on the next `record` after they expire).

    A prefix tree in an `OrderedDict`: a block that two recorded chains share is an entry of
    its own (an inner node), and the rest of a chain, from its first block nobody else has, is
    one entry, a `Leaf`, keyed by that block. A prompt nobody shares costs one entry, not one
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
        self._entries: OrderedDict[int, float] = OrderedDict()  # or a Leaf for several blocks
        self._leaves = 0
        self._in_leaves = 0  # blocks in leaves, their keys included
        self._unhashed = 0  # of those, blocks in leaves that keep a prompt's bytes
        self._displaced: list[tuple[float, int, Leaf]] = []  # a heap: leaves out of order
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

    @property
    def memory_bytes(self) -> int:
        """Estimated memory held by the entries and leaves (counts times measured sizes)."""
        singles, leaves, in_leaves = self.sizes()
        return (
            singles * BYTES_PER_ENTRY
            + leaves * BYTES_PER_LEAF
            + in_leaves * BYTES_PER_LEAF_BLOCK
            + self._unhashed * (BYTES_PER_TEXT_BLOCK - BYTES_PER_LEAF_BLOCK)
        )

    def record(self, hashes: Sequence[int], now: float) -> None:
        """`hashes` were all touched now: the blocks this endpoint held already are touched
        (deepest first, so the first blocks end most recent), the rest becomes a leaf, older
        than the blocks before it; then trim."""
        entries = self._entries
        held = self._keys_held(hashes, now)
        inner = held  # hashes[:inner] become (or stay) single entries, hashes[inner:] a leaf
        if held:
            leaf = entries[hashes[held - 1]]
            if type(leaf) is Leaf:
                start = held - 1
                self._drop(hashes[start])
                shared = common_prefix(leaf.hashes, hashes, start)
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
        leaf = self._entries[chain[0]] = Leaf(touched, chain)
        self._count(leaf, 1)

    def _count(self, leaf: Leaf, sign: int) -> None:
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
        heappush(displaced, (touched, hashes[0], cast(Leaf, self._entries[hashes[0]])))
        if len(displaced) > 2 * self._leaves + 64:
            entries = self._entries
            self._displaced = [d for d in displaced if entries.get(d[1]) is d[2]]
            heapify(self._displaced)

    def _drop(self, key: int) -> None:
        """Remove the entry `key`, if any (a stale one where a new one goes)."""
        value = self._entries.pop(key, None)
        if type(value) is Leaf:
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
            if type(value) is Leaf and not inside.isdisjoint(value.hashes):
                cut = next(i for i, h in enumerate(value.hashes) if h in inside)
                self._count(value, -1)
                self._entries[key] = shorter = Leaf(value, _leaf_chain(value.hashes[:cut]))
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
            if type(touched) is Leaf:
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
        if type(leaf) is not Leaf:
            return held
        return held - 1 + common_prefix(leaf.hashes, hashes, held - 1)

    def deepest_touch(self, hashes: Sequence[int], now: float) -> float | None:
        """When the deepest held block of `hashes` was last touched (the oldest of the held
        prefix: a chain is touched deepest-first), or None when none is held."""
        held = self._keys_held(hashes, now)
        return float(self._entries[hashes[held - 1]]) if held else None

    def eviction_touch(self, need: int) -> float:
        """When the least recently touched block was last touched, if recording `need` more
        blocks would push it out; `MISSING` (older than anything) when they fit. Placing a
        new prefix where this is oldest evicts what a single LRU over the whole fleet would."""
        if len(self) + need <= self.capacity:
            return MISSING
        entries = self._entries
        displaced = self._displaced
        while displaced and entries.get(displaced[0][1]) is not displaced[0][2]:
            heappop(displaced)  # refreshed, replaced or evicted since
        front = float(next(iter(entries.values()), MISSING))
        return displaced[0][0] if displaced and displaced[0][0] < front else front

    def forget_touched_until(self, moment: float) -> None:
        """Drop every block last touched at `moment` or before: the engine evicted a block of
        that age, and an LRU evicts everything older first."""
        self._evict(math.nextafter(moment, math.inf))

    def _keys_held(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of `hashes` are keys touched within the TTL (a binary
        search: the keys along a chain are a prefix of it, and a leaf's key is the last)."""
        entries = self._entries
        oldest = now - self.ttl
        if not hashes:
            return 0
        start = entries.get(hashes[0], MISSING)
        if start < oldest:
            return 0  # the common case on a large fleet: one lookup, no search
        if type(start) is Leaf or len(hashes) == 1:
            return 1
        if entries.get(hashes[-1], MISSING) >= oldest:
            return len(hashes)  # every block is a key: one more lookup, no search
        low, high = 1, len(hashes) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if entries.get(hashes[middle - 1], MISSING) >= oldest:
                low = middle
            else:
                high = middle - 1
        return low

    def _trim(self, now: float) -> None:
        """Drop the oldest entries while they are expired or over capacity."""
        self._evict(now - self.ttl)

    def _evict(self, oldest: float) -> None:
        """Drop the oldest entries while they were touched before `oldest` or are over
        capacity — the front of the ordered dict or the oldest displaced leaf, whichever was
        touched first; a leaf over capacity by fewer blocks than it has loses its deepest ones
        and keeps its place."""
        entries = self._entries
        displaced = self._displaced
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
            if type(touched) is Leaf:
                weight = len(touched.hashes)
                if not expired and weight > over:
                    self._count(touched, -1)
                    entries[key] = shorter = Leaf(
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


def common_prefix(chain: Sequence[int], hashes: Sequence[int], start: int) -> int:
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
        return max(1, shared_blocks(hashes.data, chain.data, chain.block_chars))
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
