"""The prefix index shared between replicas: every local routing decision is also published as
a delta, and every other replica's deltas are applied as if decided here.

Delta: `<u8 name length><endpoint name><u64 block hash>*` (little-endian). Snapshot: per
endpoint `<u16 name length><name><u32 n><n u64 hashes><n f32 ages in seconds>`, oldest first;
ages rather than timestamps because monotonic clocks differ between hosts.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence

from kvgate.routing.prefix_hasher import hashed
from kvgate.routing.prefix_index import PrefixIndex
from kvgate.state.store import Store

TOPIC = "prefix"


class SharedPrefixIndex(PrefixIndex):
    def __init__(
        self,
        store: Store,
        default_capacity: int = 31_250,
        ttl: float = 600.0,
        max_capacity: int = 1_000_000,
    ) -> None:
        super().__init__(default_capacity, ttl, max_capacity)
        self.store = store
        store.share(TOPIC, self.apply_delta, self.snapshot, self.restore)

    def record(self, endpoint: str, hashes: Sequence[int], now: float | None = None) -> None:
        hashes = hashed(hashes)  # the delta carries every hash: hash now, keep arrays
        super().record(endpoint, hashes, now)
        if hashes:
            self.store.publish(TOPIC, encode_delta(endpoint, hashes))

    def apply_delta(self, delta: bytes) -> None:
        endpoint, hashes = decode_delta(delta)
        super().record(endpoint, hashes)

    def snapshot(self) -> bytes:
        now = time.monotonic()
        parts: list[bytes] = []
        for endpoint, blocks in self._blocks.items():
            items = blocks.items()
            name = endpoint.encode()
            parts.append(struct.pack(f"<H{len(name)}sI", len(name), name, len(items)))
            parts.append(struct.pack(f"<{len(items)}Q", *(h for h, _ in items)))
            parts.append(struct.pack(f"<{len(items)}f", *(now - t for _, t in items)))
        return b"".join(parts)

    def restore(self, data: bytes) -> None:
        now = time.monotonic()
        offset = 0
        while offset < len(data):
            (name_length,) = struct.unpack_from("<H", data, offset)
            offset += 2
            endpoint = data[offset : offset + name_length].decode()
            offset += name_length
            (count,) = struct.unpack_from("<I", data, offset)
            offset += 4
            hashes = struct.unpack_from(f"<{count}Q", data, offset)
            offset += 8 * count
            ages = struct.unpack_from(f"<{count}f", data, offset)
            offset += 4 * count
            self.load(endpoint, hashes, [now - age for age in ages], now)


def encode_delta(endpoint: str, hashes: Sequence[int]) -> bytes:
    name = endpoint.encode()
    return struct.pack(f"<B{len(name)}s{len(hashes)}Q", len(name), name, *hashes)


def decode_delta(delta: bytes) -> tuple[str, tuple[int, ...]]:
    name_length = delta[0]
    endpoint = delta[1 : 1 + name_length].decode()
    body = delta[1 + name_length :]
    return endpoint, struct.unpack(f"<{len(body) // 8}Q", body)
