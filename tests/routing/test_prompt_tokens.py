"""The token ids the gateway computes for a request equal what the engine sees: the `sim`
tokenizer against a running simulated engine's prompt token count, the `hf` tokenizer against
a small Hugging Face tokenizer built here (no model hub), and the config keys around them."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kvgate.app import GatewayApp
from kvgate.cli import main
from kvgate.config import ConfigError, parse_config
from kvgate.routing.hf_tokenizer import HfTokenizer
from kvgate.routing.prompt_tokens import SimTokenizer
from kvgate.sim import EngineOptions, SimFleet
from kvgate.sim_chat_template import render_chat
from kvgate.sim_tokenizer import token_ids, tokenize
from tests.conftest import gateway_config
from tests.hf_tokenizers import LLAMA3_LIKE, WORDS, bpe_tokenizer

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there, how are the gears today?"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief.  Really:\n\tbrief!"},
            {"role": "user", "content": "Ünïcode — 漢字 and emoji 🚲 with 1234567 digits"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Continue this:"},
            {"role": "assistant", "content": "Once upon a time "},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "parts, "}] * 3}],
        "add_generation_prompt": False,
    },
]
PROMPTS = ["Plain completion prompt", ["A one-element list prompt "], "x" * 500 + " end <|im_end|>"]


def test_sim_tokenizer_counts_what_the_simulated_engine_counts():
    tokenizer = SimTokenizer()
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast")) as fleet:
        url = fleet.urls[0]
        for chat in CHATS:
            body = {"model": "sim-model", "max_tokens": 1, **chat}
            answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).json()
            ids = tokenizer.prompt_ids("chat", body)
            assert ids is not None and len(ids) == answer["usage"]["prompt_tokens"], chat
        for prompt in PROMPTS:
            body = {"model": "sim-model", "max_tokens": 1, "prompt": prompt}
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=10).json()
            ids = tokenizer.prompt_ids("completions", body)
            assert ids is not None and len(ids) == answer["usage"]["prompt_tokens"], prompt


def test_sim_tokenizer_message_by_message_equals_the_whole_rendered_prompt():
    rng = random.Random(15)
    pieces = ["word", " ", "  ", "\n", "\t", "<|im_end|>", "<|im_start|>", "12345", "!", "é", " x"]
    tokenizer = SimTokenizer()
    for _ in range(300):
        messages = [
            {
                "role": rng.choice(["system", "user", "assistant"]),
                "content": "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12))),
            }
            for _ in range(rng.randrange(1, 5))
        ]
        options = rng.choice(
            [
                {"add_generation_prompt": True},
                {"add_generation_prompt": False},
                {"add_generation_prompt": False, "continue_final_message": True},
            ]
        )
        if options.get("continue_final_message"):
            messages[-1]["role"] = "assistant"
        whole = render_chat(
            messages,
            add_generation_prompt=options["add_generation_prompt"],
            continue_final_message=bool(options.get("continue_final_message")),
        )
        ids = tokenizer.prompt_ids("chat", {"messages": messages, **options})
        assert ids == token_ids(tokenize(whole)), messages


def test_sim_tokenizer_answers_none_for_what_it_cannot_reproduce():
    tokenizer = SimTokenizer()
    assert tokenizer.prompt_ids("chat", {"messages": []}) is None
    assert tokenizer.prompt_ids("chat", {"messages": [{"content": "no role"}]}) is None
    assert tokenizer.prompt_ids("completions", {"prompt": ["two", "prompts"]}) is None
    assert tokenizer.prompt_ids("embeddings", {"input": "text"}) is None


CHATML = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_tokenizer(folder: Path, config: dict[str, Any] | None) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "<|im_start|>"])
    tokenizer.train_from_iterator(["hello world how are the gears today user assistant"], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer


def test_hf_tokenizer_applies_the_chat_template_then_encodes_without_special_tokens(tmp_path):
    reference = _tiny_tokenizer(tmp_path, {"chat_template": CHATML, "bos_token": "<s>"})
    loaded = HfTokenizer.load(tmp_path)
    messages = [{"role": "user", "content": "hello world"}]
    text = "<s><|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.render_chat({"messages": messages}) == text
    expected = reference.encode(text, add_special_tokens=False).ids
    assert loaded.prompt_ids("chat", {"messages": messages}) == expected
    continued = {
        "messages": [*messages, {"role": "assistant", "content": "how are"}],
        "continue_final_message": True,
    }
    assert loaded.render_chat(continued) == text + "how are"
    completion = reference.encode("how are the gears", add_special_tokens=True).ids
    assert loaded.prompt_ids("completions", {"prompt": "how are the gears"}) == completion
    assert loaded.prompt_ids("completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]


def test_hf_chats_are_encoded_piece_by_piece_each_piece_once(tmp_path):
    """Cut at the special tokens, a byte-level BPE's pieces give the ids of the whole, and a
    conversation's next turn encodes only its new messages."""
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    reference = bpe_tokenizer(
        tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False), specials, LLAMA3_LIKE
    )
    loaded = HfTokenizer.load(tmp_path)
    assert loaded.piecewise
    encoded: list[str] = []
    encode = loaded._encode

    def counted(texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        encoded.extend(texts)
        return encode(texts, add_special_tokens)

    loaded._encode = counted
    rng = random.Random(5)
    messages = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(50))}]
    per_turn = []
    for turn in range(4):
        content = " ".join(rng.choice(WORDS) for _ in range(20)) + ("  \n" if turn % 2 else "")
        messages.append({"role": "user", "content": content})
        whole = reference.encode(
            loaded.render_chat({"messages": messages}), add_special_tokens=False
        )
        before = len(encoded)
        assert loaded.prompt_ids("chat", {"messages": messages}) == whole.ids
        per_turn.append(len(encoded) - before)
        messages.append({"role": "assistant", "content": " ".join(WORDS[turn:])})
    # After the first turn, only the two new messages are encoded (the role names and blank
    # lines between special tokens are pieces seen before): nothing said earlier again.
    assert per_turn[0] >= 4 and per_turn[1:] == [2, 2, 2]


def test_a_tokenizer_whose_first_split_differs_is_encoded_whole(tmp_path):
    """Metaspace with `prepend_scheme: first` (Llama 2, Mistral) marks only the text's first
    split, so a piece encoded alone differs: the probes at load see it, and chats are encoded
    whole, still giving the engine's ids."""
    specials = ["<s>", "<|im_start|>", "<|im_end|>"]
    template = (
        "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    )
    reference = bpe_tokenizer(
        tmp_path, pre_tokenizers.Metaspace(prepend_scheme="first"), specials, template
    )
    loaded = HfTokenizer.load(tmp_path)
    assert not loaded.piecewise
    messages = [
        {"role": "user", "content": "the gears turn"},
        {"role": "assistant", "content": "ok"},
    ]
    whole = reference.encode(loaded.render_chat({"messages": messages}), add_special_tokens=False)
    assert loaded.prompt_ids("chat", {"messages": messages}) == whole.ids


def test_hf_template_list_form_and_jinja_file_and_refusals(tmp_path):
    _tiny_tokenizer(
        tmp_path / "listed",
        {"chat_template": [{"name": "default", "template": "X{{ messages[0]['content'] }}"}]},
    )
    assert (
        HfTokenizer.load(tmp_path / "listed").render_chat({"messages": [{"content": "a"}]}) == "Xa"
    )
    _tiny_tokenizer(tmp_path / "file", None)
    (tmp_path / "file" / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}Y"
    )
    loaded = HfTokenizer.load(tmp_path / "file")
    assert loaded.render_chat({"messages": [{"content": "a"}]}) == "Y"
    assert loaded.prompt_ids("chat", {"messages": [{"content": "a"}, {"content": "b"}]}) is None
    _tiny_tokenizer(tmp_path / "bare", None)
    assert HfTokenizer.load(tmp_path / "bare").prompt_ids("chat", {"messages": []}) is None


def _config(pool: dict[str, Any], **endpoint: Any) -> dict[str, Any]:
    config = gateway_config(["http://10.0.0.5:8000"], pool=pool)
    config["pools"][0]["endpoints"][0].update(endpoint)
    return config


def test_kv_events_config_resolves_per_endpoint_and_is_validated(tmp_path):
    pool = parse_config(
        _config({"kv_events": {"replay_port_offset": 2000}, "tokenizer": {"kind": "sim"}})
    ).pools[0]
    events = pool.kv_events_of(pool.endpoints[0])
    assert events is not None
    assert (events.url, events.replay_url) == ("tcp://10.0.0.5:9000", "tcp://10.0.0.5:10000")
    own = {"url": "tcp://e:5557", "topic": "t"}
    pool = parse_config(_config({"tokenizer": {"kind": "sim"}}, kv_events=own)).pools[0]
    assert pool.kv_events_of(pool.endpoints[0]).url == "tcp://e:5557"  # type: ignore[union-attr]
    plain = parse_config(_config({})).pools[0]
    assert plain.kv_events_of(plain.endpoints[0]) is None
    problems = [
        (_config({"kv_events": {}}), "KV events need the engines' token ids"),
        (_config({"tokenizer": {"kind": "sim"}}, kv_events={"url": "http://e:1"}), "pattern"),
        (_config({"tokenizer": {"kind": "hf"}}), "needs the tokenizer's directory"),
        (_config({"tokenizer": {"kind": "sim", "path": "x"}}), "takes no 'path'"),
    ]
    for config, message in problems:
        with pytest.raises(ConfigError, match=message):
            parse_config(config)
    missing = _config({"tokenizer": {"kind": "hf", "path": str(tmp_path / "nowhere")}})
    with pytest.raises(ConfigError, match=r"pools\[0\].tokenizer: cannot load"):
        GatewayApp(parse_config(missing))


def test_check_config_loads_each_pools_tokenizer(tmp_path, capsys):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "pools:\n  - name: gpu\n    endpoints: [{url: 'http://e:8000'}]\n"
        "    tokenizer: {kind: hf, path: missing-dir}\n"
    )
    assert main(["check-config", str(config)]) == 1
    assert "pools[0].tokenizer: cannot load" in capsys.readouterr().err
    _tiny_tokenizer(tmp_path / "missing-dir", {"chat_template": CHATML})
    assert main(["check-config", str(config)]) == 0


def test_loading_a_tokenizer_keeps_its_encoding_to_one_core_unless_told(tmp_path, monkeypatch):
    """`tokenizers` would spread each batch over every core, beside the event loops: loading
    sets TOKENIZERS_PARALLELISM=false, unless the environment already says otherwise."""
    _tiny_tokenizer(tmp_path, {"chat_template": CHATML, "bos_token": "<s>"})
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    HfTokenizer.load(tmp_path)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    HfTokenizer.load(tmp_path)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
