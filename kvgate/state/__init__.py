"""Shared state: the Store protocol, its memory and Redis implementations, and quotas.

A leaf: nothing here imports the rest of kvgate (a test holds the rule).
"""

from __future__ import annotations

from kvgate.state.memory import MemoryStore
from kvgate.state.redis_store import RedisStore, RedisStoreSettings
from kvgate.state.store import ReplicaLoad, Store

__all__ = ["MemoryStore", "RedisStore", "RedisStoreSettings", "ReplicaLoad", "Store"]
