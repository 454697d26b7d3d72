"""Shared state through Redis, entirely off the request path.

Keys (all under `prefix`):
    {p}:stream:{topic}     Redis Stream of deltas, fields r=replica id, d=delta; trimmed ~maxlen
    {p}:snapshot:{topic}   hash {id: last stream id applied, d: snapshot bytes}
    {p}:snaplock:{topic}   SET NX PX lock: one replica writes the snapshot per interval
    {p}:stream:load        each replica's per-endpoint load, sent when it changes (checked
                           every 10 ms) and at least every heartbeat; trimmed ~1000
    {p}:replicas           sorted set replica → last heartbeat (ms); silent for 3 heartbeats =
                           gone, and its load is forgotten

Publishing only appends to a bounded local queue; background tasks flush it, read the other
replicas' deltas, heartbeat load and write snapshots. When Redis is lost every loop backs off
behind the link's breaker, the gateway keeps serving on local state, and on recovery the
replica resyncs from the newest snapshot and the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.background import OwnedTask
from kvgate.state.redis_link import RedisLink, RedisUnavailable
from kvgate.state.redis_quota import RedisQuotaStore
from kvgate.state.store import ApplyDelta, LoadSink, LoadSource, ReplicaLoad, TakeSnapshot

log = logging.getLogger("kvgate.state")


LOAD_TOPIC = "load"
_LOAD_CHECK_SECONDS = 0.01


@dataclass(slots=True)
class _Topic:
    name: str
    apply: ApplyDelta
    snapshot: TakeSnapshot | None
    restore: ApplyDelta | None
    maxlen: int
    last_id: bytes = b"0-0"


@dataclass(slots=True)
class StoreStats:
    published: int = 0
    applied: int = 0
    dropped: int = 0
    snapshots_written: int = 0
    snapshots_restored: int = 0
    resyncs: int = 0


@dataclass(frozen=True, slots=True)
class RedisStoreSettings:
    url: str
    prefix: str = "kvgate"
    op_timeout: float = 0.1
    heartbeat_interval: float = 0.5
    snapshot_interval: float = 10.0
    stream_maxlen: int = 100_000
    max_pending: int = 50_000
    read_block: float = 0.5
    max_connections: int = 32
    idle_timeout: float = 10.0


# Idle connections kept open past `idle_timeout`: enough for the background loops' steady
# traffic and a trickle of quota calls, so a quiet gateway does not reconnect for each.
_KEEP_IDLE = 2


class RedisStore:
    def __init__(self, settings: RedisStoreSettings) -> None:
        self.settings = settings
        self.replica_id = uuid.uuid4().hex[:12]
        self.link = RedisLink(
            settings.url,
            settings.op_timeout,
            max_connections=settings.max_connections,
            keep_idle=_KEEP_IDLE,
            purpose="quotas and shared-state writes",
        )
        # Only the read loop uses it, one blocking read at a time.
        self.reader = RedisLink(
            settings.url,
            settings.op_timeout,
            max_connections=1,
            keep_idle=1,
            blocking_read=settings.read_block,
            purpose="reading peers' shared state",
        )
        self.link.on_recovered = self._schedule_resync
        self.reader.on_recovered = self._schedule_resync
        self.quotas = RedisQuotaStore(self.link, settings.prefix, lambda: self._replicas)
        self.stats = StoreStats()
        self._topics: dict[str, _Topic] = {}
        self._pending: deque[tuple[str, bytes]] = deque()
        self._wake = asyncio.Event()
        self._recovered = asyncio.Event()
        self._needs_resync = True
        self._load_source: LoadSource = dict
        self._load_sink: LoadSink = _ignore
        self._peer_tables: dict[str, dict[str, ReplicaLoad]] = {}
        self._peer_load: dict[str, ReplicaLoad] = {}
        self._topics[LOAD_TOPIC] = _Topic(LOAD_TOPIC, self._apply_load, None, None, 1000)
        self._replicas = 1
        self._tasks = [
            (OwnedTask("kvgate-state-flush"), self._flush_loop),
            (OwnedTask("kvgate-state-read"), self._read_loop),
            (OwnedTask("kvgate-state-heartbeat"), self._heartbeat_loop),
            (OwnedTask("kvgate-state-load"), self._load_loop),
            (OwnedTask("kvgate-state-snapshot"), self._snapshot_loop),
            (OwnedTask("kvgate-state-idle"), self._close_idle_loop),
        ]

    def _key(self, *parts: str) -> str:
        return ":".join((self.settings.prefix, *parts))

    def adopt_counts(self, old: RedisStore) -> None:
        """Add `old`'s counters (deltas, resyncs, snapshots, the Redis link's calls, failures
        and call durations, quota fallbacks) to this store's: a reload replaces the store,
        and the metrics read from it are counters, which must not reset."""
        for mine, theirs in (
            (self.stats, old.stats),
            (self.link.stats, old.link.stats),
            (self.quotas.stats, old.quotas.stats),
        ):
            for name in (f.name for f in dataclasses.fields(mine)):
                value, earlier = getattr(mine, name), getattr(theirs, name)
                if isinstance(value, list):
                    setattr(mine, name, [a + b for a, b in zip(value, earlier, strict=True)])
                else:
                    setattr(mine, name, value + earlier)

    def share(
        self, topic: str, apply: ApplyDelta, snapshot: TakeSnapshot, restore: ApplyDelta
    ) -> None:
        self._topics[topic] = _Topic(topic, apply, snapshot, restore, self.settings.stream_maxlen)

    def publish(self, topic: str, delta: bytes) -> None:
        if len(self._pending) >= self.settings.max_pending:
            self._pending.popleft()
            self.stats.dropped += 1
        self._pending.append((topic, delta))
        self._wake.set()

    def report_load(self, source: LoadSource, sink: LoadSink) -> None:
        self._load_source = source
        self._load_sink = sink

    def peer_load(self) -> Mapping[str, ReplicaLoad]:
        return self._peer_load

    @property
    def replicas(self) -> int:
        return self._replicas

    @property
    def connected(self) -> bool:
        return not (self.link.breaker.is_open or self.reader.breaker.is_open)

    async def start(self) -> None:
        await self._resync()
        self.quotas.start()
        for task, loop in self._tasks:
            task.start(loop())

    async def stop(self) -> None:
        await self.quotas.stop()
        for task, _ in self._tasks:
            await task.stop()
        with contextlib.suppress(RedisUnavailable):
            await self.link.call(lambda r: r.zrem(self._key("replicas"), self.replica_id))
        await self.link.close()
        await self.reader.close()

    def _schedule_resync(self) -> None:
        self._needs_resync = True
        self._recovered.set()
        self._wake.set()

    async def _resync(self) -> None:
        """Restore each topic from the newest snapshot (if any) and read the stream from the
        snapshot's position; without a snapshot, replay what the trimmed stream still holds."""
        try:
            for topic in self._topics.values():
                if topic.restore is None:
                    continue
                stored = await self.link.call(
                    functools.partial(self._read_snapshot, name=topic.name)
                )
                if stored and b"d" in stored:
                    topic.restore(stored[b"d"])
                    topic.last_id = stored.get(b"id", b"0-0")
                    self.stats.snapshots_restored += 1
                else:
                    topic.last_id = b"0-0"
        except RedisUnavailable:
            return
        self._needs_resync = False
        self.stats.resyncs += 1

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._needs_resync:
                await self._resync()
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(512, len(self._pending)))]
                try:
                    await self.link.call(functools.partial(self._xadd, batch=batch))
                except RedisUnavailable:
                    self._pending.extendleft(reversed(batch))
                    while len(self._pending) > self.settings.max_pending:
                        self._pending.popleft()
                        self.stats.dropped += 1
                    # Back off until the breaker may probe again, or until another loop sees
                    # Redis come back; new deltas alone do not wake this.
                    self._recovered.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.link.breaker.open_for):
                            await self._recovered.wait()
                    self._wake.set()
                    break
                self.stats.published += len(batch)

    async def _read_snapshot(self, client: Any, name: str) -> Any:
        return await client.hgetall(self._key("snapshot", name))

    async def _read_streams(self, client: Any, streams: dict[str, bytes], block_ms: int) -> Any:
        return await client.xread(streams, count=1000, block=block_ms)

    async def _xadd(self, client: Any, batch: list[tuple[str, bytes]]) -> object:
        async with client.pipeline(transaction=False) as pipe:
            for topic, delta in batch:
                pipe.xadd(
                    self._key("stream", topic),
                    {"r": self.replica_id, "d": delta},
                    maxlen=self._topics[topic].maxlen,
                    approximate=True,
                )
            return await pipe.execute()

    async def _read_loop(self) -> None:
        block_ms = int(self.settings.read_block * 1000)
        while True:
            streams = {self._key("stream", t.name): t.last_id for t in self._topics.values()}
            try:
                answer = await self.reader.call(
                    functools.partial(self._read_streams, streams=streams, block_ms=block_ms),
                    limit=self.settings.op_timeout + self.settings.read_block,
                )
            except RedisUnavailable:
                await asyncio.sleep(self.reader.breaker.open_for)
                continue
            self._apply(answer or [])

    def _apply(self, answer: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]) -> None:
        mine = self.replica_id.encode()
        prefix = self._key("stream", "")
        for key, entries in answer:
            topic = self._topics.get(key.decode().removeprefix(prefix))
            if topic is None:
                continue
            for entry_id, fields in entries:
                topic.last_id = entry_id
                if fields.get(b"r") != mine:
                    topic.apply(fields[b"d"])
                    self.stats.applied += 1

    async def _load_loop(self) -> None:
        """Send this replica's load when it changed, and at least every heartbeat."""
        last: dict[str, ReplicaLoad] | None = None
        last_sent = 0.0
        while True:
            await asyncio.sleep(_LOAD_CHECK_SECONDS)
            load = dict(self._load_source())
            now = time.monotonic()
            if load != last or now - last_sent >= self.settings.heartbeat_interval:
                self.publish(
                    LOAD_TOPIC,
                    orjson.dumps(
                        {
                            "r": self.replica_id,
                            "l": {name: [v.inflight, v.queued_tokens] for name, v in load.items()},
                        }
                    ),
                )
                last, last_sent = load, now

    def _apply_load(self, delta: bytes) -> None:
        message = orjson.loads(delta)
        self._peer_tables[message["r"]] = {
            name: ReplicaLoad(int(v[0]), int(v[1])) for name, v in message["l"].items()
        }
        self._sum_peer_load()

    def _sum_peer_load(self) -> None:
        total: dict[str, ReplicaLoad] = {}
        for table in self._peer_tables.values():
            for name, load in table.items():
                total[name] = total[name] + load if name in total else load
        self._peer_load = total
        self._load_sink(total)

    async def _heartbeat_loop(self) -> None:
        """Liveness: announce this replica, count the live ones, forget the dead ones' load."""
        interval = self.settings.heartbeat_interval
        while True:
            try:
                live = await self._heartbeat(interval)
                self._replicas = max(1, len(live))
            except RedisUnavailable:
                live = set()  # serve on local load; keep the last replica count for quotas
            gone = [r for r in self._peer_tables if r not in live]
            for replica in gone:
                del self._peer_tables[replica]
            if gone:
                self._sum_peer_load()
            await asyncio.sleep(interval)

    async def _heartbeat(self, interval: float) -> set[str]:
        now_ms = int(time.time() * 1000)
        ttl_ms = int(interval * 3000)
        replicas_key = self._key("replicas")

        async def beat(r: object) -> list[bytes]:
            async with r.pipeline(transaction=False) as pipe:  # type: ignore[attr-defined]
                pipe.zadd(replicas_key, {self.replica_id: now_ms})
                pipe.zremrangebyscore(replicas_key, 0, now_ms - ttl_ms)
                pipe.zrangebyscore(replicas_key, now_ms - ttl_ms, "+inf")
                return (await pipe.execute())[-1]

        return {p.decode() for p in await self.link.call(beat)}

    async def _close_idle_loop(self) -> None:
        """Connections idle for `idle_timeout` are closed within half of it more."""
        while True:
            await asyncio.sleep(self.settings.idle_timeout / 2)
            await self.link.close_idle(self.settings.idle_timeout)

    async def _snapshot_loop(self) -> None:
        interval = self.settings.snapshot_interval
        while True:
            await asyncio.sleep(interval)
            for topic in [t for t in self._topics.values() if t.snapshot is not None]:
                try:
                    await self._write_snapshot(topic, interval)
                except RedisUnavailable:
                    break

    async def _write_snapshot(self, topic: _Topic, interval: float) -> None:
        lock = self._key("snaplock", topic.name)
        won = await self.link.call(
            lambda r: r.set(lock, self.replica_id, nx=True, px=int(interval * 1000))
        )
        if not won:
            return
        assert topic.snapshot is not None
        data = topic.snapshot()
        await self.link.call(
            lambda r: r.hset(
                self._key("snapshot", topic.name), mapping={"id": topic.last_id, "d": data}
            ),
            limit=max(self.settings.op_timeout, 1.0),
        )
        self.stats.snapshots_written += 1


def _ignore(_: Mapping[str, ReplicaLoad]) -> None:
    return None
