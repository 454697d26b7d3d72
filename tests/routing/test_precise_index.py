"""The precise index: token-block keys held per endpoint, fed by KV events in order."""

from __future__ import annotations

import random

from kvgate.routing.kv_events import BlockRemoved, BlockStored
from kvgate.routing.precise_index import PreciseIndex, block_keys

B = 4
PROMPT = list(range(100, 124))  # 6 blocks of 4


def stored(tokens: list[int], hashes: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), B)


def index(*names: str, **options: float) -> PreciseIndex:
    built = PreciseIndex(**options)  # type: ignore[arg-type]
    for name in names:
        built.add_endpoint(name)
    return built


def depths(built: PreciseIndex, tokens: list[int], *names: str, now: float = 0.0):
    return built.match(block_keys(tokens, B, 100), names, now)


def test_events_from_several_runs_chain_by_parent_and_match_answers_every_endpoint():
    built = index("a", "b", "c")
    built.stored("a", stored(PROMPT[:8], [11, 12]))
    built.stored("a", stored(PROMPT[8:16], [13, 14], parent=12))
    built.stored("b", stored(PROMPT[:4], [91]))
    both, confirmed = depths(built, PROMPT, "a", "b", "c")
    assert both == confirmed == {"a": 4, "b": 1, "c": 0}
    other = [*PROMPT[:4], 1, 2, 3, 4]
    assert depths(built, other, "a", "b")[0] == {"a": 1, "b": 1}


def test_the_engines_salted_hashes_do_not_matter_only_the_tokens():
    built = index("a", "b")
    built.stored("a", stored(PROMPT[:8], [1, 2]))
    built.stored("b", stored(PROMPT[:8], [777, 778]))
    assert depths(built, PROMPT, "a", "b")[0] == {"a": 2, "b": 2}


def test_removed_and_cleared_forget_blocks():
    built = index("a", "b")
    built.stored("a", stored(PROMPT[:12], [1, 2, 3]))
    built.stored("b", stored(PROMPT[:12], [5, 6, 7]))
    built.removed("a", BlockRemoved((3,)))
    assert depths(built, PROMPT, "a", "b")[0] == {"a": 2, "b": 3}
    built.removed("a", BlockRemoved((1,)))
    assert depths(built, PROMPT, "a", "b")[0] == {"a": 0, "b": 3}
    built.cleared("b")
    assert depths(built, PROMPT, "a", "b")[0] == {"a": 0, "b": 0}
    assert built.blocks("a") == 1 and built.blocks("b") == 0


def test_a_block_cached_twice_stays_held_until_both_copies_go():
    built = index("a")
    built.stored("a", stored(PROMPT[:4], [1]))
    built.stored("a", stored(PROMPT[:4], [2]))  # the same tokens under another salt
    built.removed("a", BlockRemoved((1,)))
    assert depths(built, PROMPT, "a")[0] == {"a": 1}
    built.removed("a", BlockRemoved((2,)))
    assert depths(built, PROMPT, "a")[0] == {"a": 0}


def test_a_run_whose_parent_is_unknown_is_not_indexed():
    built = index("a")
    built.stored("a", stored(PROMPT[4:8], [2], parent=1))
    assert built.blocks("a") == 0 and built.orphans("a") == 1


def test_an_endpoint_outgrowing_the_engine_is_cleared_and_flagged_until_cleared():
    built = index("a")
    built.set_engine_size("a", 2, B)
    built.stored("a", stored(PROMPT[:8], [1, 2]))
    assert not built.overflowed("a")
    built.stored("a", stored(PROMPT[8:12], [3], parent=2))
    assert built.overflowed("a") and built.blocks("a") == 0
    built.cleared("a")
    assert not built.overflowed("a")


def test_speculative_entries_count_until_they_expire_and_are_not_confirmed():
    built = index("a", "b", speculative_ttl=2.0)
    keys = block_keys(PROMPT, B, 100)
    built.speculate("a", keys[:3], now=10.0)
    both, confirmed = built.match(keys, ["a", "b"], now=11.0)
    assert both == {"a": 3, "b": 0} and confirmed == {"a": 0, "b": 0}
    built.speculate("a", keys[:3], now=11.5)  # renewed: the first expiry leaves it
    assert built.match(keys, ["a"], now=12.5)[0] == {"a": 3}
    assert built.match(keys, ["a"], now=14.0)[0] == {"a": 0}
    assert built.speculative_entries() == 0


def test_a_new_block_size_replaces_what_the_endpoint_held():
    built = index("a")
    assert built.block_size("a") == 16  # vLLM's default until something says otherwise
    built.stored("a", stored(PROMPT[:8], [1, 2]))
    assert built.block_size("a") == B
    built.stored("a", BlockStored((9,), None, tuple(PROMPT[:8]), 8))
    assert built.block_size("a") == 8 and built.blocks("a") == 1


def test_block_keys_chain_and_stop_at_the_limit():
    keys = block_keys(PROMPT, B, 3)
    assert len(keys) == 3
    assert block_keys(PROMPT[:4] + [0] * 8, B, 3)[0] == keys[0]
    assert block_keys(PROMPT[:4] + [0] * 8, B, 3)[1] != keys[1]
    assert block_keys([0] * 4 + PROMPT[4:12], B, 3)[1] != keys[1]  # chained: the parent counts


def test_bisection_finds_every_endpoints_depth_as_a_walk_would():
    rng = random.Random(15)
    tokens = [rng.randrange(1000) for _ in range(B * 300)]
    keys = block_keys(tokens, B, 300)
    for _ in range(40):
        names = [f"e{i}" for i in range(rng.randrange(1, 70))]
        built = index(*names, speculative_ttl=5.0)
        expected_confirmed, expected_both = {}, {}
        for name in names:
            held = rng.choice([0, 0, rng.randrange(300), 300, rng.randrange(3)])
            if held:
                hashes = [rng.getrandbits(64) for _ in range(held)]
                built.stored(name, stored(tokens[: held * B], hashes))
            guessed = rng.choice([0, rng.randrange(300 - held + 1)])
            built.speculate(name, keys[held : held + guessed], now=0.0)
            expected_confirmed[name], expected_both[name] = held, held + guessed
        both, confirmed = built.match(keys, names, now=1.0)
        assert confirmed == expected_confirmed
        assert both == expected_both


def test_lora_and_offloaded_blocks_are_not_the_base_models_gpu_cache():
    """A LoRA adapter's blocks (vLLM keys them apart) are no hit for a base-model prompt, and
    blocks on another tier (`medium` "CPU") neither count as held nor fill the GPU bound."""
    built = index("a")
    built.set_engine_size("a", 2, B)
    keys = block_keys(PROMPT, B, 100)
    lora = stored(PROMPT[:8], [1, 2])
    built.stored("a", BlockStored(lora.block_hashes, None, lora.token_ids, B, lora_id=7))
    for medium in ("CPU", "cpu", "disk"):
        built.stored("a", BlockStored((3, 4, 5), None, tuple(PROMPT[:12]), B, medium=medium))
    assert built.blocks("a") == 0 and not built.overflowed("a")
    assert built.match(keys, ["a"])[0] == {"a": 0}
    built.stored("a", BlockStored((6, 7), None, tuple(PROMPT[:8]), B, medium="GPU"))
    assert built.match(keys, ["a"])[0] == {"a": 2}
    built.removed("a", BlockRemoved((6, 7), medium="CPU"))  # the copy offloaded is dropped
    assert built.blocks("a") == 2
    built.removed("a", BlockRemoved((6, 7), medium="GPU"))
    assert built.blocks("a") == 0


def test_a_configured_block_size_the_events_contradict_is_replaced_and_said(caplog):
    """`tokenizer.block_size` is the engines' until their events say otherwise: then the
    events' size keys the index (the engine hashed its blocks so), with one warning."""
    built = PreciseIndex()
    built.add_endpoint("a", block_size=7)
    assert built.block_size("a") == 7
    built.stored("a", stored(PROMPT[:8], [1, 2]))
    built.stored("a", stored(PROMPT[8:12], [3], parent=2))
    assert built.block_size("a") == B and built.blocks("a") == 3
    warned = [r.getMessage() for r in caplog.records if "tokenizer.block_size" in r.getMessage()]
    assert warned == [
        "kv events a: blocks of 4 tokens, not the 7 of tokenizer.block_size; "
        "keyed by the events' size"
    ]
