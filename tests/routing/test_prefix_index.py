"""Chained block hashing and the bounded per-endpoint LRU with TTL."""

from __future__ import annotations

import pytest

from gateway.routing.prefix_index import BYTES_PER_ENTRY, EndpointBlocks, PrefixHasher, PrefixIndex
from gateway.routing.prompt_text import prompt_text

HASHER = PrefixHasher(block_chars=8, max_blocks=4)


def test_only_full_blocks_are_hashed_up_to_the_cap():
    assert HASHER.hashes("1234567", "m") == []
    assert len(HASHER.hashes("12345678", "m")) == 1
    assert len(HASHER.hashes("x" * 100, "m")) == 4


def test_hashes_are_chained_prefix_names():
    a = HASHER.hashes("AAAAAAAABBBBBBBBCCCCCCCC", "m")
    b = HASHER.hashes("AAAAAAAABBBBBBBBDDDDDDDD", "m")
    c = HASHER.hashes("ZAAAAAAABBBBBBBBCCCCCCCC", "m")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c, strict=True))  # a change early changes every name
    assert len(set(HASHER.hashes("AAAAAAAAAAAAAAAA", "m"))) == 2  # same block text, new depth


@pytest.mark.parametrize(("model", "salt"), [("other", None), ("m", "tenant-a")])
def test_model_and_cache_salt_seed_the_chain(model, salt):
    base = HASHER.hashes("AAAAAAAABBBBBBBB", "m")
    assert set(HASHER.hashes("AAAAAAAABBBBBBBB", model, salt)).isdisjoint(base)


def test_hashes_are_stable_across_processes():
    import subprocess
    import sys

    code = ("from gateway.routing.prefix_index import PrefixHasher;"
            "print(PrefixHasher(8, 4).hashes('AAAAAAAABBBBBBBB', 'm', 's'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == str(HASHER.hashes("AAAAAAAABBBBBBBB", "m", "s"))


def test_lru_is_bounded_and_evicts_deepest_blocks_first():
    blocks = EndpointBlocks(capacity=3, ttl=100)
    blocks.record([1, 2, 3], now=0)
    blocks.record([10, 20], now=1)
    assert len(blocks) == 3 and blocks.evictions == 2
    assert 10 in blocks and 20 in blocks and 1 in blocks  # 3 then 2 went first
    assert blocks.depth([1, 2, 3], now=1) == 1
    assert blocks.depth([10, 20, 30], now=1) == 2


def test_ttl_expires_entries():
    blocks = EndpointBlocks(capacity=10, ttl=5)
    blocks.record([1, 2], now=0)
    assert blocks.depth([1, 2], now=4) == 2
    assert blocks.depth([1, 2], now=6) == 0
    blocks.record([7], now=6)
    assert len(blocks) == 1  # expired entries trimmed on the next record


def test_index_match_record_evict_clear_and_memory():
    index = PrefixIndex(default_capacity=100, ttl=60)
    hashes = [11, 12, 13, 14]
    assert index.match(hashes, ["a", "b"]) == {"a": 0, "b": 0}
    index.record("a", hashes[:3])
    index.record("b", hashes[:1])
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.evict("a", [13])
    assert index.match(hashes, ["a"]) == {"a": 2}
    assert index.entries() == 3 and index.memory_bytes == 3 * BYTES_PER_ENTRY
    index.clear("a")
    assert index.entries("a") == 0
    index.set_capacity("b", 10**9)
    assert index.capacity("b") == index.max_capacity


def test_memory_stays_bounded_under_many_prompts():
    index = PrefixIndex(default_capacity=1000, ttl=600)
    hasher = PrefixHasher()
    for i in range(300):
        index.record("a", hasher.hashes(f"prompt {i} " * 100, "m"))
    assert index.entries("a") == 1000
    assert index.evictions("a") > 0


def test_prompt_text_is_prefix_preserving_across_turns():
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "A1"},
                          {"role": "user", "content": [{"type": "text", "text": "Q2"}]}]}
    assert prompt_text(turn2).startswith(prompt_text(turn1))
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({"input": "x"}) == ""
    tools = {"tools": [{"type": "function"}], "messages": turn1["messages"]}
    assert prompt_text(tools) != prompt_text(turn1)
