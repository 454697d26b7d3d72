"""The usage of a non-stream answer: read from the `usage` object alone in large answers, and
always what decoding the whole answer gives."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from kvgate.upstream.answer_usage import WHOLE_DECODE_BYTES, answer_usage
from tests.upstreams import USAGE, chat_answer


def whole(body: bytes) -> tuple[Any, Any]:
    parsed = orjson.loads(body)
    usage, model = parsed.get("usage"), parsed.get("model")
    return (usage if isinstance(usage, dict) else None), (model if isinstance(model, str) else None)


def test_a_large_answer_with_logprobs_gives_its_usage_and_model() -> None:
    body = chat_answer("tok " * 500, logprobs=500)
    assert len(body) > 100_000
    assert answer_usage(body) == (USAGE, "served-model")


def test_a_small_answer_is_decoded_whole() -> None:
    body = chat_answer("ok")
    assert len(body) < WHOLE_DECODE_BYTES
    assert answer_usage(body) == (USAGE, "served-model")


@pytest.mark.parametrize(
    "content",
    [
        'the reply quotes a key: "usage": {"prompt_tokens": 1}',
        'braces { and } and "usage":{ unbalanced',
        "a backslash at the end \\",
        '"model": "not-this-one"',
    ],
)
def test_text_that_looks_like_json_inside_the_content_is_not_taken_for_it(content: str) -> None:
    body = chat_answer(content + " pad" * WHOLE_DECODE_BYTES)
    assert answer_usage(body) == (USAGE, "served-model")


def test_a_usage_string_after_the_key_falls_back_to_decoding_the_whole_chat_answer() -> None:
    # vLLM's prompt_logprobs come after usage; a decoded token may be the word itself.
    after = {"prompt_logprobs": [None, {"17": {"logprob": -1.0, "decoded_token": "usage"}}]}
    body = chat_answer("x" * 2 * WHOLE_DECODE_BYTES, **after)
    assert body.rfind(b'"usage"') > body.find(b'"usage":')
    assert answer_usage(body) == (USAGE, "served-model")


def test_an_object_named_usage_after_the_answers_own_is_not_taken_for_it() -> None:
    # An engine that wrote the request's tools after usage: a tool's JSON schema may have a
    # property named "usage".
    schema = {"type": "object", "properties": {"usage": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = chat_answer("x" * 2 * WHOLE_DECODE_BYTES, tools=tools)
    assert body.rfind(b'"usage":{') > body.find(b'"usage":{')
    assert answer_usage(body) == (USAGE, "served-model")


def test_a_rerank_answers_lone_total_counts_as_prompt_tokens() -> None:
    answer = orjson.dumps({"id": "rerank-1", "usage": {"total_tokens": 12}, "results": []})
    assert answer_usage(answer)[0] == {"total_tokens": 12, "prompt_tokens": 12}
    generated = {"total_tokens": 12, "completion_tokens": 2}
    assert answer_usage(orjson.dumps({"usage": generated}))[0] == generated


def test_no_usage_or_a_null_one_gives_none() -> None:
    assert answer_usage(chat_answer("x" * 2 * WHOLE_DECODE_BYTES, usage=None)) == (
        None,
        "served-model",
    )
    no_usage = orjson.dumps({"model": "m", "choices": [{"text": "y" * 2 * WHOLE_DECODE_BYTES}]})
    assert answer_usage(no_usage) == (None, None)


def test_an_answer_cut_short_inside_its_usage_gives_none() -> None:
    body = chat_answer("x" * 2 * WHOLE_DECODE_BYTES)
    cut = body[: body.rfind(b"}", 0, len(body) - 1)]
    assert answer_usage(cut) == (None, None)


def _adversarial_text(rng: random.Random) -> str:
    pieces = ['"usage":', "{", "}", '\\"', "\\", '"model":"x"', "usage", ":", " ", "é", "\n"]
    return "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 40)))


def test_randomised_answers_agree_with_decoding_them_whole() -> None:
    rng = random.Random(20261202)
    for _ in range(300):
        usage: Any = rng.choice([USAGE, None, {"prompt_tokens": rng.randrange(10**6)}, 7, "usage"])
        after = rng.choice(
            [
                {},
                {"prompt_logprobs": [None, {"5": {"decoded_token": _adversarial_text(rng)}}]},
                {"kv_transfer_params": None, "note": _adversarial_text(rng)},
            ]
        )
        pad = "y" * rng.choice([0, 2 * WHOLE_DECODE_BYTES])
        body = chat_answer(
            _adversarial_text(rng) + pad, usage=usage, logprobs=rng.randrange(3), **after
        )
        assert answer_usage(body) == whole(body), body[-300:]
