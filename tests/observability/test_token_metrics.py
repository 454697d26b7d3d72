"""Token counters per tenant, model and pool add up to the usage the clients were sent."""

from __future__ import annotations

import time

import httpx

from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.observability.serving import KEY, SECRET, digest
from tests.sdk_clients import sdk_client
from tests.upstreams import USAGE, chat_answer

_COUNTERS = (
    "kvgate_prompt_tokens_total",
    "kvgate_completion_tokens_total",
    "kvgate_cached_prompt_tokens_total",
)


def _read(base: str) -> tuple[str, list[float | None]]:
    text = httpx.get(base + "/metrics", timeout=5).text
    labels = {"tenant": "ops", "model": "sim-model", "pool": "default"}
    return text, [sample_value(text, name, **labels) for name in _COUNTERS]


def test_token_counters_match_the_usage_answered(start_gateway):
    auth = {"tenants": [{"name": "ops", "keys": [{"id": "ops-1", "sha256": digest(SECRET)}]}]}
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast")) as fleet:
        _, server = start_gateway(gateway_config(fleet.urls, auth=auth))
        client = sdk_client(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        context = "the shared context of every question here. " * 40
        expected = [0, 0, 0]
        for i in range(3):
            usage = client.chat.completions.create(
                model="sim-model",
                max_tokens=5,
                messages=[{"role": "user", "content": f"{context} question {i}"}],
            ).usage
            assert usage is not None and usage.prompt_tokens_details is not None
            expected[0] += usage.prompt_tokens
            expected[1] += usage.completion_tokens
            expected[2] += usage.prompt_tokens_details.cached_tokens or 0
        stream = client.chat.completions.create(
            model="sim-model",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"{context} a streamed question"}],
        )
        final = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        expected[0] += final.prompt_tokens
        expected[1] += final.completion_tokens
        if final.prompt_tokens_details is not None:
            expected[2] += final.prompt_tokens_details.cached_tokens or 0
        assert expected[2] > 0, "the engine never reported a prefix-cache hit"
        deadline = time.monotonic() + 5
        text, counted = _read(server.url)
        while counted != expected:  # the last request is settled just after its answer
            assert time.monotonic() < deadline, (counted, expected)
            time.sleep(0.02)
            text, counted = _read(server.url)
    for edge in ("0.5", "1.0", "2.0", "5.0"):
        bucket = sample_value(
            text, "kvgate_time_to_first_token_seconds_bucket", route="chat", le=edge
        )
        assert bucket is not None, f"no TTFT bucket at {edge} s"


def test_a_large_answer_is_relayed_byte_for_byte_and_its_usage_counted(upstream, gateway):
    """A 150 KB answer with log-probabilities: the gateway reads its usage from the usage
    object alone (kvgate/upstream/answer_usage.py) and after the answer has been sent."""
    engine, _ = upstream
    _, server = gateway
    body = chat_answer("tok " * 500, logprobs=500, model="m1")
    assert len(body) > 100_000
    engine.script.answer_body = body
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "m1",
            "logprobs": True,
            "top_logprobs": 5,
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=10,
    )
    assert response.status_code == 200 and response.content == body
    labels = {"tenant": "anonymous", "model": "m1", "pool": "default"}
    cached = USAGE["prompt_tokens_details"]["cached_tokens"]
    expected = [USAGE["prompt_tokens"], USAGE["completion_tokens"], cached]
    deadline = time.monotonic() + 5
    while True:  # settled just after the answer
        text = httpx.get(server.url + "/metrics", timeout=5).text
        counted = [sample_value(text, name, **labels) for name in _COUNTERS]
        if counted == expected or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert counted == expected
