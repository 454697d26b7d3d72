"""Precise prefix index: which blocks of token ids each engine holds, from its KV events.

A block is named by a *key*: a chained hash of its token ids and its parent's key
(`block_keys`), computed the same way for an engine's `BlockStored` event and for a
request's prompt, so the engine's own block hashes — salted per process — serve only to
resolve later `BlockRemoved` events and the parent of a stored run. Keys are hashes of int
tuples, stable within the gateway process (ints hash the same under any PYTHONHASHSEED).

Per key the index keeps a bit mask of the endpoints that hold it; `match` walks the prompt's
keys once and, with a running mask, finds every endpoint's depth at once: the cost is one
dict lookup per block the deepest holder has, whatever the number of endpoints.

Between a routing decision and the engine's `BlockStored` (the prefill takes a while), the
decision is a *speculative* entry for `speculative_ttl` seconds: a burst of requests with one
new prefix finds the first one's endpoint holding it and follows, instead of scattering.

Bounded memory: an endpoint holds at most `max_blocks` blocks (the engine's KV size when it
is known, else the default). The engine evicts and says so (`BlockRemoved`); an endpoint that
outgrows the bound has missed evictions: it is cleared and marked `overflowed` until the
engine's next `AllBlocksCleared` (the caller then routes it approximately).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvgate.routing.kv_events import BlockRemoved, BlockStored

# Measured with tracemalloc (`benchmarks/routing.py --micro`): per held block, its entry in
# the endpoint's hash → key map and in the index's key → holders map.
BYTES_PER_BLOCK = 190
_ROOT = 0x6B76_6761_7465  # the parent key of a prompt's first block


def block_keys(ids: Sequence[int], block_size: int, limit: int) -> list[int]:
    """The chained keys of the first `limit` full blocks of `ids`."""
    keys: list[int] = []
    parent = _ROOT
    for start in range(0, min(limit, len(ids) // block_size) * block_size, block_size):
        parent = hash((parent, tuple(ids[start : start + block_size])))
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Endpoint:
    bit: int
    max_blocks: int
    block_size: int | None = None
    keys: dict[object, int] = field(default_factory=dict)  # engine hash → key
    refs: dict[int, int] = field(default_factory=dict)  # key → engine hashes naming it
    overflowed: bool = False
    orphans: int = 0  # stored runs whose parent was unknown (not indexed)


class PreciseIndex:
    """Token-block keys held per endpoint, fed in order by each endpoint's KV events
    (`stored`, `removed`, `cleared`: a `KvEventSink`), and speculative entries from routing."""

    def __init__(self, default_max_blocks: int = 1_000_000, speculative_ttl: float = 2.0) -> None:
        self.default_max_blocks = default_max_blocks
        self.speculative_ttl = speculative_ttl
        self._endpoints: dict[str, _Endpoint] = {}
        self._holders: dict[int, int] = {}  # key → bit mask of endpoints holding it
        self._speculative: dict[int, dict[int, float]] = {}  # key → bit → expiry
        self._expiries: deque[tuple[float, int, list[int]]] = deque()

    def add_endpoint(self, name: str, block_size: int | None = None) -> None:
        """Index `name` (its bit is fixed for the process); `block_size` from config, if set."""
        if name not in self._endpoints:
            bit = 1 << len(self._endpoints)
            self._endpoints[name] = _Endpoint(bit, self.default_max_blocks, block_size)

    def block_size(self, name: str) -> int | None:
        """The engine's block size in tokens (config, else its events), None while unknown."""
        return self._endpoints[name].block_size

    def set_engine_size(self, name: str, num_blocks: int, block_size: int | None) -> None:
        """The engine reported its KV size: it never holds more blocks than that."""
        state = self._endpoints[name]
        state.max_blocks = max(1, num_blocks)
        if state.block_size is None and block_size:
            state.block_size = block_size

    def overflowed(self, name: str) -> bool:
        """True when `name` outgrew its bound (missed evictions) and was not cleared since."""
        return self._endpoints[name].overflowed

    def blocks(self, name: str) -> int:
        """Blocks `name` holds."""
        return len(self._endpoints[name].refs)

    def orphans(self, name: str) -> int:
        """Stored runs of `name` whose parent block was unknown (not indexed)."""
        return self._endpoints[name].orphans

    @property
    def memory_bytes(self) -> int:
        return sum(len(s.keys) for s in self._endpoints.values()) * BYTES_PER_BLOCK

    # --- KvEventSink -------------------------------------------------------------------

    def stored(self, endpoint: str, event: BlockStored) -> None:
        state = self._endpoints[endpoint]
        size = event.block_size
        if state.block_size != size:
            if state.refs:
                self._drop_all(state)
            state.block_size = size
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            parent = _ROOT
        else:
            known = state.keys.get(parent_hash)
            if known is None:  # its parent was cleared or evicted: the run is unreachable
                state.orphans += 1
                return
            parent = known
        tokens, holders, refs, bit = event.token_ids, self._holders, state.refs, state.bit
        for i, engine_hash in enumerate(event.block_hashes):
            parent = hash((parent, tokens[i * size : (i + 1) * size]))
            if engine_hash in state.keys:
                continue
            state.keys[engine_hash] = parent
            count = refs.get(parent, 0)
            refs[parent] = count + 1
            if not count:
                holders[parent] = holders.get(parent, 0) | bit
        if len(refs) > state.max_blocks:
            self._drop_all(state)
            state.overflowed = True

    def removed(self, endpoint: str, event: BlockRemoved) -> None:
        state = self._endpoints[endpoint]
        for engine_hash in event.block_hashes:
            key = state.keys.pop(engine_hash, None)
            if key is not None:
                self._unref(state, key)

    def cleared(self, endpoint: str) -> None:
        state = self._endpoints[endpoint]
        self._drop_all(state)
        state.overflowed = False

    def _unref(self, state: _Endpoint, key: int) -> None:
        count = state.refs[key] - 1
        if count:
            state.refs[key] = count
            return
        del state.refs[key]
        mask = self._holders[key] & ~state.bit
        if mask:
            self._holders[key] = mask
        else:
            del self._holders[key]

    def _drop_all(self, state: _Endpoint) -> None:
        holders, clear = self._holders, ~state.bit
        for key in state.refs:
            mask = holders[key] & clear
            if mask:
                holders[key] = mask
            else:
                del holders[key]
        state.refs.clear()
        state.keys.clear()

    # --- routing -----------------------------------------------------------------------

    def match(
        self, keys: Sequence[int], endpoints: Iterable[str], now: float | None = None
    ) -> tuple[dict[str, int], dict[str, int]]:
        """For each of `endpoints` (which share the block size `keys` were made with): the
        leading blocks of `keys` it holds counting speculative entries, and confirmed by its
        events alone; one pass over the keys for all of them."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        names = {self._endpoints[name].bit: name for name in endpoints}
        wanted = sum(names)
        holders, speculative = self._holders.get, self._speculative.get
        both, confirmed = dict.fromkeys(names.values(), 0), dict.fromkeys(names.values(), 0)
        alive_both = alive_confirmed = wanted
        for depth, key in enumerate(keys):
            held = holders(key, 0) & wanted
            guessed = speculative(key)
            if guessed:
                held_or_guessed = held | sum(b for b, t in guessed.items() if t > now) & wanted
            else:
                held_or_guessed = held
            _settle(confirmed, names, alive_confirmed & ~held, depth)
            _settle(both, names, alive_both & ~held_or_guessed, depth)
            alive_confirmed &= held
            alive_both &= held_or_guessed
            if not alive_both:
                return both, confirmed
        _settle(confirmed, names, alive_confirmed, len(keys))
        _settle(both, names, alive_both, len(keys))
        return both, confirmed

    def speculate(self, endpoint: str, keys: Sequence[int], now: float | None = None) -> None:
        """A request with these keys was just sent to `endpoint`: count them as held there
        for `speculative_ttl` seconds (until its events confirm them)."""
        if not keys:
            return
        now = time.monotonic() if now is None else now
        self._expire(now)
        bit, until = self._endpoints[endpoint].bit, now + self.speculative_ttl
        speculative = self._speculative
        for key in keys:
            guessed = speculative.get(key)
            if guessed is None:
                speculative[key] = {bit: until}
            else:
                guessed[bit] = until
        self._expiries.append((until, bit, list(keys)))

    def speculative_entries(self) -> int:
        return sum(map(len, self._speculative.values()))

    def _expire(self, now: float) -> None:
        expiries, speculative = self._expiries, self._speculative
        while expiries and expiries[0][0] <= now:
            until, bit, keys = expiries.popleft()
            for key in keys:
                guessed = speculative.get(key)
                if guessed is not None and guessed.get(bit, until + 1) <= until:
                    del guessed[bit]  # not renewed by a later decision
                    if not guessed:
                        del speculative[key]


def _settle(depths: dict[str, int], names: dict[int, str], dropped: int, depth: int) -> None:
    """Give every endpoint whose bit is in `dropped` the depth `depth`."""
    while dropped:
        low = dropped & -dropped
        depths[names[low]] = depth
        dropped ^= low
