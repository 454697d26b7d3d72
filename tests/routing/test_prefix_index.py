"""Chained block hashing and the bounded per-endpoint LRU with TTL."""

from __future__ import annotations

import hashlib
import math
import random
import time
import zlib
from collections import OrderedDict

import pytest

from kvgate.prompt_view import prompt_text
from kvgate.routing.prefix_hasher import PrefixHasher, shared_blocks
from kvgate.routing.prefix_index import BYTES_PER_ROOT, PrefixIndex
from kvgate.routing.prefix_tree import BYTES_PER_LEAF, BYTES_PER_LEAF_BLOCK, EndpointBlocks

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

    text = "system prompt ü " * 40
    code = (
        "from kvgate.routing.prefix_hasher import PrefixHasher;"
        f"print(PrefixHasher(8, 64).hashes({text!r}, 'm', 's'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    ).stdout
    assert out.strip() == str(PrefixHasher(8, 64).hashes(text, "m", "s"))


def test_hashes_follow_the_documented_formula():
    """Block k of a chain seeded by BLAKE2b(model, salt): (offset + k) << 32 | chained CRC-32."""
    text = "The quick brown fox jumps over the lazy dog. " * 30
    seed = int.from_bytes(hashlib.blake2b(b"m\x00s", digest_size=8).digest(), "little")
    crc, expected = seed & 0xFFFFFFFF, []
    data = text.encode()
    for k in range(len(data) // 64):
        crc = zlib.crc32(data[64 * k : 64 * (k + 1)], crc)
        expected.append((seed >> 33) + k << 32 | crc)
    assert PrefixHasher(64, 1000).hashes(text, "m", "s") == expected
    assert all(0 <= h < 2**64 for h in expected)


def test_multibyte_text_is_cut_in_bytes_and_capped():
    hasher = PrefixHasher(block_chars=8, max_blocks=3)
    assert len(hasher.hashes("ü" * 4, "m")) == 1  # 8 bytes
    assert len(hasher.hashes("ü" * 100, "m")) == 3
    assert hasher.hashes("ü" * 100, "m") == PrefixHasher(8, 50).hashes("ü" * 100, "m")[:3]


def test_reusing_recent_prompts_gives_the_same_hashes_as_hashing_from_scratch():
    rng = random.Random(7)
    systems = [
        "".join(rng.choice("abcü ") for _ in range(rng.randrange(40, 200))) for _ in range(4)
    ]
    remembering, scratch = PrefixHasher(8, 40, recent=3), PrefixHasher(8, 40, recent=0)
    history = ""
    for step in range(300):
        kind = rng.randrange(4)
        if kind == 0:  # the next turn of a conversation
            history += "".join(rng.choice("xyz ") for _ in range(rng.randrange(30)))
            text = history
        elif kind == 1:  # another question under a shared system prompt
            text = rng.choice(systems) + str(rng.random())
        elif kind == 2:  # a shorter prefix of something seen
            text = rng.choice(systems)[: rng.randrange(60)]
        else:
            text = str(rng.random()) * rng.randrange(1, 30)
        model, salt = rng.choice([("m", None), ("m", "s"), ("other", None)])
        assert remembering.hashes(text, model, salt) == scratch.hashes(text, model, salt), step


def test_the_recent_prompts_kept_are_bounded():
    hasher = PrefixHasher(8, 40, recent=3)
    for i in range(10):
        hasher.hashes(f"{i:08d}" * 5, "m")
    assert len(hasher._recent) == 3


def held(blocks: EndpointBlocks) -> set[int]:
    hashes = [h for h, _ in blocks.items()]
    assert len(hashes) == len(set(hashes)) == len(blocks)  # each block once, all counted
    return set(hashes)


def test_lru_is_bounded_and_evicts_deepest_blocks_first():
    blocks = EndpointBlocks(capacity=3, ttl=100)
    blocks.record([1, 2, 3], now=0)
    blocks.record([10, 20], now=1)
    assert len(blocks) == 3 and blocks.evictions == 2
    assert held(blocks) == {1, 10, 20}  # 3 then 2 went first
    assert blocks.depth([1, 2, 3], now=1) == 1
    assert blocks.depth([10, 20, 30], now=1) == 2


def test_retouching_moves_a_chain_behind_newer_ones():
    blocks = EndpointBlocks(capacity=4, ttl=100)
    blocks.record([1, 2], now=0)
    blocks.record([10, 20], now=1)
    blocks.record([1, 2], now=2)  # now the most recent: [10, 20] goes first
    blocks.record([5], now=3)
    assert held(blocks) == {1, 2, 5, 10}
    assert blocks.items()[-1] == (5, 3)


def test_a_record_larger_than_the_capacity_keeps_its_first_blocks():
    blocks = EndpointBlocks(capacity=4, ttl=100)
    blocks.record([70, 80], now=0)
    blocks.record(list(range(10)), now=1)
    assert len(blocks) == 4 and blocks.depth(list(range(10)), now=1) == 4 and 70 not in held(blocks)


def test_a_prompt_nobody_shares_is_one_leaf_and_a_conversation_grows_it():
    blocks = EndpointBlocks(capacity=1000, ttl=100)
    turn = list(range(1, 101))
    blocks.record(turn, now=0)
    assert blocks.sizes() == (0, 1, 100) and len(blocks) == 100
    blocks.record([*turn, *range(500, 540)], now=1)  # the next turn goes on from its end
    assert blocks.sizes() == (0, 1, 140)
    assert blocks.depth([*turn, 500, 999], now=1) == 101
    blocks.record(turn[:30], now=2)  # stops inside the leaf: only what it touched is newer
    assert blocks.sizes() == (30, 1, 110)
    assert dict(blocks.items())[turn[30]] == 1 and dict(blocks.items())[turn[29]] == 2
    assert blocks.depth([*turn, 500], now=2) == 101


def test_a_chain_that_leaves_a_leaf_part_way_splits_it():
    blocks = EndpointBlocks(capacity=1000, ttl=100)
    system, first, second = list(range(1, 51)), list(range(100, 120)), list(range(200, 230))
    blocks.record(system + first, now=0)
    blocks.record(system + second, now=5)
    assert blocks.sizes() == (50, 2, 50)  # the shared blocks are entries of their own
    assert held(blocks) == set(system + first + second)
    times = dict(blocks.items())
    assert times[first[0]] == times[first[-1]] == 0  # the first question keeps its time
    assert times[system[0]] == times[second[-1]] == 5
    assert blocks.depth(system + first, now=6) == 70
    assert blocks.depth(system + second, now=6) == 80
    assert blocks.depth([*system, 999], now=6) == 50
    assert blocks.depth([*system[:10], 999], now=6) == 10
    blocks.record(system + first[:5] + [300, 301], now=7)  # splits the first question's leaf
    assert blocks.sizes() == (55, 3, 47)
    assert blocks.depth(system + first, now=8) == 70 and blocks.depth(system + second, now=8) == 80


def test_the_rest_of_a_split_leaf_is_evicted_in_the_order_it_was_touched():
    blocks = EndpointBlocks(capacity=30, ttl=100)
    system, old_question = [1, 2, 3, 4, 5], [10, 11, 12, 13, 14]
    blocks.record(system + old_question, now=0)
    blocks.record(list(range(100, 110)), now=1)
    blocks.record([*system, 20, 21], now=2)  # the old question's rest, touched at 0, goes last
    blocks.record(list(range(200, 210)), now=3)  # 32 blocks: two over
    assert held(blocks) == set(range(100, 110)) | set(range(200, 210)) | {
        1,
        2,
        3,
        4,
        5,
        10,
        11,
        12,
        20,
        21,
    }
    blocks.record(list(range(300, 304)), now=4)  # four more: the rest of the old question first
    assert not held(blocks) & {10, 11, 12} and {100, 101, 102}.issubset(held(blocks))
    assert blocks.depth(system + old_question, now=4) == 5 and len(blocks) == 30


def test_the_tree_matches_every_recorded_chain_while_nothing_is_evicted():
    """Random prompts under shared system prompts and growing conversations: with room for
    all, every block recorded is held once, and depth is the longest recorded prefix."""
    rng = random.Random(11)
    hasher = PrefixHasher(block_chars=4, max_blocks=64)
    blocks = EndpointBlocks(capacity=10**6, ttl=10**6)
    recorded: set[int] = set()
    conversations = ["" for _ in range(5)]
    systems = ["".join(rng.choice("abc") for _ in range(rng.randrange(4, 120))) for _ in range(4)]
    for step in range(400):
        kind = rng.randrange(3)
        if kind == 0:
            text = rng.choice(systems) + "".join(rng.choice("xyz") for _ in range(30))
        elif kind == 1:
            i = rng.randrange(5)
            conversations[i] += "".join(rng.choice("pq") for _ in range(rng.randrange(1, 40)))
            text = conversations[i]
        else:
            text = rng.choice(systems)[: rng.randrange(1, 120)]
        chain = hasher.hashes(text, "m")
        if not chain:
            continue
        blocks.record(chain, now=step)
        recorded.update(chain)
        assert held(blocks) == recorded, step
        probe = hasher.hashes(text + "".join(rng.choice("abcxyzpq") for _ in range(20)), "m")
        expected = next((k for k, h in enumerate(probe) if h not in recorded), len(probe))
        assert blocks.depth(probe, now=step) == expected, step


class BlockLru:
    """The reference: an exact LRU of single blocks, touched deepest first, with a TTL."""

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity, self.ttl = capacity, ttl
        self.touched: OrderedDict[int, float] = OrderedDict()

    def record(self, chain: list[int], now: float) -> None:
        for block_hash in reversed(chain):
            self.touched[block_hash] = now
            self.touched.move_to_end(block_hash)
        while self.touched and (
            len(self.touched) > self.capacity or next(iter(self.touched.values())) < now - self.ttl
        ):
            self.touched.popitem(last=False)

    def depth(self, chain: list[int], now: float) -> int:
        fresh = [self.touched.get(h, -math.inf) >= now - self.ttl for h in chain]
        return fresh.index(False) if False in fresh else len(fresh)


@pytest.mark.parametrize(
    ("seed", "capacity", "recent"),
    [(1, 20, 0), (2, 60, 0), (3, 300, 0), (4, 20, 8), (5, 60, 8), (6, 300, 8)],
)
def test_the_tree_answers_like_an_lru_of_single_blocks(seed, capacity, recent):
    """Prompts that walk a tree of shared fragments (splits, prefixes of earlier prompts,
    extensions), with evictions and expiry, given to the tree as unhashed prompt chains (some
    starting from a remembered prompt's hashes): every depth and size as an exact per-block
    LRU given the hashes."""
    rng = random.Random(seed)
    hasher = PrefixHasher(block_chars=4, max_blocks=64, recent=recent)
    fragments = ["".join(rng.choice("abcdefgh") for _ in range(8)) for _ in range(40)]

    conversations = [fragments[i] for i in range(6)]

    def prompt() -> str:
        if rng.random() < 0.3:  # the next turn of a conversation, or the same one again
            i = rng.randrange(len(conversations))
            conversations[i] += rng.choice(fragments) * rng.randrange(2)
            return conversations[i]
        node = rng.randrange(8)
        text = fragments[node]
        for _ in range(rng.randrange(0, 11)):
            node = (node * 3 + rng.randrange(3)) % 40
            text += fragments[node]
        return text

    tree, reference = EndpointBlocks(capacity, ttl=50), BlockLru(capacity, ttl=50)
    scratch = PrefixHasher(block_chars=4, max_blocks=64, recent=0)
    now = 0.0
    for step in range(2000):
        now += rng.random()
        probe, text = prompt(), prompt()
        assert tree.depth(hasher.chain(probe, "m"), now) == reference.depth(
            scratch.hashes(probe, "m"), now
        ), step
        tree.record(hasher.chain(text, "m"), now)
        reference.record(scratch.hashes(text, "m"), now)
        assert len(tree) == len(reference.touched), step
        assert held(tree) == set(reference.touched), step


def test_a_prompt_nobody_holds_is_routed_and_recorded_on_its_first_block_alone():
    hasher = PrefixHasher(block_chars=8, max_blocks=64, recent=0)
    index = PrefixIndex(default_capacity=1000, ttl=60)
    first = hasher.chain("conversation turn one " * 8, "m")
    assert index.match(first, now=0) == {}
    index.record("a", first, now=0)
    assert not first.hashed and index._blocks["a"].unhashed == len(first)
    second = hasher.chain("conversation turn one " * 8 + "and the second turn", "m")
    assert index.match(second, now=1) == {"a": len(first)}  # compared by bytes
    index.record("a", second, now=1)  # goes on from the leaf's end: one leaf, still unhashed
    assert not first.hashed and not second.hashed
    assert index._blocks["a"].sizes() == (0, 1, len(second))
    other = hasher.chain("conversation turn one " * 4 + "something else entirely here", "m")
    assert index.match(other, now=2) == {"a": 11}
    index.record("a", other, now=2)  # turns inside the leaf: both are hashed, the leaf splits
    assert other.hashed and index._blocks["a"].unhashed == 0
    assert index.match(
        hasher.chain("conversation turn one " * 8 + "and the second turn", "m"), now=3
    ) == {"a": len(second)}


def test_a_prompt_chain_gives_the_hashes_of_its_text():
    hasher = PrefixHasher(block_chars=8, max_blocks=40)
    text = "abcdefgh" * 3 + "ijklmnop" * 10
    chain = hasher.chain(text, "m", "s")
    expected = PrefixHasher(block_chars=8, max_blocks=40, recent=0).hashes(text, "m", "s")
    assert len(chain) == len(expected) and chain[0] == expected[0] and not chain.hashed
    assert list(chain[:5]) == expected[:5] and not chain.hashed  # a shorter unhashed chain
    assert chain[-1] == expected[-1] and chain.hashed and list(chain) == expected
    again = hasher.chain(text[:40] + "zzzzzzzz" * 5, "m", "s")  # reuses the first 5 blocks
    assert list(again) == PrefixHasher(8, 40, recent=0).hashes(text[:40] + "zzzzzzzz" * 5, "m", "s")


def test_loading_a_snapshot_over_leaves_keeps_every_block_once():
    blocks = EndpointBlocks(capacity=100, ttl=100)
    blocks.record([1, 2, 3], now=0)
    blocks.load([2, 7], [1.0, 1.0], now=1)
    assert held(blocks) == {1, 2, 3, 7} and blocks.sizes() == (4, 0, 0)
    assert blocks.depth([1, 2, 3], now=1) == 3


def _chains(count: int, length: int) -> list[list[int]]:
    hasher = PrefixHasher(block_chars=8, max_blocks=length)
    return [hasher.hashes(f"{i:08d}" + "x" * 8 * (length - 1), "m") for i in range(count)]


def test_capacity_is_never_exceeded_and_trimming_goes_deepest_first():
    blocks = EndpointBlocks(capacity=160, ttl=1000)
    chains = _chains(40, 24)
    inserted = 0
    for step, chain in enumerate(chains + chains[::3]):
        inserted += sum(h not in held(blocks) for h in chain)
        blocks.record(chain, now=step)
        assert len(blocks) == min(inserted, blocks.capacity)
        holding = held(blocks)
        for other in chains:  # every chain is held as a prefix: depth stays exact
            kept = [h in holding for h in other]
            depth = kept.index(False) if False in kept else len(kept)
            assert not any(kept[depth:])
            assert blocks.depth(other, now=step) == depth
        assert blocks.depth(chain, now=step) == len(chain)  # the newest is whole
    assert blocks.evictions == inserted - len(blocks) > 0


def test_resize_trims_to_the_new_capacity():
    blocks = EndpointBlocks(capacity=1000, ttl=1000)
    blocks.record(list(range(900)), now=0)
    blocks.resize(100, now=1)
    assert len(blocks) == 100 and blocks.evictions == 800
    assert blocks.depth(list(range(900)), now=1) == 100


def test_ttl_expires_entries_for_lookups_at_once_and_drops_them_on_the_next_record():
    blocks = EndpointBlocks(capacity=10, ttl=16)
    blocks.record([1, 2], now=0)
    blocks.record([3], now=4)
    assert blocks.depth([1, 2], now=15) == 2
    assert blocks.depth([1, 2], now=16.5) == 0
    assert blocks.depth([3], now=16.5) == 1
    assert len(blocks) == 3 and blocks.evictions == 0
    blocks.record([7], now=16.5)
    assert blocks.items() == [(3, 4), (7, 16.5)] and blocks.evictions == 2
    blocks.record([7], now=19)
    assert blocks.items() == [(3, 4), (7, 19)]
    blocks.record([8], now=20)
    assert blocks.items() == [(3, 4), (7, 19), (8, 20)]  # exactly ttl old: still held
    blocks.record([8], now=20.5)
    assert blocks.items() == [(7, 19), (8, 20.5)] and blocks.evictions == 3


def test_load_restores_order_and_times():
    blocks = EndpointBlocks(capacity=3, ttl=10)
    blocks.load([3, 2, 1, 9], [1.0, 2.0, 2.0, 2.5], now=12.0)  # 3 expired; one over capacity
    assert blocks.items() == [(2, 2.0), (1, 2.0), (9, 2.5)] and blocks.evictions == 1
    assert blocks.depth([1, 2, 3], now=12.0) == 2


def test_index_match_record_evict_clear_and_memory():
    index = PrefixIndex(default_capacity=100, ttl=60)
    hashes = [11, 12, 13, 14]
    assert index.match(hashes) == {}
    index.record("a", hashes[:3])
    index.record("b", hashes[:1])
    index.record("d", hashes)
    index.record("e", hashes, now=time.monotonic() - 61)
    assert index.match(hashes) == {"a": 3, "b": 1, "d": 4}  # e's entries expired
    assert index.match(hashes[1:]) == {} and index.match([]) == {}
    index.clear("d")
    index.clear("e")
    index.evict("a", [13])
    assert index.match(hashes) == {"a": 2, "b": 1}
    assert index.entries() == 3 and index.roots == 1  # a: [11, 12], b: [11], each a leaf
    assert index.memory_bytes == 2 * BYTES_PER_LEAF + 3 * BYTES_PER_LEAF_BLOCK + BYTES_PER_ROOT
    index.clear("a")
    assert index.entries("a") == 0
    index.set_capacity("b", 10**9)
    assert index.capacity("b") == index.max_capacity


def test_match_finds_holders_whose_first_block_is_no_longer_listed():
    index = PrefixIndex(default_capacity=100, ttl=60, max_roots=2)
    index.record("a", [1, 2], now=0)
    index.record("b", [5], now=1)
    assert index.match([9, 10], now=1) == {}
    index.record("c", [7], now=2)  # [1, 2]'s first block is no longer listed
    assert index.match([1, 2], now=3) == {"a": 2}
    assert index.match([1, 2], now=62.5) == {}  # expired, as is the listing gap


def test_dropping_the_listing_of_a_prompt_nobody_holds_keeps_the_listing_complete():
    index = PrefixIndex(default_capacity=2, ttl=60, max_roots=2)
    index.record("a", [1, 2], now=0)
    index.record("a", [5, 6], now=1)  # [1, 2] evicted from a
    index.record("b", [7], now=2)  # [1, 2]'s listing goes, and nobody holds it
    assert index._incomplete_until < 0
    index.record("b", [8], now=3)  # [5, 6]'s listing goes while a still holds it
    assert index._incomplete_until == 63 and index.match([5, 6], now=4) == {"a": 2}


def test_an_endpoint_that_evicted_a_prompt_is_no_longer_asked():
    index = PrefixIndex(default_capacity=100, ttl=60)
    index.record("a", [1, 2], now=0)
    index.record("b", [1, 2], now=0)
    index.evict("a", [1, 2])
    assert index.match([1, 2], now=1) == {"b": 2}
    assert list(index._roots[1]) == ["b"]


@pytest.mark.parametrize("order", ["abcdef", "fedcba", "dacfbe"])
def test_match_gives_each_endpoint_its_own_depth_whoever_recorded_first(order):
    index = PrefixIndex(default_capacity=100, ttl=60)
    chain = list(range(100, 108))
    held = {"a": 3, "b": 1, "c": 3, "d": 5, "e": 8, "f": 0}
    for name in order:
        index.record(name, chain[: held[name]])
    index.record("f", [1, 2, 3])
    assert index.match(chain) == {name: depth for name, depth in held.items() if depth}
    assert index.match(chain[:3]) == {name: min(depth, 3) for name, depth in held.items() if depth}


def test_match_follows_a_leaf_that_starts_where_another_holder_stops():
    index = PrefixIndex(default_capacity=1000, ttl=60)
    system, question = list(range(1, 51)), list(range(100, 110))
    index.record("a", [*system, 900], now=0)
    index.record("a", [*system, 901], now=0)  # a: the system prompt as single entries
    index.record("b", [*system[:49], 902], now=0)
    index.record("b", system + question, now=0)  # b: a leaf from the system's last block on
    assert index.match(system + question, now=1) == {"a": 50, "b": 60}


def test_memory_stays_bounded_under_many_prompts():
    index = PrefixIndex(default_capacity=1000, ttl=600)
    hasher = PrefixHasher()
    recorded = 0
    for i in range(300):
        hashes = hasher.hashes(f"prompt {i} " * 100, "m")
        index.record("a", hashes)
        recorded += len(hashes)
        assert index.entries("a") <= 1000
    assert index.entries("a") == 1000 and index.roots == 300
    assert index.evictions("a") == recorded - index.entries("a")  # all prompts distinct
    singles, leaves, in_leaves = index._blocks["a"].sizes()
    assert singles == 0 and in_leaves == 1000 and leaves == math.ceil(1000 / len(hashes))
    assert index.memory_bytes == (
        leaves * BYTES_PER_LEAF + 1000 * BYTES_PER_LEAF_BLOCK + 300 * BYTES_PER_ROOT
    )


def test_prompt_text_is_prefix_preserving_across_turns():
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]}
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
        ]
    }
    assert prompt_text(turn2).startswith(prompt_text(turn1))
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({"input": "x"}) == ""
    tools = {"tools": [{"type": "function"}], "messages": turn1["messages"]}
    assert prompt_text(tools) != prompt_text(turn1)


def test_the_default_span_tells_apart_agents_under_one_long_system_prompt():
    """Agents whose shared system prompt is longer than 16k characters differ only after it:
    the index (configured as the gateway configures it) still finds which endpoint holds which
    agent's history."""
    from kvgate.routing.services import RoutingServices
    from kvgate.routing.settings import RoutingConfig

    services = RoutingServices.from_config(RoutingConfig())
    hasher, index = services.hasher, services.index
    rng = random.Random(5)
    system = " ".join(f"tool{rng.randrange(10**6)}" for _ in range(4_000))  # ≈ 44k characters
    assert len(system) > 40_000
    tasks = {name: f" agent {name}: " + "step " * 200 for name in ("a", "b")}
    for name, task in tasks.items():
        index.record(name, hasher.chain(system + task, "m"), now=0)
    depths = index.match(hasher.chain(system + tasks["a"] + "next turn " * 50, "m"), now=1)
    assert depths["a"] > depths["b"] > 0


def test_remembered_prompts_are_bounded_by_their_bytes():
    hasher = PrefixHasher(block_chars=8, max_blocks=1000, recent=100, recent_bytes=800)
    scratch = PrefixHasher(block_chars=8, max_blocks=1000, recent=0)
    texts = [f"{i:08d}" + "x" * 392 for i in range(10)]  # 400 bytes each, own first block
    for text in texts:
        assert hasher.hashes(text, "m") == scratch.hashes(text, "m")
    assert len(hasher._recent) == 2 and hasher._recent_held == 800
    huge = "h" * 4000  # alone above the budget: still remembered, the only one
    hasher.hashes(huge, "m")
    assert len(hasher._recent) == 1 and hasher._recent_held == 4000
    longer = huge + "y" * 80  # its next turn reuses it and replaces it
    assert hasher.hashes(longer, "m") == scratch.hashes(longer, "m")
    assert len(hasher._recent) == 1 and hasher._recent_held == 4080


def test_shared_blocks_counts_the_leading_blocks_two_prompts_have_in_common():
    """Against a block-by-block comparison, on prompts that extend, repeat or differ anywhere
    (the binary search compares only the bytes between what is known equal and the middle)."""

    def one_by_one(a: bytes, b: bytes, size: int) -> int:
        n = 0
        while (n + 1) * size <= min(len(a), len(b)) and a[n * size : (n + 1) * size] == b[
            n * size : (n + 1) * size
        ]:
            n += 1
        return n

    rng = random.Random(7)
    for _ in range(5_000):
        size = rng.choice([1, 3, 64])
        base = bytes(rng.randrange(3) for _ in range(rng.randrange(400)))
        a = bytearray(base[: rng.randrange(len(base) + 1)])
        b = base[: rng.randrange(len(base) + 1)]
        if a and rng.random() < 0.5:
            a[rng.randrange(len(a))] ^= 1
        assert shared_blocks(bytes(a), b, size) == one_by_one(bytes(a), b, size)
