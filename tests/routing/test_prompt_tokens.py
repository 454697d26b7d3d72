"""The token ids the gateway computes for a request equal what the engine sees: the `sim`
tokenizer against a running simulated engine's prompt token count, the `hf` tokenizer against
a small Hugging Face tokenizer built here (no model hub), and the config keys around them."""

from __future__ import annotations

import gc
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
from kvgate.routing.token_memo import TokenMemo
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
RESPONSES: list[dict[str, Any]] = [
    {"input": "Hello there, how are the gears today?"},
    {"instructions": "Be brief.", "input": "Ünïcode — 漢字 🚲"},
    {"instructions": "", "input": "Empty instructions add no system message"},
    {
        "instructions": "Answer from the notes.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "note one"}] * 2},
            {"type": "message", "role": "assistant", "content": "noted"},
            {"role": "user", "content": [{"type": "input_text", "text": "and two?"}]},
        ],
    },
]


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


def test_sim_tokenizer_counts_what_the_simulated_engine_counts_for_responses_requests():
    """A Responses request is rendered from the messages the engine builds of it: the
    instructions first (when not empty), then the input, text parts joined by newlines."""
    tokenizer = SimTokenizer()
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast")) as fleet:
        for request in RESPONSES:
            body = {"model": "sim-model", "max_output_tokens": 1, **request}
            answer = httpx.post(f"{fleet.urls[0]}/v1/responses", json=body, timeout=10).json()
            ids = tokenizer.prompt_ids("responses", body)
            assert ids is not None and len(ids) == answer["usage"]["input_tokens"], request
    as_chat = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    }
    same = {"instructions": "Be brief.", "input": "hi"}
    assert tokenizer.prompt_ids("responses", same) == tokenizer.prompt_ids("chat", as_chat)
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    assert tokenizer.prompt_ids("responses", {"input": [call]}) is None
    assert tokenizer.prompt_ids("responses", {"input": []}) is None


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


def test_hf_template_list_form_and_jinja_file_and_refusals(tmp_path, caplog):
    user = {"role": "user", "content": "a"}
    _tiny_tokenizer(
        tmp_path / "listed",
        {"chat_template": [{"name": "default", "template": "X{{ messages[0]['content'] }}"}]},
    )
    listed = HfTokenizer.load(tmp_path / "listed")
    assert listed.render_chat({"messages": [user]}) == "Xa"
    assert listed.render_chat({"messages": [{"content": "a"}]}) is None  # vLLM needs a role
    _tiny_tokenizer(tmp_path / "file", None)
    (tmp_path / "file" / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}Y"
    )
    loaded = HfTokenizer.load(tmp_path / "file")
    assert loaded.render_chat({"messages": [user]}) == "Y"
    assert loaded.prompt_ids("chat", {"messages": [user, user]}) is None
    assert "no chat template" not in caplog.text
    _tiny_tokenizer(tmp_path / "bare", None)
    assert HfTokenizer.load(tmp_path / "bare").prompt_ids("chat", {"messages": [user]}) is None
    # said at load: every chat request would otherwise go approximate without a word
    assert f"tokenizer {tmp_path / 'bare'} has no chat template" in caplog.text


PARTS_TEMPLATE = (
    "{% set conversation = messages %}{% for message in conversation %}{{ message.role }}:"
    "{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}|{% endfor %}"
)
TOOLS_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}{{ call.function.arguments | tojson }}{% endfor %}"
    "{% endfor %}{{ tools | tojson(separators=(',', ':')) }}"
    "{% if enable_thinking is defined and not enable_thinking %} no-think{% endif %}"
    "{% if documents %} docs={{ documents | length }}{% endif %}"
)


def test_hf_templates_get_the_messages_and_tools_vllm_gives_them(tmp_path):
    """As vLLM's chat parser: content as newline-joined text, or as text parts for a template
    that loops over content; tool call arguments as objects; tools with their null fields;
    the request's documents and chat_template_kwargs; media and refused kwargs not rendered."""
    parts = [{"type": "text", "text": "hello"}, {"type": "input_text", "text": "world"}]
    _tiny_tokenizer(tmp_path / "string", {"chat_template": CHATML, "bos_token": "<s>"})
    string = HfTokenizer.load(tmp_path / "string")
    rendered = string.render_chat({"messages": [{"role": "user", "content": parts}]})
    assert rendered is not None and "user\nhello\nworld<|im_end|>" in rendered
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert string.render_chat({"messages": [{"role": "user", "content": [image]}]}) is None

    _tiny_tokenizer(tmp_path / "parts", {"chat_template": PARTS_TEMPLATE})
    looped = HfTokenizer.load(tmp_path / "parts")
    messages = [{"role": "system", "content": "be kind"}, {"role": "user", "content": parts}]
    assert looped.render_chat({"messages": messages}) == "system:[be kind]|user:[hello][world]|"

    _tiny_tokenizer(tmp_path / "tools", {"chat_template": TOOLS_TEMPLATE})
    tools = HfTokenizer.load(tmp_path / "tools")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    chat: dict[str, Any] = {
        "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}],
        "tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
    }
    dumped = (
        '[{"type":"function","function":'
        '{"name":"f","description":null,"parameters":null,"strict":true}}]'
    )
    assert tools.render_chat(chat) == '{"a": 1}' + dumped
    thinking = {**chat, "chat_template_kwargs": {"enable_thinking": False}, "documents": [{}]}
    assert tools.render_chat(thinking) == '{"a": 1}' + dumped + " no-think docs=1"
    assert tools.render_chat({**chat, "chat_template_kwargs": {"tokenize": True}}) is None
    broken = {**call, "function": {"name": "f", "arguments": "{not json"}}
    assert tools.render_chat({"messages": [{"role": "assistant", "tool_calls": [broken]}]}) is None


def test_hf_responses_requests_render_as_the_chat_vllm_builds_of_them(tmp_path):
    _tiny_tokenizer(tmp_path, {"chat_template": CHATML, "bos_token": "<s>"})
    loaded = HfTokenizer.load(tmp_path)
    system = {"role": "system", "content": "how are"}
    user = {"role": "user", "content": "hello world"}
    chat = loaded.prompt_ids("chat", {"messages": [system, user]})
    assert chat is not None
    assert (
        loaded.prompt_ids("responses", {"instructions": "how are", "input": "hello world"}) == chat
    )
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hello world"}]}]
    assert loaded.prompt_ids("responses", {"instructions": "how are", "input": items}) == chat
    assert loaded.prompt_ids("responses", {"instructions": "", "input": "hello world"}) == (
        loaded.prompt_ids("chat", {"messages": [user]})
    )
    function = {"type": "function", "name": "f", "parameters": {}}
    assert loaded.prompt_ids("responses", {"input": "hello world", "tools": [function]}) is None
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    assert loaded.prompt_ids("responses", {"input": [output]}) is None


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


def test_the_remembered_ids_are_out_of_the_garbage_collectors_reach():
    """A full memo holds a million ids: kept in lists, every full collection would walk them
    all (a pause for every request in flight); tuples of ints leave the collector's tracking
    at their first collection."""
    memo = TokenMemo(1_000)
    pieces = [f"piece {i}" for i in range(10)]
    memo.ids_of(pieces, lambda texts: [[len(t), 7, 8] for t in texts])
    gc.collect()
    remembered = memo.ids_of(pieces, lambda texts: pytest.fail("every piece is remembered"))
    assert len(remembered) == 10 and not any(gc.is_tracked(ids) for ids in remembered)
