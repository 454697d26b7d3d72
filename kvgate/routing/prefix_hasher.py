"""Chained block hashes of prompt text: the names the prefix index keeps per endpoint.

Prompts are cut into fixed blocks of `block_chars` UTF-8 bytes (64 by default, about 16 tokens)
and each full block gets a chained 64-bit hash that names the whole prefix up to its end:
`(offset + k) << 32 | crc` for block k, where `crc` is the CRC-32 of the block continued from
block k - 1's. The chain's seed is a 64-bit BLAKE2b of the model and the tenant's cache salt:
its low 32 bits start the CRC and its top 31 bits are `offset`. So element k names the first
k + 1 blocks, prefixes of different lengths under one seed never share a hash, prefixes of other
models or of tenants whose KV the engines keep apart meet only by a chance collision (below),
and the hashes are deterministic across processes (no `PYTHONHASHSEED`), which lets replicas
exchange them.

Why one CRC-32 per block and not 64 bits of checksum: hashing runs on every routing decision
and the CRC call is most of its cost; a second checksum per block (`adler32`, as before) makes
it about 20% slower for bits routing does not need. A probe for a prefix that an endpoint does
not hold hits falsely only if the endpoint holds another prefix with the same high word (the
same length and seed, or by rare coincidence another seed's offset plus length) and the same
32-bit CRC: probability n / 2**32, with n the number of entries with that high word. At the
`max_capacity` of one million entries that is at most 2.3e-4 (every entry one block long) and
about 1e-6 when they spread over 256 depths; and CRC-32 never confuses two prefixes that differ
in one run of up to 32 bits (an edited character or number). A false hit only overstates one
endpoint's cached prefix in one decision: the engine checks its cache by its own hashes, so no
answer changes. The blocks are cut by one `struct` call and hashed in one comprehension, with no
per-block slicing or function calls of our own.

Hashing is lazy (`PrefixHasher.chain`): the first block is hashed at once — it finds the
endpoints that may hold the prompt — and the rest when something needs it. A prompt nobody
holds is recorded as a leaf that keeps its bytes; a later prompt that starts like it is
compared with it by bytes (memcmp), so a conversation that only grows, or a prompt never seen
again, is never hashed past its first block. The rest is hashed when a later prompt shares a
part of it and then leaves it (the shared blocks become entries of their own), or when a
replica needs the hashes (`SharedPrefixIndex` hashes every prompt it records).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import overload

_DEPTH = 1 << 32


class PrefixHasher:
    """Chained block hashes of prompt text, at most `max_blocks` of them.

    The last `recent` prompts' hashed bytes and hashes are kept, by seed and first block, and
    no more of them than `recent_bytes` of prompt bytes hold (older ones go first): a prompt
    that starts like one of them (the next turn of a conversation, another question under the
    same system prompt) reuses the hashes of the blocks they share, found by comparing bytes
    (memcmp), and hashes only the rest. The hashes are the same either way."""

    def __init__(
        self,
        block_chars: int = 64,
        max_blocks: int = 2048,
        recent: int = 128,
        recent_bytes: int = 4 << 20,
    ) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be positive")
        if max_blocks > 1 << 31:
            raise ValueError("max_blocks must be below 2**31 (the depth takes 32 bits)")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.recent = recent
        self.recent_bytes = recent_bytes
        # One struct per block count: cuts `count` blocks in one C call (bytes objects).
        self._cutters: dict[int, Callable[[bytes, int], tuple[bytes, ...]]] = {}
        self._recent: OrderedDict[tuple[int, bytes], tuple[bytes, PromptChain]] = OrderedDict()
        self._recent_held = 0  # bytes of the remembered prompts

    def hashes(self, text: str, model: str, salt: str | None = None) -> list[int]:
        """Hashes of the full blocks of `text`; element k names the first k + 1 blocks."""
        return self.chain(text, model, salt).hashes()

    def chain(self, text: str, model: str, salt: str | None = None) -> PromptChain:
        """The same hashes as `hashes`, computed when first needed past the first block: a
        prompt nobody holds is routed and recorded on its first block alone."""
        size = self.block_chars
        # Only the first max_blocks blocks are hashed: encode no more characters than that
        # (a character is at least one byte, so this still covers every hashed block).
        data = text[: size * self.max_blocks].encode()
        count = min(len(data) // size, self.max_blocks)
        data = data[: count * size]
        seed = int.from_bytes(
            hashlib.blake2b(f"{model}\x00{salt or ''}".encode(), digest_size=8).digest(), "little"
        )
        if not count or not self.recent:
            return PromptChain(self, data, seed, [])
        key = (seed, data[:size])
        seen = self._recent.get(key)
        if seen is None:
            chain = PromptChain(self, data, seed, [])
        else:
            before, known = seen
            shared = shared_blocks(data, before, size)
            chain = (
                known
                if shared == count == len(known)
                else PromptChain(self, data, seed, known.prefix(shared))
            )
            self._recent.move_to_end(key)
            self._recent_held -= len(before)
        self._recent[key] = (data, chain)
        self._recent_held += len(data)
        while len(self._recent) > self.recent or (
            self._recent_held > self.recent_bytes and len(self._recent) > 1
        ):
            self._recent_held -= len(self._recent.popitem(last=False)[1][0])
        return chain

    def _chain(self, data: bytes, seed: int, known: list[int]) -> list[int]:
        """`known` (the hashes of data's first blocks) extended to every block of `data`."""
        size = self.block_chars
        done = len(known)
        count = len(data) // size
        first = ((seed >> 33) + done) * _DEPTH
        crc = known[-1] & 0xFFFFFFFF if known else seed & 0xFFFFFFFF
        cut = self._cutters.get(count - done)
        if cut is None:
            cut = self._cutters[count - done] = struct.Struct(
                f"{size}s" * (count - done)
            ).unpack_from
        crc32 = zlib.crc32
        known += [
            depth | (crc := crc32(block, crc))
            for depth, block in zip(
                range(first, first + (count - done) * _DEPTH, _DEPTH),
                cut(data, done * size),
                strict=True,
            )
        ]
        return known


def shared_blocks(data: bytes, other: bytes, size: int) -> int:
    """How many leading `size`-byte blocks `data` and `other` have in common: one C comparison
    when one extends the other, else a binary search that compares only the bytes between the
    blocks known equal and the middle (in place, no copies: a prompt's bytes are tens of KB)."""
    blocks = min(len(data), len(other)) // size
    view = memoryview(other)
    if data.startswith(view[: blocks * size]):
        return blocks
    low, high = 0, blocks - 1  # the answer lies in low .. high
    while low < high:
        middle = (low + high + 1) // 2
        if data.startswith(view[low * size : middle * size], low * size):
            low = middle
        else:
            high = middle - 1
    return low


class PromptChain(Sequence[int]):
    """A prompt's chained block hashes (`PrefixHasher.chain`), hashed when something first
    needs one past the first block; until then it keeps the prompt's bytes. Slicing from the
    start keeps it unhashed; a leaf that holds it compares it with another unhashed chain by
    their bytes (`common_prefix`), so a prompt that is only ever extended or repeated, or never
    seen again, is never hashed past its first block."""

    __slots__ = ("_hasher", "_hashes", "_known", "_seed", "data", "first")

    def __init__(self, hasher: PrefixHasher, data: bytes, seed: int, known: list[int]) -> None:
        self._hasher = hasher
        self.data = data
        self._seed = seed
        self._hashes: list[int] | None = None
        if not known and data:
            known = hasher._chain(data[: hasher.block_chars], seed, [])
        self._known = known  # the hashes of the first blocks, at least the first
        self.first = known[0] if known else -1

    def __len__(self) -> int:
        return len(self.data) // self._hasher.block_chars

    @property
    def block_chars(self) -> int:
        return self._hasher.block_chars

    @property
    def hashed(self) -> bool:
        return self._hashes is not None

    def hashes(self) -> list[int]:
        """Every block's hash (hashing the rest now, once)."""
        if self._hashes is None:
            self._hashes = self.peek()
        return self._hashes

    def peek(self) -> list[int]:
        """Every block's hash, leaving the chain as it was (hashed or not)."""
        if self._hashes is not None:
            return self._hashes
        known = self._known
        if len(known) == len(self):
            return known
        return self._hasher._chain(self.data, self._seed, list(known))

    def prefix(self, count: int) -> list[int]:
        """The first `count` hashes, hashing no further than that."""
        if self._hashes is not None:
            return self._hashes[:count]
        if len(self._known) < count:
            self._known = self._hasher._chain(
                self.data[: count * self._hasher.block_chars], self._seed, list(self._known)
            )
        return self._known[:count]

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if type(index) is int:
            return self.first if index == 0 else self.hashes()[index]
        assert isinstance(index, slice)
        start, stop, step = index.indices(len(self))
        if self._hashes is None and start == 0 and step == 1:
            if stop == len(self):
                return self
            if stop <= 0:
                return []
            # The first `stop` blocks, still unhashed.
            return PromptChain(
                self._hasher,
                self.data[: stop * self._hasher.block_chars],
                self._seed,
                self._known[:stop],
            )
        return self.hashes()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.hashes())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.hashes())


def hashed(hashes: Sequence[int]) -> Sequence[int]:
    """`hashes` with every hash computed (a `PromptChain`'s list)."""
    return hashes.hashes() if type(hashes) is PromptChain else hashes
