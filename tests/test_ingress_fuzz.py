"""10,000 fuzzed bodies through the real gateway to a scripted upstream that records what
reaches it: every answer is a clean OpenAI-shaped 4xx or a served answer, nothing reaches the
engine that breaks the schema (checked here by a reference written apart from
kvgate/message_schema.py), and whatever is served reaches the engine untouched (but for the
usage request the gateway adds to every stream).

Bodies are made deterministically from a seed by mutating valid ones: types swapped, keys
deleted or added, nodes wrapped or unwrapped, nesting, huge and negative numbers, unicode,
truncated or non-UTF-8 bytes, bodies sent to the wrong route."""

from __future__ import annotations

import copy
import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
}
OPENAI_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
VALID: list[tuple[str, dict[str, Any]]] = [
    (
        "chat",
        {
            "model": "m1",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 5,
        },
    ),
    (
        "chat",
        {
            "model": "m1",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is it?"},
                        {"type": "image_url", "image_url": {"url": "https://e.com/a.png"}},
                    ],
                }
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "chat",
        {
            "model": "m1",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "use tools"}]},
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": "sunny", "name": "f"},
            ],
            "n": 2,
        },
    ),
    ("completions", {"model": "m1", "prompt": "Once upon a time", "max_tokens": 3}),
    ("completions", {"model": "m1", "prompt": ["a", "b"], "stream": True}),
    ("completions", {"model": "m1", "prompt": [1, 2, 3], "max_completion_tokens": 4}),
    ("completions", {"model": "m1", "prompt": [[1, 2], [3, 4]]}),
    ("embeddings", {"model": "m1", "input": "embed me"}),
    ("embeddings", {"model": "m1", "input": [[5, 6]]}),
]
STRINGS = ["", "hi", "\u0000", "é\u202ehé", "🦀" * 50, "x" * 5000, "user", "text", "m1"]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(14 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 7, 2**31, 2**63 - 1, -(2**63)])
    if kind == 3:
        return rng.choice([10**30, -(10**30), 1.5, -0.0, 1e308])
    if kind in (4, 5, 6):
        return rng.choice(STRINGS)
    if kind == 7:
        return []
    if kind == 8:
        return {}
    if kind == 9:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(1, 4))]
    if kind == 10:
        return {rng.choice([*STRINGS, "role", "content", "type"]): _random_value(rng, depth + 1)}
    if kind == 11:
        nested: Any = "deep"
        for _ in range(rng.choice([10, 100, 500])):
            nested = [nested]
        return nested
    if kind == 12:
        return {"type": rng.choice(["text", "image_url", "refusal", "odd"])}
    return {"a": 1}


def _containers(node: Any, out: list[Any]) -> list[Any]:
    if isinstance(node, dict | list):
        out.append(node)
        for child in node.values() if isinstance(node, dict) else node:
            _containers(child, out)
    return out


def _mutate(rng: random.Random, body: dict[str, Any]) -> None:
    target = rng.choice(_containers(body, []))
    keys = list(target) if isinstance(target, dict) else list(range(len(target)))
    action = rng.randrange(5)
    if action == 0 and keys:  # another value, of any type
        target[rng.choice(keys)] = _random_value(rng)
    elif action == 1 and keys:  # a key or item gone
        del target[rng.choice(keys)]
    elif action == 2 and isinstance(target, dict):  # an extra field
        target[rng.choice(["extra", "role", "content", "stream", "n", "prompt", "input"])] = (
            _random_value(rng)
        )
    elif action == 3 and keys:  # wrapped in an array
        key = rng.choice(keys)
        target[key] = [target[key]]
    elif keys:  # unwrapped
        key = rng.choice(keys)
        if isinstance(target[key], list) and target[key]:
            target[key] = target[key][0]


def fuzzed(seed: int, count: int) -> list[tuple[str, bytes]]:
    """`count` (route, body bytes) pairs, the same for the same seed."""
    rng = random.Random(seed)
    out: list[tuple[str, bytes]] = []
    for _ in range(count):
        route, valid = rng.choice(VALID)
        body = copy.deepcopy(valid)
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            _mutate(rng, body)
        raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
        roll = rng.random()
        if roll < 0.03:
            raw = raw[: rng.randrange(len(raw))]
        elif roll < 0.05:
            at = rng.randrange(len(raw))
            raw = raw[:at] + bytes([rng.randrange(128, 256)]) + raw[at:]
        elif roll < 0.08:
            route = rng.choice(list(ROUTES))
        elif roll < 0.085:  # deeper than any JSON parser's limit
            depth = rng.choice([1000, 5000])
            raw = b'{"model": "m1", "messages": ' + b"[" * depth + b"]" * depth + b"}"
        out.append((route, raw))
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# vLLM takes the type of a part sent without one from any of these keys.
MEDIA_KEYS = ("image_url", "image_embeds", "audio_embeds", "audio_url", "input_audio", "video_url")


def _part_ok(part: Any) -> bool:
    if isinstance(part, dict) and part.get("type") is None:
        return any(part.get(key) is not None for key in MEDIA_KEYS)
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        return False
    required = {"text": str, "refusal": str, "image_url": dict, "input_audio": dict, "file": dict}
    kind = part["type"]
    if kind not in required:
        return True
    if not isinstance(part.get(kind), required[kind]):
        return False
    return kind != "image_url" or isinstance(part[kind].get("url"), str)


def _message_ok(message: Any) -> bool:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    if not message["role"]:
        return False
    role, content = message["role"], message.get("content")
    # Of OpenAI's roles only these go without content (or with no parts); a chat template's
    # own role (vLLM passes custom roles on) may.
    calls = message.get("tool_calls") is not None or message.get("function_call") is not None
    may_omit = role not in OPENAI_ROLES or role == "function" or (role == "assistant" and calls)
    if content is None or content == []:
        if not may_omit:
            return False
    elif not isinstance(content, str) and (
        not isinstance(content, list) or not all(map(_part_ok, content))
    ):
        return False
    if "name" in message and message["name"] is not None and not isinstance(message["name"], str):
        return False
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        return False
    calls = message.get("tool_calls")
    return calls is None or (isinstance(calls, list) and all(isinstance(c, dict) for c in calls))


def _prompt_ok(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return (
        all(isinstance(p, str) for p in prompt)
        or all(_is_int(p) for p in prompt)
        or all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    )


def _depth(root: Any) -> int:
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children)
    return deepest


def reference_schema_ok(route: str, body: Any) -> bool:
    """What may reach an engine, stated independently of the gateway's code."""
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        return False
    if _depth(body) > 254:
        return False
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(map(_message_ok, messages)):
            return False
        tools = body.get("tools")
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            return False
    elif route == "completions":
        if body.get("prompt") is None and body.get("prompt_embeds") is not None:
            pass  # vLLM: the embeddings stand for the prompt
        elif not _prompt_ok(body.get("prompt")):
            return False
    elif "input" not in body and "messages" in body:  # vLLM's chat embeddings
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or not all(map(_message_ok, messages)):
            return False
    elif not _prompt_ok(body.get("input")):
        return False
    if route == "embeddings":
        return True
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return False
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        return False
    if isinstance(options, dict) and any(
        options.get(flag) is not None and not isinstance(options[flag], bool)
        for flag in ("include_usage", "continuous_usage_stats")
    ):
        return False
    echo_only = route == "completions" and body.get("echo") is True  # may generate nothing
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(key)
        least = 0 if echo_only and key == "max_tokens" else 1
        whole = _is_int(value) or (isinstance(value, float) and value.is_integer())
        if value is not None and not (whole and least <= value < 2**63):
            return False
    return True


def _as_forwarded(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body as the gateway forwards it: untouched, except that a chat or completions
    stream asks the engine for usage unless the client asked (a `stream_options` object asks
    unless it says otherwise, as the engines read it) or set `continuous_usage_stats`
    (kvgate/upstream/usage_request.py)."""
    options = body.get("stream_options")
    asks = isinstance(options, dict) and (
        options.get("include_usage", True) is True or bool(options.get("continuous_usage_stats"))
    )
    if route in ("chat", "completions") and body.get("stream") is True and not asks:
        return {**body, "stream_options": {**(options or {}), "include_usage": True}}
    return body


def _clean_error(response: httpx.Response) -> bool:
    if not 400 <= response.status_code < 500:
        return False
    error = response.json().get("error")
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and error["type"] == "invalid_request_error"
        and (error["param"] is None or isinstance(error["param"], str))
        and (error["code"] is None or isinstance(error["code"], str))
    )


def _served(response: httpx.Response) -> bool:
    if response.status_code != 200:
        return False
    if response.headers["content-type"].startswith("text/event-stream"):
        return response.content.endswith(b"data: [DONE]\n\n")
    return isinstance(response.json(), dict)


def test_the_fuzz_makes_what_it_claims():
    bodies = fuzzed(16, 2000)
    assert bodies == fuzzed(16, 2000)  # deterministic
    parsed = [orjson.loads(raw) if _parses(raw) else None for _, raw in bodies]
    valid = sum(reference_schema_ok(route, p) for (route, _), p in zip(bodies, parsed, strict=True))
    assert 0.15 < valid / len(bodies) < 0.7  # both kinds, many of each
    assert sum(p is None for p in parsed) > 50  # and bytes that are no JSON at all


def _parses(raw: bytes) -> bool:
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return True


@pytest.mark.timeout(300)
def test_ten_thousand_fuzzed_bodies(upstream, start_gateway):
    from tests.conftest import gateway_config

    engine, engine_server = upstream
    _, server = start_gateway(
        gateway_config([engine_server.url], pool={"models": ["m1"]}, auth="none")
    )
    bodies = fuzzed(16, 10_000)

    def post(client: httpx.Client, i: int) -> httpx.Response:
        route, raw = bodies[i]
        return client.post(
            ROUTES[route],
            content=raw,
            headers={"content-type": "application/json", "x-request-id": f"fuzz-{i}"},
        )

    # Four clients at once (the engine's log tells requests apart by their request id).
    with httpx.Client(base_url=server.url, timeout=30) as client, ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda i: post(client, i), range(len(bodies))))
    reached: dict[str, list[Any]] = {}
    for request in engine.inference_requests:
        reached.setdefault(request.headers["x-request-id"], []).append(request)
    counts = {"served": 0, "refused": 0}
    for i, ((route, raw), response) in enumerate(zip(bodies, responses, strict=True)):
        arrived = reached.get(f"fuzz-{i}", [])
        if _served(response):
            counts["served"] += 1
            assert len(arrived) == 1, raw[:300]
            assert reference_schema_ok(route, arrived[0].body), raw[:300]
            assert arrived[0].body == _as_forwarded(route, orjson.loads(raw))
        else:
            counts["refused"] += 1
            assert _clean_error(response), (response.status_code, response.text[:300])
            assert arrived == [], raw[:300]
    assert counts["served"] > 1000 and counts["refused"] > 1000, counts
