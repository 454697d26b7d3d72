"""The prefix index shared between replicas: every local routing decision is also published as
a delta, and every other replica's deltas are applied as if decided here.

Replicas name an engine by its URL in what they share: an endpoint's name is its position in
the replica's config (`pool-0`, …), and replicas whose configs list the engines differently (a
rolling config change) would otherwise credit one engine's cache to another. A URL no local
endpoint has is ignored; one that several local endpoints share (one engine in two pools)
applies to each.

Delta: `<u16 URL length><engine URL><u64 block hash>*` (little-endian). Snapshot: per engine
`<u16 URL length><URL><u32 n><n u64 hashes><n f32 ages in seconds>`, oldest first; ages rather
than timestamps because monotonic clocks differ between hosts.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence

from kvgate.routing.prefix_hasher import hashed
from kvgate.routing.prefix_index import PrefixIndex
from kvgate.state.store import Store

# Versioned: replicas of a kvgate that keyed deltas by endpoint name read another topic.
TOPIC = "prefix.by-url"


class SharedPrefixIndex(PrefixIndex):
    """`urls`: each local endpoint's engine URL, by endpoint name."""

    def __init__(
        self,
        store: Store,
        urls: Mapping[str, str],
        default_capacity: int = 31_250,
        ttl: float = 600.0,
        max_capacity: int = 1_000_000,
    ) -> None:
        super().__init__(default_capacity, ttl, max_capacity)
        self.store = store
        self._url_of = dict(urls)
        self._names_of: dict[str, list[str]] = {}
        for name, url in urls.items():
            self._names_of.setdefault(url, []).append(name)
        store.share(TOPIC, self.apply_delta, self.snapshot, self.restore)

    def record(self, endpoint: str, hashes: Sequence[int], now: float | None = None) -> None:
        hashes = hashed(hashes)  # the delta carries every hash: hash now, keep arrays
        super().record(endpoint, hashes, now)
        url = self._url_of.get(endpoint)
        if hashes and url is not None:
            self.store.publish(TOPIC, encode_delta(url, hashes))

    def apply_delta(self, delta: bytes) -> None:
        url, hashes = decode_delta(delta)
        for endpoint in self._names_of.get(url, ()):
            super().record(endpoint, hashes)

    def snapshot(self) -> bytes:
        now = time.monotonic()
        parts: list[bytes] = []
        for endpoint, blocks in self._blocks.items():
            url = self._url_of.get(endpoint)
            if url is None:
                continue
            items = blocks.items()
            name = url.encode()
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
            url = data[offset : offset + name_length].decode()
            offset += name_length
            (count,) = struct.unpack_from("<I", data, offset)
            offset += 4
            hashes = struct.unpack_from(f"<{count}Q", data, offset)
            offset += 8 * count
            ages = struct.unpack_from(f"<{count}f", data, offset)
            offset += 4 * count
            touched = [now - age for age in ages]
            for endpoint in self._names_of.get(url, ()):
                self.load(endpoint, hashes, touched, now)


def encode_delta(url: str, hashes: Sequence[int]) -> bytes:
    name = url.encode()
    return struct.pack(f"<H{len(name)}s{len(hashes)}Q", len(name), name, *hashes)


def decode_delta(delta: bytes) -> tuple[str, tuple[int, ...]]:
    (name_length,) = struct.unpack_from("<H", delta)
    url = delta[2 : 2 + name_length].decode()
    body = delta[2 + name_length :]
    return url, struct.unpack(f"<{len(body) // 8}Q", body)
