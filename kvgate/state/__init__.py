"""Shared state: the Store protocol and its memory and Redis implementations."""

from __future__ import annotations

from kvgate.config import StateConfig
from kvgate.state.memory import MemoryStore
from kvgate.state.redis_store import RedisStore, RedisStoreSettings
from kvgate.state.store import EndpointLoad, Store

__all__ = ["EndpointLoad", "MemoryStore", "RedisStore", "Store", "build_store"]


def build_store(config: StateConfig) -> MemoryStore | RedisStore:
    if config.backend == "memory":
        return MemoryStore()
    assert config.url is not None
    return RedisStore(
        RedisStoreSettings(
            url=config.url,
            prefix=config.key_prefix,
            op_timeout=config.op_timeout,
            heartbeat_interval=config.heartbeat_interval,
            snapshot_interval=config.snapshot_interval,
            stream_maxlen=config.stream_maxlen,
        )
    )
