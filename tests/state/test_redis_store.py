"""RedisStore against a real redis-server: deltas, load heartbeats, snapshots, losing Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvgate.state.memory import MemoryStore
from kvgate.state.redis_store import RedisStore, RedisStoreSettings
from kvgate.state.store import ReplicaLoad

pytestmark = pytest.mark.timeout(60)


class SetView:
    """A toy shared view: a set of byte strings, one delta per element."""

    def __init__(self) -> None:
        self.items: set[bytes] = set()

    def apply(self, delta: bytes) -> None:
        self.items.add(delta)

    def snapshot(self) -> bytes:
        return b"\n".join(sorted(self.items))

    def restore(self, data: bytes) -> None:
        self.items.update(x for x in data.split(b"\n") if x)


def _store(url: str, view: SetView, prefix: str, **kw: float) -> RedisStore:
    store = RedisStore(
        RedisStoreSettings(
            url=url, prefix=prefix, heartbeat_interval=0.1, read_block=0.1, op_timeout=0.5, **kw
        )
    )
    store.share("set", view.apply, view.snapshot, view.restore)
    return store


async def _eventually(condition: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_deltas_reach_every_other_replica_but_not_the_sender(redis_server):
    views = [SetView(), SetView(), SetView()]
    stores = [_store(redis_server.url, v, "t1") for v in views]
    for store in stores:
        await store.start()
    try:
        stores[0].publish("set", b"a")
        stores[1].publish("set", b"b")
        await _eventually(lambda: views[2].items == {b"a", b"b"})
        await _eventually(lambda: views[0].items == {b"b"} and views[1].items == {b"a"})
        assert stores[0].stats.published >= 1
    finally:
        for store in stores:
            await store.stop()


async def test_load_heartbeats_sum_over_live_peers_and_expire(redis_server):
    stores = [_store(redis_server.url, SetView(), "t2") for _ in range(3)]
    seen: list[dict[str, ReplicaLoad]] = []
    stores[0].report_load(dict, lambda peers: seen.append(dict(peers)))
    stores[1].report_load(lambda: {"pool-0": ReplicaLoad(2, 100)}, lambda peers: None)
    stores[2].report_load(
        lambda: {"pool-0": ReplicaLoad(3, 50), "pool-1": ReplicaLoad(1, 7)}, lambda peers: None
    )
    for store in stores:
        await store.start()
    try:
        await _eventually(lambda: stores[0].replicas == 3)
        await _eventually(
            lambda: (
                stores[0].peer_load()
                == {"pool-0": ReplicaLoad(5, 150), "pool-1": ReplicaLoad(1, 7)}
            )
        )
        await _eventually(lambda: stores[1].peer_load().get("pool-0") == ReplicaLoad(3, 50))
        assert {"pool-0": ReplicaLoad(5, 150), "pool-1": ReplicaLoad(1, 7)} in seen
        await stores[2].stop()
        await _eventually(lambda: stores[0].peer_load() == {"pool-0": ReplicaLoad(2, 100)})
        assert stores[0].replicas == 2
    finally:
        await stores[0].stop()
        await stores[1].stop()


async def test_a_new_replica_warms_up_from_the_snapshot(redis_server):
    old_view = SetView()
    old = _store(redis_server.url, old_view, "t3", snapshot_interval=0.2, stream_maxlen=1)
    await old.start()
    try:
        old_view.items.update({b"x", b"y"})
        for item in (b"x", b"y"):
            old.publish("set", item)
        await _eventually(lambda: old.stats.snapshots_written >= 1)
        new_view = SetView()
        new = _store(redis_server.url, new_view, "t3")
        await new.start()
        try:
            await _eventually(lambda: new_view.items == {b"x", b"y"})
            assert new.stats.snapshots_restored == 1
        finally:
            await new.stop()
    finally:
        await old.stop()


async def test_losing_redis_never_blocks_and_recovery_resyncs(redis_server):
    if not redis_server.can_restart:
        pytest.skip("REDIS_URL points at an external server this test cannot restart")
    views = [SetView(), SetView()]
    stores = [_store(redis_server.url, v, "t4") for v in views]
    for store in stores:
        await store.start()
    try:
        stores[0].publish("set", b"before")
        await _eventually(lambda: views[1].items == {b"before"})
        redis_server.stop()
        started = time.perf_counter()
        for i in range(1000):
            stores[0].publish("set", b"during-%d" % i)
        assert time.perf_counter() - started < 0.5
        await _eventually(lambda: not stores[0].connected)
        await _eventually(lambda: stores[1].peer_load() == {})
        redis_server.start()
        await _eventually(lambda: stores[0].connected and stores[1].connected, within=15)
        stores[0].publish("set", b"after")
        await _eventually(lambda: b"after" in views[1].items, within=15)
        await _eventually(lambda: stores[0].stats.resyncs >= 2)
        await _eventually(lambda: len(views[1].items) == 1002)
    finally:
        for store in stores:
            await store.stop()


async def test_the_store_a_reload_makes_carries_the_old_ones_counts(redis_server):
    """A reload replaces the store; the counters read from it must not reset."""
    old = _store(redis_server.url, SetView(), "t5")
    await old.start()
    try:
        for i in range(3):
            old.publish("set", b"%d" % i)
        await _eventually(lambda: old.stats.published == 3)
    finally:
        await old.stop()
    new = _store(redis_server.url, SetView(), "t5")
    await new.start()
    try:
        await _eventually(lambda: new.stats.resyncs >= 1)
        before = (new.stats.resyncs, new.link.stats.calls, list(new.link.stats.durations))
        new.adopt_counts(old)
        assert new.stats.published == 3
        assert new.stats.resyncs == before[0] + old.stats.resyncs
        assert new.link.stats.calls == before[1] + old.link.stats.calls > before[1]
        assert new.link.stats.durations == [
            a + b for a, b in zip(before[2], old.link.stats.durations, strict=True)
        ]
    finally:
        await new.stop()


async def test_memory_store_is_a_single_replica():
    store = MemoryStore()
    await store.start()
    store.publish("set", b"a")
    assert store.replicas == 1 and store.peer_load() == {}
    await store.stop()
