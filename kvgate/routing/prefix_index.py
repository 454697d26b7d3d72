"""Approximate prefix-cache index: which endpoint probably holds which prompt prefix.

Prompts are named by chained block hashes (`kvgate/routing/prefix_hasher.py`) and each
endpoint's blocks are kept in a prefix-tree LRU (`EndpointBlocks`,
`kvgate/routing/prefix_tree.py`). For each recorded chain's first block the index lists the
endpoints it went to, so `match` asks only those (see `PrefixIndex`).

The update API is a stream of small events — `record(endpoint, hashes)`, `evict(endpoint,
hashes)`, `clear(endpoint)` — so that replicas can later share the index as deltas.
"""

from __future__ import annotations

import math
import operator
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import compress, repeat
from typing import cast

from kvgate.routing.prefix_tree import MISSING, EndpointBlocks, Leaf, common_prefix, is_leaf

# Measured with tracemalloc (benchmarks/routing.py --micro): a listed first block is an
# ordered-map node, its key and the small dict of its endpoints.
BYTES_PER_ROOT = 310


_ENTRIES = operator.attrgetter("_entries")


def _touched(tables: list[EndpointBlocks], block_hash: int) -> Iterator[float]:
    """When each endpoint last touched `block_hash` (-inf if it does not hold it), in C loops."""
    return map(dict.get, map(_ENTRIES, tables), repeat(block_hash), repeat(MISSING))


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

    def adopt(self, old: PrefixIndex, names: Mapping[str, str]) -> None:
        """Take over `old`'s entries for the endpoints that remain after a reload (`names`:
        old endpoint name → new name); the entries of the others are dropped with `old`. The
        tables move rather than being copied, so requests begun before the reload, which
        record into `old`, still teach this index; they take this index's TTL."""
        for old_name, new_name in names.items():
            blocks = old._blocks.get(old_name)
            if blocks is not None:
                blocks.ttl = self.ttl
                self._blocks[new_name] = blocks
        for first, holders in old._roots.items():
            kept = {names[n]: b for n, b in holders.items() if n in names}
            if kept:
                self._roots.setdefault(first, {}).update(kept)
        self._incomplete_until = max(self._incomplete_until, old._incomplete_until)

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
        leaves = list(map(is_leaf, map(type, starts)))
        if any(leaves):  # the prompt's first block starts a leaf there: compare the chains
            for name, leaf in compress(zip(holders, starts, strict=True), leaves):
                depths[name] = common_prefix(cast(Leaf, leaf).hashes, hashes, 0)
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
            operator.or_, map(partial(operator.gt, oldest), last), map(is_leaf, map(type, last))
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

    def deepest_touch(
        self, endpoint: str, hashes: Sequence[int], now: float | None = None
    ) -> float | None:
        """When `endpoint` last touched the deepest block of `hashes` it holds (None: none)."""
        blocks = self._blocks.get(endpoint)
        if blocks is None or not hashes:
            return None
        return blocks.deepest_touch(hashes, time.monotonic() if now is None else now)

    def eviction_touch(self, endpoint: str, need: int) -> float:
        """`EndpointBlocks.eviction_touch` of `endpoint` (`MISSING` for one never recorded)."""
        blocks = self._blocks.get(endpoint)
        return MISSING if blocks is None else blocks.eviction_touch(need)

    def room(self, endpoint: str, need: int) -> int:
        """Blocks `endpoint` would still have free after recording `need` more (negative: it
        would evict that many)."""
        blocks = self._blocks.get(endpoint)
        if blocks is None:
            return self.default_capacity - need
        return blocks.capacity - len(blocks) - need

    def forget_touched_until(self, endpoint: str, moment: float) -> None:
        """`endpoint`'s engine evicted a block last touched at `moment`: forget everything it
        was told at that time or before (an LRU evicts the oldest first)."""
        blocks = self._blocks.get(endpoint)
        if blocks is not None:
            blocks.forget_touched_until(moment)

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
        return self.roots * BYTES_PER_ROOT + sum(b.memory_bytes for b in self._blocks.values())

    @property
    def roots(self) -> int:
        """First blocks listed with the endpoints they were recorded on."""
        return len(self._roots)
