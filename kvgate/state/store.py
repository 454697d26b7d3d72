"""What gateway processes share, behind one small protocol.

Every process keeps its own in-memory view (prefix index, endpoint load, quota buckets); a Store
carries what the other processes need to know, off the request path:

- **deltas**: compact, topic-tagged byte strings (e.g. "endpoint E now caches blocks B")
  published fire-and-forget and applied by every other replica; with periodic snapshots so a
  new replica warms up;
- **load**: each replica's per-endpoint in-flight requests and queued tokens, heartbeated with
  a TTL so a dead replica's counts expire on their own; readers see the sum over live peers;
- **quotas**: per-tenant token buckets (`kvgate.state.quotas.QuotaStore`).

`MemoryStore` is the embedded single-process default (no peers). `RedisStore` shares through
Redis and falls back to local state while Redis is unreachable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvgate.state.quotas import QuotaStore


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load on one endpoint, as it shares it with the others."""

    inflight: int = 0
    queued_tokens: int = 0

    def __add__(self, other: ReplicaLoad) -> ReplicaLoad:
        return ReplicaLoad(self.inflight + other.inflight, self.queued_tokens + other.queued_tokens)


ApplyDelta = Callable[[bytes], None]
TakeSnapshot = Callable[[], bytes]
LoadSource = Callable[[], Mapping[str, ReplicaLoad]]
LoadSink = Callable[[Mapping[str, ReplicaLoad]], None]


class Store(Protocol):
    @property
    def replica_id(self) -> str: ...

    @property
    def quotas(self) -> QuotaStore: ...

    async def start(self) -> None:
        """Connect and start background sync; never fails because a backend is down."""
        ...

    async def stop(self) -> None: ...

    def share(
        self, topic: str, apply: ApplyDelta, snapshot: TakeSnapshot, restore: ApplyDelta
    ) -> None:
        """Register a shared topic before `start()`: `apply` receives other replicas' deltas,
        `snapshot` serialises the local view, `restore` loads a snapshot taken elsewhere."""
        ...

    def publish(self, topic: str, delta: bytes) -> None:
        """Queue a delta for the other replicas. Never blocks, never raises."""
        ...

    def report_load(self, source: LoadSource, sink: LoadSink) -> None:
        """`source` gives this replica's per-endpoint load for each heartbeat; `sink` receives
        the peers' summed load after each heartbeat (empty when alone or Redis is lost)."""
        ...

    def peer_load(self) -> Mapping[str, ReplicaLoad]:
        """Per-endpoint load summed over the other live replicas (empty when alone)."""
        ...

    @property
    def replicas(self) -> int:
        """Live replicas including this one (1 when alone or when the backend is lost)."""
        ...
