"""The embedded default: one process, no peers, nothing to share."""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from kvgate.state.quotas import InMemoryQuotaStore
from kvgate.state.store import ApplyDelta, LoadSink, LoadSource, ReplicaLoad, TakeSnapshot


class MemoryStore:
    """Single-process state. Local views are the whole truth, so sharing is a no-op."""

    def __init__(self) -> None:
        self.replica_id = uuid.uuid4().hex[:12]
        self.quotas = InMemoryQuotaStore()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def share(
        self, topic: str, apply: ApplyDelta, snapshot: TakeSnapshot, restore: ApplyDelta
    ) -> None:
        return None

    def publish(self, topic: str, delta: bytes) -> None:
        return None

    def report_load(self, source: LoadSource, sink: LoadSink) -> None:
        return None

    def peer_load(self) -> Mapping[str, ReplicaLoad]:
        return {}

    @property
    def replicas(self) -> int:
        return 1
