"""Precise prefix index: which blocks of token ids each engine holds, from its KV events.

A block is named by a *key*: a chained hash of its token ids and its parent's key
(`block_keys`), computed the same way for an engine's `BlockStored` event and for a
request's prompt, so the engine's own block hashes — salted per process — serve only to
resolve later `BlockRemoved` events and the parent of a stored run. Keys are hashes of int
tuples, stable within the gateway process (ints hash the same under any PYTHONHASHSEED).

Per key the index keeps a bit mask of the endpoints that hold it; `match` bisects the
prompt's keys for every endpoint at once: a few dozen dict lookups for a long prompt, whatever
the number of endpoints.

Between a routing decision and the engine's `BlockStored` (the prefill takes a while), the
decision is a *speculative* entry for `speculative_ttl` seconds: a burst of requests with one
new prefix finds the first one's endpoint holding it and follows, instead of scattering.

Bounded memory: an endpoint holds at most `max_blocks` blocks (the engine's KV size when it
is known, else the default). The engine evicts and says so (`BlockRemoved`); an endpoint that
outgrows the bound has missed evictions: it is cleared and marked `overflowed` until the
engine's next `AllBlocksCleared` (the caller then routes it approximately).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvgate.routing.kv_events import BlockRemoved, BlockStored

log = logging.getLogger("kvgate.routing")

# Measured with tracemalloc (`benchmarks/routing.py --micro`): per held block, its entry in
# the endpoint's hash → key map and in the index's key → holders map.
BYTES_PER_BLOCK = 190
# Tokens per block until config, telemetry or an event says otherwise (vLLM's default).
DEFAULT_BLOCK_SIZE = 16
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
    configured: int | None = None  # `tokenizer.block_size`, until the events contradict it


class PreciseIndex:
    """Token-block keys held per endpoint, fed in order by each endpoint's KV events
    (`stored`, `removed`, `cleared`: a `KvEventSink`), and speculative entries from routing."""

    def __init__(self, default_max_blocks: int = 1_000_000, speculative_ttl: float = 2.0) -> None:
        self.default_max_blocks = default_max_blocks
        self.speculative_ttl = speculative_ttl
        self._endpoints: dict[str, _Endpoint] = {}
        self._holders: dict[int, int] = {}  # key → bit mask of endpoints holding it
        self._speculative: dict[int, dict[int, float]] = {}  # key → bit → expiry
        self._expiries: deque[tuple[float, int, tuple[int, ...]]] = deque()

    def add_endpoint(self, name: str, block_size: int | None = None) -> None:
        """Index `name` (its bit is fixed for the process); `block_size` from config, if set."""
        if name not in self._endpoints:
            bit = 1 << len(self._endpoints)
            self._endpoints[name] = _Endpoint(
                bit, self.default_max_blocks, block_size, configured=block_size
            )

    def block_size(self, name: str) -> int:
        """The engine's block size in tokens: from config, its events or its metrics, else
        `DEFAULT_BLOCK_SIZE` (an engine that has sent no event holds nothing anyway)."""
        return self._endpoints[name].block_size or DEFAULT_BLOCK_SIZE

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
        if event.lora_id is not None or not _on_gpu(event.medium):
            # A LoRA adapter's blocks (vLLM keys them apart from the base model's, by an id
            # that is the engine's own) and blocks offloaded to another tier (outside the GPU
            # cache the engine's size bounds) are no hit for a base-model prompt.
            return
        state = self._endpoints[endpoint]
        size = event.block_size
        if state.block_size != size:
            if state.configured is not None:
                log.warning(
                    "kv events %s: blocks of %d tokens, not the %d of tokenizer.block_size; "
                    "keyed by the events' size",
                    endpoint,
                    size,
                    state.configured,
                )
                state.configured = None
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
        if not _on_gpu(event.medium):
            return
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
        events alone.

        An engine evicts a chain's blocks deepest first (least recently used, and a request's
        blocks are freed tail first), so "holds block k ⇒ holds blocks < k", and the prefix
        cache hits only the leading blocks anyway: the depths are found by bisection, all
        endpoints at once (the endpoints holding the probed block go deeper, the others
        shallower), in about log2(blocks) lookups per distinct depth."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        names = {self._endpoints[name].bit: name for name in endpoints}
        wanted = sum(names)
        holders, speculative = self._holders.get, self._speculative.get
        guessed_any = False

        def held_or_guessed(key: int) -> int:
            nonlocal guessed_any
            mask = holders(key, 0)
            guessed = speculative(key)
            if guessed:
                for bit, until in guessed.items():
                    if until > now:
                        mask |= bit
                        guessed_any = True
            return mask

        both = _depths(keys, wanted, names, held_or_guessed)
        if not guessed_any:  # no probe met a live guess: the events alone say the same
            return both, dict(both)
        confirmed = _depths(keys, wanted, names, lambda key: holders(key, 0))
        return both, confirmed

    def speculate(self, endpoint: str, keys: Sequence[int], now: float | None = None) -> None:
        """A request with these keys was just sent to `endpoint`: count them as held there
        for `speculative_ttl` seconds (until its events confirm them). Pass only the keys
        its events do not confirm yet: the others need no guess."""
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
        self._expiries.append((until, bit, tuple(keys)))  # a tuple: out of the GC's reach

    def speculative_entries(self, now: float | None = None) -> int:
        """Live speculative (key, endpoint) entries: those expired are dropped first, so an
        idle gateway's gauge falls to 0."""
        self._expire(time.monotonic() if now is None else now)
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


def _on_gpu(medium: str | None) -> bool:
    """Whether an event's `medium` is the engine's GPU cache (vLLM: "GPU"; absent in older
    versions), not a tier blocks are offloaded to ("CPU", a disk)."""
    return medium is None or medium.upper() == "GPU"


def _depths(
    keys: Sequence[int], wanted: int, names: dict[int, str], mask_at: Callable[[int], int]
) -> dict[str, int]:
    """Per endpoint of `wanted` (bits, named by `names`), how many leading `keys` it holds,
    where `mask_at(key)` gives the bits of the endpoints holding `key` (see `match`)."""
    depths = dict.fromkeys(names.values(), 0)
    if not keys:
        return depths
    # (lo, hi, bits): each endpoint in `bits` holds keys[:lo] and lacks one of keys[lo:hi],
    # or none of them when hi is the end.
    pending = [(1, len(keys), mask_at(keys[0]) & wanted)]  # holding nothing: depth 0
    while pending:
        lo, hi, bits = pending.pop()
        if not bits:
            continue
        if lo >= hi:
            while bits:
                low = bits & -bits
                depths[names[low]] = lo
                bits ^= low
            continue
        mid = (lo + hi) // 2
        deeper = mask_at(keys[mid]) & bits
        pending.append((mid + 1, hi, deeper))
        pending.append((lo, mid, bits & ~deeper))
    return depths
