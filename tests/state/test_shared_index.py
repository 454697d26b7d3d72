"""The shared prefix index: deltas and snapshots round-trip; replicas agree through Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvgate.routing.prefix_hasher import PrefixHasher
from kvgate.routing.shared_index import SharedPrefixIndex, decode_delta, encode_delta
from kvgate.state.memory import MemoryStore
from kvgate.state.redis_store import RedisStore, RedisStoreSettings

pytestmark = pytest.mark.timeout(60)


URLS = {"a": "http://engine-a:8000", "b": "http://engine-b:8000"}


class _Publishing(MemoryStore):
    """A store that keeps what is published to it."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[bytes] = []

    def publish(self, topic: str, delta: bytes) -> None:
        self.published.append(delta)


def test_delta_round_trip_keeps_full_64_bit_hashes():
    hashes = [0, 1, 2**64 - 1, 12345678901234567890]
    url = "http://engine-ä:8000/" + "x" * 300  # longer than 255 bytes
    assert decode_delta(encode_delta(url, hashes)) == (url, tuple(hashes))


def test_snapshot_restores_entries_with_their_age():
    source = SharedPrefixIndex(MemoryStore(), URLS, ttl=100)
    chain = PrefixHasher().hashes("x" * 1000, "m")
    source.record("a", chain, now=time.monotonic() - 50)
    source.record("b", chain[:3])
    copy = SharedPrefixIndex(MemoryStore(), URLS, ttl=100)
    copy.restore(source.snapshot())
    assert copy.match(chain) == {"a": len(chain), "b": 3}
    assert copy.match(chain, now=time.monotonic() + 60) == {"b": 3}  # a's entries expired


def test_replicas_that_name_engines_differently_share_by_engine():
    """Names are positions in a replica's config: after one replica's reload reordered its
    endpoints, what it shares still lands on the same engines in the others."""
    chain = PrefixHasher().hashes("y" * 1000, "m")
    store = _Publishing()
    reordered = SharedPrefixIndex(store, {"p-0": URLS["b"], "p-1": URLS["a"]})
    other = SharedPrefixIndex(MemoryStore(), {"p-0": URLS["a"], "p-1": URLS["b"]})
    reordered.record("p-0", chain)  # engine b
    (delta,) = store.published
    other.apply_delta(delta)
    assert other.match(chain) == {"p-1": len(chain)}
    other.restore(reordered.snapshot())
    assert other.match(chain) == {"p-1": len(chain)}
    unknown = SharedPrefixIndex(MemoryStore(), {"p-0": "http://elsewhere:1"})
    unknown.apply_delta(delta)
    assert unknown.match(chain) == {}


async def test_decisions_on_one_replica_are_matched_on_the_others(redis_server):
    stores = [
        RedisStore(
            RedisStoreSettings(url=redis_server.url, prefix="ps", op_timeout=0.5, read_block=0.1)
        )
        for _ in range(3)
    ]
    indexes = [SharedPrefixIndex(store, {"pool-1": "http://e1:8000"}) for store in stores]
    for store in stores:
        await store.start()
    try:
        unhashed = PrefixHasher().chain("system prompt " * 200, "m", salt="tenant-a")
        indexes[0].record("pool-1", unhashed)  # as the picker records: hashed for the delta
        chain = unhashed.hashes()
        assert indexes[0]._blocks["pool-1"].unhashed == 0
        deadline = time.monotonic() + 5
        while indexes[2].match(chain).get("pool-1", 0) < len(chain):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert indexes[1].match(chain) == {"pool-1": len(chain)}
    finally:
        for store in stores:
            await store.stop()
