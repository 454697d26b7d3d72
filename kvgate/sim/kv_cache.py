"""A paged KV cache with automatic prefix caching, modelled on vLLM's block pool.

The pool has `num_blocks` blocks of `block_size` tokens. A full block is identified by a
chained hash of its tokens and its parent's hash; the first block's hash mixes in the
request's `cache_salt`, so requests with different salts never share blocks. Blocks no
request references stay cached in a free list kept in LRU order and are evicted (their hash
forgotten) only when a new allocation needs them.
"""

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

BlockHash = int


class EvictionListener(Protocol):
    """Told when cached blocks stop being cached (the KV-event publisher)."""

    def removed(self, block_hashes: list[BlockHash]) -> None:
        """`block_hashes` were evicted to make room for an allocation."""

    def cleared(self) -> None:
        """Every cached block was forgotten (prefix cache reset)."""


def extend_block_hashes(
    hashes: list[BlockHash],
    tokens: Sequence[str],
    num_tokens: int,
    block_size: int,
    salt: str | None,
) -> None:
    """Append to `hashes` the chained hashes of the full blocks within `tokens[:num_tokens]`.

    `hashes` must already hold the hashes of the blocks before its length; only the new
    blocks' tokens are read, so extending once per block keeps the cost O(1) per token.
    Hashes are stable within one process, which is all an in-process cache needs.
    """
    parent = hashes[-1] if hashes else None
    for index in range(len(hashes), num_tokens // block_size):
        block = tuple(tokens[index * block_size : (index + 1) * block_size])
        parent = hash((salt, block)) if index == 0 else hash((parent, block))
        hashes.append(parent)


class BlockPool:
    """Fixed pool of KV blocks; all methods are O(blocks touched)."""

    def __init__(
        self, num_blocks: int, block_size: int, listener: EvictionListener | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._listener = listener
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[BlockHash | None] = [None] * num_blocks
        self._block_of_hash: dict[BlockHash, int] = {}
        # Unreferenced blocks, least recently used first: eviction takes from the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks no request references (cached or empty)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, in [0, 1] (vLLM's kv_cache_usage)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Return the blocks holding the longest cached prefix of `hashes` (no side effects)."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_free_besides(self, blocks: Sequence[int]) -> int:
        """Free blocks left for new allocations once `blocks` are referenced."""
        return len(self._free) - sum(1 for block in blocks if self._ref_counts[block] == 0)

    def reference(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached `blocks` (a prefix hit), removing them from the free list."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks, evicting least recently used cached ones; None if too few."""
        if count > len(self._free):
            return None
        blocks = []
        evicted = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old_hash = self._hash_of_block[block]
            if old_hash is not None:
                del self._block_of_hash[old_hash]
                self._hash_of_block[block] = None
                evicted.append(old_hash)
            self._ref_counts[block] = 1
            blocks.append(block)
        if evicted and self._listener is not None:
            self._listener.removed(evicted)
        return blocks

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Record that the full `block` holds the tokens `block_hash` names; True if it is
        now cached under that hash.

        When another block already holds the same content, the first one stays the cached
        copy and `block` remains anonymous (it is simply freed later): False.
        """
        if block_hash in self._block_of_hash or self._hash_of_block[block] is not None:
            return False
        self._block_of_hash[block_hash] = block
        self._hash_of_block[block] = block_hash
        return True

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of `blocks`.

        Blocks are freed tail first, so a sequence's last blocks are evicted before its
        first ones (shared prefixes survive longest), as in vLLM.
        """
        for block in reversed(blocks):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (referenced blocks keep their contents but stop sharing)."""
        self._block_of_hash.clear()
        self._hash_of_block = [None] * self.num_blocks
        if self._listener is not None:
            self._listener.cleared()
