"""Shared state through Redis, entirely off the request path.

Keys (all under `prefix`):
    {p}:stream:{topic}     Redis Stream of deltas, fields r=replica id, d=delta; trimmed ~maxlen
    {p}:snapshot:{topic}   hash {id: last stream id applied, d: snapshot bytes}
    {p}:snaplock:{topic}   SET NX PX lock: one replica writes the snapshot per interval
    {p}:load:{replica}     hash endpoint → "inflight,queued_tokens"; expires after 3 heartbeats
    {p}:replicas           sorted set replica → last heartbeat (ms)

Publishing only appends to a bounded local queue; background tasks flush it, read the other
replicas' deltas, heartbeat load and write snapshots. When Redis is lost every loop backs off
behind the link's breaker, the gateway keeps serving on local state, and on recovery the
replica resyncs from the newest snapshot and the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.state.redis_link import RedisLink, RedisUnavailable
from gateway.state.redis_quota import RedisQuotaStore
from gateway.state.store import ApplyDelta, EndpointLoad, LoadSource, TakeSnapshot

log = logging.getLogger("kvgate.state")


@dataclass(slots=True)
class _Topic:
    name: str
    apply: ApplyDelta
    snapshot: TakeSnapshot
    restore: ApplyDelta
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


class RedisStore:
    def __init__(self, settings: RedisStoreSettings) -> None:
        self.settings = settings
        self.replica_id = uuid.uuid4().hex[:12]
        self.link = RedisLink(settings.url, settings.op_timeout)
        self.reader = RedisLink(settings.url, settings.op_timeout,
                                blocking_read=settings.read_block)
        self.link.on_recovered = self._schedule_resync
        self.reader.on_recovered = self._schedule_resync
        self.quotas = RedisQuotaStore(self.link, settings.prefix, lambda: self._replicas)
        self.stats = StoreStats()
        self._topics: dict[str, _Topic] = {}
        self._pending: deque[tuple[str, bytes]] = deque()
        self._wake = asyncio.Event()
        self._needs_resync = True
        self._load_source: LoadSource = dict
        self._peer_load: dict[str, EndpointLoad] = {}
        self._replicas = 1
        self._tasks: list[asyncio.Task[None]] = []

    def _key(self, *parts: str) -> str:
        return ":".join((self.settings.prefix, *parts))

    def share(self, topic: str, apply: ApplyDelta, snapshot: TakeSnapshot,
              restore: ApplyDelta) -> None:
        self._topics[topic] = _Topic(topic, apply, snapshot, restore)

    def publish(self, topic: str, delta: bytes) -> None:
        if len(self._pending) >= self.settings.max_pending:
            self._pending.popleft()
            self.stats.dropped += 1
        self._pending.append((topic, delta))
        self._wake.set()

    def report_load(self, source: LoadSource) -> None:
        self._load_source = source

    def peer_load(self) -> Mapping[str, EndpointLoad]:
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
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._flush_loop(), name="kvgate-state-flush"),
            loop.create_task(self._read_loop(), name="kvgate-state-read"),
            loop.create_task(self._heartbeat_loop(), name="kvgate-state-heartbeat"),
            loop.create_task(self._snapshot_loop(), name="kvgate-state-snapshot"),
        ]

    async def stop(self) -> None:
        await self.quotas.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(RedisUnavailable):
            await self.link.call(lambda r: r.zrem(self._key("replicas"), self.replica_id))
        await self.link.close()
        await self.reader.close()

    def _schedule_resync(self) -> None:
        self._needs_resync = True
        self._wake.set()

    async def _resync(self) -> None:
        """Restore each topic from the newest snapshot (if any) and read the stream from the
        snapshot's position; without a snapshot, replay what the trimmed stream still holds."""
        try:
            for topic in self._topics.values():
                stored = await self.link.call(
                    lambda r, t=topic: r.hgetall(self._key("snapshot", t.name)))
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
                    await self.link.call(lambda r, b=batch: self._xadd(r, b))
                except RedisUnavailable:
                    self._pending.extendleft(reversed(batch))
                    while len(self._pending) > self.settings.max_pending:
                        self._pending.popleft()
                        self.stats.dropped += 1
                    await asyncio.sleep(self.link.breaker.open_for)
                    break
                self.stats.published += len(batch)

    async def _xadd(self, client: object, batch: list[tuple[str, bytes]]) -> object:
        pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
        for topic, delta in batch:
            pipe.xadd(self._key("stream", topic), {"r": self.replica_id, "d": delta},
                      maxlen=self.settings.stream_maxlen, approximate=True)
        return await pipe.execute()

    async def _read_loop(self) -> None:
        block_ms = int(self.settings.read_block * 1000)
        while True:
            if not self._topics:
                return
            streams = {self._key("stream", t.name): t.last_id for t in self._topics.values()}
            try:
                answer = await self.reader.call(
                    lambda r, s=streams: r.xread(s, count=1000, block=block_ms),
                    limit=self.settings.op_timeout + self.settings.read_block)
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

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        while True:
            try:
                await self._heartbeat(interval)
            except RedisUnavailable:
                self._peer_load = {}
            await asyncio.sleep(interval)

    async def _heartbeat(self, interval: float) -> None:
        now_ms = int(time.time() * 1000)
        ttl_ms = int(interval * 3000)
        mine = {name: f"{load.inflight},{load.queued_tokens}"
                for name, load in self._load_source().items()}
        load_key = self._key("load", self.replica_id)
        replicas_key = self._key("replicas")

        async def beat(r: object) -> list[bytes]:
            pipe = r.pipeline(transaction=False)  # type: ignore[attr-defined]
            pipe.delete(load_key)
            if mine:
                pipe.hset(load_key, mapping=mine)
            pipe.pexpire(load_key, ttl_ms)
            pipe.zadd(replicas_key, {self.replica_id: now_ms})
            pipe.zremrangebyscore(replicas_key, 0, now_ms - ttl_ms)
            pipe.zrangebyscore(replicas_key, now_ms - ttl_ms, "+inf")
            return (await pipe.execute())[-1]

        live = await self.link.call(beat)
        peers = [p.decode() for p in live if p.decode() != self.replica_id]

        async def read_peers(r: object) -> list[dict[bytes, bytes]]:
            pipe = r.pipeline(transaction=False)  # type: ignore[attr-defined]
            for peer in peers:
                pipe.hgetall(self._key("load", peer))
            return await pipe.execute()

        tables = await self.link.call(read_peers) if peers else []
        total: dict[str, EndpointLoad] = {}
        for table in tables:
            for name, value in table.items():
                inflight, _, tokens = value.partition(b",")
                load = EndpointLoad(int(inflight), int(tokens or 0))
                key = name.decode()
                total[key] = total[key] + load if key in total else load
        self._peer_load = total
        self._replicas = 1 + len(peers)

    async def _snapshot_loop(self) -> None:
        interval = self.settings.snapshot_interval
        while True:
            await asyncio.sleep(interval)
            for topic in list(self._topics.values()):
                try:
                    await self._write_snapshot(topic, interval)
                except RedisUnavailable:
                    break

    async def _write_snapshot(self, topic: _Topic, interval: float) -> None:
        lock = self._key("snaplock", topic.name)
        won = await self.link.call(lambda r: r.set(lock, self.replica_id, nx=True,
                                                   px=int(interval * 1000)))
        if not won:
            return
        data = topic.snapshot()
        await self.link.call(lambda r: r.hset(self._key("snapshot", topic.name),
                                              mapping={"id": topic.last_id, "d": data}),
                             limit=max(self.settings.op_timeout, 1.0))
        self.stats.snapshots_written += 1
