"""Ground truth from the engines: usage on every stream (stripped for clients that did not ask),
drift counted per endpoint, and the prefix index corrected by what the engines really had."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from kvgate.ingress import request_context
from kvgate.routing.cache_feedback import CacheFeedback
from kvgate.routing.endpoints import Endpoint
from kvgate.routing.match import PrefixMatch
from kvgate.routing.prefix_hasher import PrefixHasher
from kvgate.routing.prefix_index import PrefixIndex
from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.routing.helpers import endpoint

CHAT = {"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def test_usage_is_asked_upstream_and_stripped_for_clients_that_did_not_ask(upstream, start_gateway):
    engine, up = upstream
    _app, server = start_gateway(gateway_config([up.url]))
    plain = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)
    asked = httpx.post(
        server.url + "/v1/chat/completions",
        json={**CHAT, "stream_options": {"include_usage": True}},
        timeout=10,
    )
    first, second = engine.inference_requests
    assert first.body["stream_options"] == {"include_usage": True}  # the gateway asked
    assert second.body["stream_options"] == {"include_usage": True}
    plain_events, asked_events = _events(plain.content), _events(asked.content)
    assert not any(b'"usage"' in e for e in plain_events)
    assert plain_events[-1] == b"data: [DONE]"
    assert len(asked_events) == len(plain_events) + 1
    usage = orjson.loads(asked_events[-2].removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    # Apart from the usage chunk the client that did not ask gets the same events.
    assert [e for e in asked_events if b'"usage"' not in e] == plain_events


def test_a_null_stream_options_is_replaced_not_duplicated(upstream, start_gateway):
    engine, up = upstream
    _, server = start_gateway(gateway_config([up.url]))
    body = b'{"model": "m1", "stream": true, "stream_options": null, "messages": []}'
    body = body.replace(b"[]", b'[{"role": "user", "content": "hi"}]')
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert reply.status_code == 200
    (received,) = engine.inference_requests
    assert received.body["stream_options"] == {"include_usage": True}
    assert received.raw.count(b'"stream_options"') == 1


@pytest.mark.parametrize(
    ("options", "forwarded"),
    [
        (
            {"include_usage": False, "continuous_usage_stats": False},
            {"include_usage": True, "continuous_usage_stats": False},
        ),
        # vLLM and SGLang send usage on every chunk when both flags are on, and none when
        # `include_usage` is off: the gateway must not ask then.
        (
            {"include_usage": False, "continuous_usage_stats": True},
            {"include_usage": False, "continuous_usage_stats": True},
        ),
    ],
    ids=["asked-for", "continuous-stats-without-usage"],
)
def test_a_client_with_other_stream_options_keeps_them(upstream, start_gateway, options, forwarded):
    engine, up = upstream
    _app, server = start_gateway(gateway_config([up.url]))
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json={**CHAT, "stream_options": options},
        timeout=10,
    )
    assert reply.status_code == 200
    (received,) = engine.inference_requests
    assert received.body["stream_options"] == forwarded
    assert not any(b'"usage"' in e for e in _events(reply.content))


def test_an_options_object_without_include_usage_asks_for_usage_as_the_engines_read_it(
    upstream, start_gateway
):
    """vLLM and SGLang default `include_usage` to true in a `stream_options` object: such a
    client gets the usage chunk it would get from the engine, and nothing is changed."""
    engine, up = upstream
    _app, server = start_gateway(gateway_config([up.url]))
    for options in ({}, {"continuous_usage_stats": True}):
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={**CHAT, "stream_options": options},
            timeout=10,
        )
        assert reply.status_code == 200
        assert engine.inference_requests[-1].body["stream_options"] == options
        assert any(b'"usage"' in e for e in _events(reply.content))


def test_usage_an_engine_puts_on_its_last_content_chunk_reaches_only_clients_that_asked(
    upstream, start_gateway
):
    engine, up = upstream
    last = {
        "choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    engine.script.stream_body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
        + b"data: "
        + orjson.dumps(last)
        + b"\n\ndata: [DONE]\n\n"
    )
    _app, server = start_gateway(gateway_config([up.url]))
    url = server.url + "/v1/chat/completions"
    plain = httpx.post(url, json=CHAT, timeout=10)
    asked = httpx.post(url, json={**CHAT, "stream_options": {"include_usage": True}}, timeout=10)
    assert plain.status_code == asked.status_code == 200
    assert not any(b'"usage"' in e for e in _events(plain.content))
    assert b'"content":"b"' in plain.content and plain.content.endswith(b"data: [DONE]\n\n")
    assert orjson.loads(_events(asked.content)[1][len(b"data: ") :]) == last


def _feedback(capacity: int = 1000) -> tuple[PrefixIndex, CacheFeedback, PrefixHasher]:
    index = PrefixIndex(default_capacity=capacity)
    index.add_endpoints(["e"])
    return index, CacheFeedback(index, min_capacity=4), PrefixHasher(block_chars=64)


def _answered(
    index: PrefixIndex,
    hasher: PrefixHasher,
    text: str,
    endpoint: Endpoint,
    cached: int,
    prompt_tokens: int | None = None,
    prefill: float = 0.0,
):
    """A request for `text` routed to `endpoint` as the picker does, answered with `cached`,
    its first token `prefill` seconds after it was sent."""
    ctx = request_context("chat", {"model": "m", "messages": [{"role": "user", "content": text}]})
    hashes = hasher.chain(ctx.view.canonical, "m")
    tokens = len(hashes) * 16 if prompt_tokens is None else prompt_tokens
    match = PrefixMatch(hashes, tokens, 16.0, index.match(hashes))
    now = match.decided_at = time.monotonic()
    if match.matched.get(endpoint.name):
        touched = index.deepest_touch(endpoint.name, hashes, now)
        assert touched is not None
        match.touched[endpoint.name] = touched
    index.record(endpoint.name, hashes, now)
    ctx.prefix, ctx.endpoint = match, endpoint
    ctx.first_token_at = time.perf_counter()
    ctx.sent_at = ctx.first_token_at - prefill
    ctx.usage = {
        "prompt_tokens": match.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return ctx


def test_the_engine_had_less_than_predicted_forgets_what_it_must_have_evicted():
    index, feedback, hasher = _feedback()
    e = endpoint("e")
    # Canonical text "user\n" + text + a separator: 64 * n characters of text are n blocks.
    ancient, old, newer = ("a" * 64 * 8, "o" * 64 * 20, "n" * 64 * 10)
    for text in (ancient, old, newer):
        feedback.observe(_answered(index, hasher, text, e, cached=0))
        time.sleep(0.001)
    assert index.entries("e") == 8 + 20 + 10
    assert feedback.drift["e"].over == 0  # nothing was predicted yet
    # The engine no longer has the old prompt: the ancient one, touched before it, is gone
    # too (an LRU evicts the oldest first); the old prompt was just computed again.
    feedback.observe(_answered(index, hasher, old, e, cached=0))
    drift = feedback.drift["e"]
    assert drift.over == 1 and drift.predicted_tokens == 20 * 16 and drift.cached_tokens == 0
    assert index.entries("e") == 20 + 10
    assert index.match(hasher.chain("user\n" + ancient + "\x1e", "m")) == {}
    assert index.capacity("e") == 30  # the engine keeps no more than it still has


def test_a_shortfall_on_a_block_still_in_prefill_forgets_nothing():
    """Two requests of one prompt close together: the second is routed while the first may
    still be in its prefill (the gap between them is shorter than a prefill), so the engine had
    not cached the prompt yet. That is no eviction: the index keeps everything."""
    index, feedback, hasher = _feedback()
    e = endpoint("e")
    older, burst = "o" * 64 * 20, "b" * 64 * 10
    feedback.observe(_answered(index, hasher, older, e, cached=0))
    time.sleep(0.002)
    feedback.observe(_answered(index, hasher, burst, e, cached=0, prefill=0.5))
    feedback.observe(_answered(index, hasher, burst, e, cached=0, prefill=0.5))
    drift = feedback.drift["e"]
    assert drift.in_flight == 1 and drift.over == 0
    assert drift.predicted_tokens == 10 * 16 and drift.cached_tokens == 0  # still drift
    assert index.entries("e") == 20 + 10 and index.capacity("e") == 1000
    time.sleep(0.02)  # longer than a 10 ms prefill: the block had been computed by now
    feedback.observe(_answered(index, hasher, burst, e, cached=0, prefill=0.01))
    assert drift.over == 1 and index.entries("e") == 10


def test_the_engine_had_more_than_predicted_grows_the_capacity_up_to_its_kv_size():
    index, feedback, hasher = _feedback(capacity=100)
    feedback.engine_size("e", kv_blocks=150, block_tokens=16)
    assert index.capacity("e") == 150
    index.set_capacity("e", 100)
    e = endpoint("e")
    feedback.observe(_answered(index, hasher, "x" * 64 * 40, e, cached=40 * 16))
    assert feedback.drift["e"].under == 1
    assert index.capacity("e") == 140
    feedback.observe(_answered(index, hasher, "y" * 64 * 40, e, cached=40 * 16))
    assert index.capacity("e") == 150  # never beyond the engine's reported KV size


def test_cached_tokens_beyond_the_hashed_span_are_not_drift():
    index = PrefixIndex(default_capacity=1000)
    index.add_endpoints(["e"])
    feedback = CacheFeedback(index, min_capacity=4)
    hasher = PrefixHasher(block_chars=64, max_blocks=8)  # the index sees 8 blocks, 128 tokens
    e = endpoint("e")
    long_prompt = "l" * 64 * 40
    feedback.observe(_answered(index, hasher, long_prompt, e, cached=0, prompt_tokens=640))
    # The engine holds the whole prompt; the index predicted all it can see of it.
    feedback.observe(_answered(index, hasher, long_prompt, e, cached=640, prompt_tokens=640))
    drift = feedback.drift["e"]
    assert drift.under == drift.over == 0
    assert drift.predicted_tokens == drift.cached_tokens == 128
    assert index.capacity("e") == 1000


def test_a_prediction_within_the_tolerance_changes_nothing():
    index, feedback, hasher = _feedback()
    e = endpoint("e")
    feedback.observe(_answered(index, hasher, "z" * 64 * 30, e, cached=0))
    ctx = _answered(index, hasher, "z" * 64 * 30, e, cached=30 * 16 - 20)  # one block short
    feedback.observe(ctx)
    drift = feedback.drift["e"]
    assert drift.over == drift.under == 0
    assert index.capacity("e") == 1000


def test_drift_is_exported_and_small_when_the_index_is_right(start_gateway):
    options = EngineOptions(profile="fast", kv_blocks=2000)
    with SimFleet.in_thread(engines=2, options=options) as fleet:
        config = gateway_config(fleet.urls, routing={"scrape_interval": 0.2})
        config["pools"][0]["models"] = ["sim-model"]
        app, server = start_gateway(config)
        system = "You are the shop's assistant; answer in one line. " * 40
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for i in range(12):
                body = {
                    "model": "sim-model",
                    "stream": True,
                    "max_tokens": 4,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"question {i}"},
                    ],
                }
                assert client.post("/v1/chat/completions", json=body).status_code == 200
            metrics = client.get("/metrics").text
    predicted = sum(
        sample_value(metrics, "kvgate_prefix_predicted_tokens_total", endpoint=e.name) or 0
        for e in app.fleet.endpoints
    )
    cached = sum(
        sample_value(metrics, "kvgate_prefix_cached_tokens_total", endpoint=e.name) or 0
        for e in app.fleet.endpoints
    )
    assert predicted > 1000 and cached > 1000  # the shared system prompt was found again
    assert abs(predicted - cached) <= 0.1 * predicted


def test_a_prompt_the_engine_refuses_leaves_nothing_in_the_index(start_gateway):
    """The engine answers 400 (prompt and max_tokens beyond its context) without running the
    prompt, so it caches none of it: what the decision recorded is forgotten, and the same
    prompt sent again within the request is not predicted as a hit the engine never had."""
    options = EngineOptions(profile="fast", kv_blocks=2000)
    with SimFleet.in_thread(engines=1, options=options) as fleet:
        config = gateway_config(fleet.urls)
        config["pools"][0]["models"] = ["sim-model"]
        app, server = start_gateway(config)
        name = app.fleet.endpoints[0].name
        body = {
            "model": "sim-model",
            "max_tokens": 1_000_000,
            "messages": [{"role": "user", "content": "a prompt nobody sent before " * 60}],
        }
        with httpx.Client(base_url=server.url, timeout=30) as client:
            refused = client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "context_length_exceeded"
            assert app.routing.index.entries(name) == 0
            body["max_tokens"] = 4
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    drift = app.routing.feedback.drift[name]
    assert drift.predicted_tokens == 0
    assert drift.over == drift.in_flight == 0
    assert app.routing.index.entries(name) > 0  # the answered prompt is recorded
