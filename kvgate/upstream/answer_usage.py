"""The `usage` (and `model`) of an engine's non-stream answer, without decoding the rest of it.

Settlement needs a few numbers from an answer the gateway otherwise relays untouched. A small
answer is decoded whole (about a microsecond). A large one is mostly text and, with `logprobs`,
a list of tokens and numbers: 150 KB for 500 tokens with five top log-probabilities, 1.3 ms of
`orjson.loads`. For those only the `usage` object is decoded. In JSON an unescaped `"usage"`
followed by a colon can only be an object key (inside a string its quotes are escaped); vLLM,
SGLang and OpenAI write the answer's own `usage` after the choices, and nothing after it
carries such a key, so the last one found is the answer's. The bytes from the `{` after it to
its matching `}` parse as that object and as nothing else (a JSON object is never a prefix of
a longer valid text). Anything unexpected (the last `"usage"` not a key, its value not an
object, a slice that does not parse or is longer than any usage, an object without a token
count, such as a tool's schema with a property of that name) falls back to decoding the whole
answer.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

# Below this size the whole answer is decoded: it costs about as little as the scan.
WHOLE_DECODE_BYTES = 16 * 1024
_USAGE_KEY = b'"usage"'
# Longer than any usage object an engine writes (a few counters and their details).
_MAX_USAGE_BYTES = 4096
_AFTER_KEY = re.compile(rb"\s*:\s*")
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{0,512})"')
# A usage object has at least one of these counts (chat and completions, embeddings, the
# Responses API).
_COUNTS = ("total_tokens", "prompt_tokens", "input_tokens")


def in_chat_terms(usage: dict[str, Any]) -> dict[str, Any]:
    """`usage` with chat completions' names, which settlement reads (token counters, cost,
    quota, the prefix index's feedback, the access log, traces): the Responses API's
    `input_tokens`, `output_tokens` and `input_tokens_details.cached_tokens` as
    `prompt_tokens`, `completion_tokens` and `prompt_tokens_details.cached_tokens`; any other
    usage as it is."""
    if "prompt_tokens" in usage or "input_tokens" not in usage:
        return usage
    chat = {
        **usage,
        "prompt_tokens": usage["input_tokens"],
        "completion_tokens": usage.get("output_tokens"),
    }
    details = usage.get("input_tokens_details")
    if isinstance(details, dict) and "cached_tokens" in details:
        chat["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return chat


def _all_read(usage: dict[str, Any]) -> dict[str, Any]:
    """A non-stream answer's usage with a lone `total_tokens` (a rerank answer's: every token
    read, none generated) with them as `prompt_tokens` too; any other as it is."""
    total = usage.get("total_tokens")
    if len(usage) != 1 or not isinstance(total, int):
        return usage
    return {"total_tokens": total, "prompt_tokens": total}


def answer_usage(body: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The `usage` of a non-stream answer (in chat terms), for settlement, and the `model` it
    names (looked for only if a usage is present)."""
    # Searched from the end, where engines write it: a forward search of a 150 KB answer with
    # log-probabilities (quotes everywhere) took 120 µs, this one under a microsecond.
    key = body.rfind(_USAGE_KEY)
    if key < 0:
        return None, None
    if len(body) > WHOLE_DECODE_BYTES:
        usage = _usage_object(body, key)
        if usage is not None:
            model = _MODEL.search(body)
            chat = _all_read(in_chat_terms(usage))
            return chat, None if model is None else model.group(1).decode()
    return _decoded(body)


def _usage_object(body: bytes, key: int) -> dict[str, Any] | None:
    """The object after the `"usage"` at `key` (the last in `body`), or None when that is not
    a key followed by an object."""
    colon = _AFTER_KEY.match(body, key + len(_USAGE_KEY))
    if colon is None or body[colon.end() : colon.end() + 1] != b"{":
        return None
    start = colon.end()
    closed = 0
    position = start
    limit = start + _MAX_USAGE_BYTES
    while (end := body.find(b"}", position, limit)) >= 0:
        closed += 1
        if body.count(b"{", start, end) == closed:
            try:
                usage = orjson.loads(body[start : end + 1])
            except orjson.JSONDecodeError:
                return None
            if isinstance(usage, dict) and any(isinstance(usage.get(k), int) for k in _COUNTS):
                return usage
            return None
        position = end + 1
    return None


def _decoded(body: bytes) -> tuple[dict[str, Any] | None, str | None]:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    return parsed_usage(parsed)


def parsed_usage(parsed: Any) -> tuple[dict[str, Any] | None, str | None]:
    """`answer_usage` of an answer already decoded (`parsed`, any JSON value)."""
    if not isinstance(parsed, dict):
        return None, None
    usage = parsed.get("usage")
    model = parsed.get("model")
    return (
        _all_read(in_chat_terms(usage)) if isinstance(usage, dict) else None,
        model if isinstance(model, str) else None,
    )
