"""Unit tests of the pieces that need no server: tokenizer, template, text, KV pool, faults."""

import random
import time

import pytest

from kvgate.sim.faults import Fault, FaultInjector
from kvgate.sim.kv_cache import BlockPool, extend_block_hashes
from kvgate.sim.options import EngineOptions
from kvgate.sim.textgen import TAIL_CHARS, TextGenerator
from kvgate.sim_chat_template import TemplateError, render_chat
from kvgate.sim_tokenizer import count_tokens, tokenize

from .helpers import LONG_TEXT


def test_tokenizer_round_trips_any_text():
    rng = random.Random(7)
    text = "".join(chr(rng.randrange(0, 0x3000)) for _ in range(50_000))
    assert "".join(tokenize(text)) == text
    assert "".join(tokenize(LONG_TEXT)) == LONG_TEXT


def test_tokenizer_boundaries_follow_words_not_offsets():
    assert tokenize("Hello, internationalization 12345!") == [
        "Hello",
        ",",
        " intern",
        "ationa",
        "lizati",
        "on",
        " 123",
        "45",
        "!",
    ]
    assert tokenize("<|im_start|>user\n") == ["<|im_start|>", "user", "\n"]
    chars_per_token = len(LONG_TEXT * 50) / count_tokens(LONG_TEXT * 50)
    assert 3.0 < chars_per_token < 5.5


def test_tokenizer_is_fast_on_long_prompts():
    text = LONG_TEXT * 1000  # about 33k tokens
    started = time.perf_counter()
    tokens = tokenize(text)
    elapsed = time.perf_counter() - started
    assert len(tokens) > 30_000
    assert elapsed < 0.25  # a few ms on a workstation; generous for slow CI machines


def test_continuing_a_final_message_renders_as_prompt_plus_partial():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    partial = " the river,"
    continued = render_chat(
        [*messages, {"role": "assistant", "content": partial}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    fresh = render_chat(messages, add_generation_prompt=True, continue_final_message=False)
    assert continued == fresh + partial
    with pytest.raises(TemplateError):
        render_chat(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(TemplateError):
        render_chat(messages, add_generation_prompt=False, continue_final_message=True)


def test_text_generator_depends_on_text_tail_and_seed_only():
    generator = TextGenerator(seed=3)
    recent = "r" * TAIL_CHARS
    assert generator.next_token("x" * 500 + recent) == generator.next_token("y" * 9 + recent)
    tail = "some earlier text"
    assert generator.next_token(tail) == TextGenerator(seed=3).next_token(tail)
    outputs = {TextGenerator(seed).next_token("prompt " * 20)[0] for seed in range(40)}
    assert len(outputs) > 5


def test_block_pool_evicts_least_recently_freed_blocks_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    hashes_a: list[int] = []
    extend_block_hashes(hashes_a, list("abcd"), 4, 2, None)
    blocks_a = pool.allocate(2)
    assert blocks_a is not None
    for block, block_hash in zip(blocks_a, hashes_a, strict=True):
        pool.register(block, block_hash)
    pool.release(blocks_a)
    assert pool.usage == 0.0
    assert pool.cached_prefix(hashes_a) == blocks_a
    # Two empty blocks are used before any cached one is evicted.
    assert pool.allocate(2) is not None
    assert pool.cached_prefix(hashes_a) == blocks_a
    # The tail block is evicted before the head block.
    assert pool.allocate(1) == [blocks_a[1]]
    assert pool.cached_prefix(hashes_a) == blocks_a[:1]
    assert pool.allocate(2) is None


def test_cache_salt_changes_every_block_hash():
    tokens = list("abcdefgh")
    plain: list[int] = []
    salted: list[int] = []
    extend_block_hashes(plain, tokens, 8, 2, None)
    extend_block_hashes(salted, tokens, 8, 2, "tenant-a")
    assert len(plain) == 4
    assert not set(plain) & set(salted)


def test_fault_count_and_probability_are_honoured():
    injector = FaultInjector(seed=1)
    injector.set(Fault("http_error", count=2))
    assert [injector.draw() is not None for _ in range(4)] == [True, True, False, False]
    assert injector.current is None
    injector.set(Fault("http_error", probability=0.3))
    fired = sum(injector.draw() is not None for _ in range(1000))
    assert 200 < fired < 400
    with pytest.raises(ValueError):
        Fault.from_json({"mode": "explode"})
    with pytest.raises(ValueError):
        Fault.from_json({"mode": "hang", "probability": 2})


def test_options_reject_a_context_longer_than_the_kv_cache():
    assert EngineOptions(kv_blocks=10).context_length == 160
    with pytest.raises(ValueError):
        EngineOptions(kv_blocks=10, max_model_len=1000)
