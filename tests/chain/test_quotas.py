"""Quotas: token buckets with reservation, exact under concurrency, settled to actual usage,
and nothing left open after errors, disconnects and refusals."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvgate.state.quotas import InMemoryQuotaStore, QuotaExceeded, QuotaLimits, QuotaTooSmall
from tests.chain.helpers import IDLE, admission_state, chat, make_key, tenant
from tests.conftest import gateway_config


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_reload_keeps_remaining_tenants_buckets_and_their_open_reservations():
    clock = Clock()
    old = InMemoryQuotaStore(clock)
    limits = QuotaLimits(requests_per_minute=4, tokens_per_minute=1000)
    running = await old.reserve("kept", limits, 600)
    await old.reserve("gone", limits, 100)
    new = InMemoryQuotaStore(clock)
    # "kept": the token limit drops to 800 (600 used leaves 200), requests become unlimited.
    new.adopt(old, {"kept": QuotaLimits(tokens_per_minute=800)})
    assert new.outstanding() == (1, 600)  # the removed tenant's reservation is not carried
    with pytest.raises(QuotaExceeded) as short:
        await new.reserve("kept", QuotaLimits(tokens_per_minute=800), 300)
    assert short.value.retry_after == pytest.approx(100 / (800 / 60))
    old.settle(running, 100)  # the request begun before the reload settles: 500 come back
    assert new.outstanding() == (0, 0)
    for _ in range(5):  # no request limit any more
        await new.reserve("kept", QuotaLimits(tokens_per_minute=800), 100)


async def test_reserve_settle_release_and_retry_after():
    clock = Clock()
    store = InMemoryQuotaStore(clock)
    limits = QuotaLimits(requests_per_minute=2, tokens_per_minute=600)
    first = await store.reserve("t", limits, 400)
    with pytest.raises(QuotaExceeded) as short:
        await store.reserve("t", limits, 300)
    assert short.value.limit == "tokens_per_minute"
    assert short.value.retry_after == pytest.approx(10.0)  # 100 tokens at 10 tokens/s
    store.settle(first, 100)  # used 100 of 400: 300 come back
    second = await store.reserve("t", limits, 300)
    with pytest.raises(QuotaExceeded) as requests:
        await store.reserve("t", limits, 1)
    assert requests.value.limit == "requests_per_minute"
    assert requests.value.retry_after == pytest.approx(30.0)  # one request at 2/min
    store.release(second)  # never ran: the request and its tokens come back
    store.release(second)  # idempotent
    assert store.outstanding() == (0, 0)
    third = await store.reserve("t", limits, 500)
    clock.now += 6.0  # 60 tokens refill
    store.settle(third, 700)  # used more than reserved: the bucket goes into debt
    with pytest.raises(QuotaExceeded) as debt:
        await store.reserve("t", limits, 100)
    # level: 600 -400 +300 -300 +300 -500 = 0; +60 refilled; -200 of debt = -140
    assert debt.value.retry_after == pytest.approx((100 + 140) / 10)
    with pytest.raises(QuotaTooSmall):
        await store.reserve("t", limits, 601)
    assert store.outstanding() == (0, 0)


async def test_exact_under_concurrency():
    store = InMemoryQuotaStore()
    limits = QuotaLimits(requests_per_minute=7)

    async def one() -> bool:
        try:
            await store.reserve("t", limits, 1)
        except QuotaExceeded:
            return False
        return True

    results = await asyncio.gather(*(one() for _ in range(50)))
    assert sum(results) == 7


KEY, ENTRY = make_key("q-1")


def _config(url: str, **limits) -> dict:
    return gateway_config(
        [url],
        pool={"models": ["m1"]},
        auth={"tenants": [tenant("q", "silver", [ENTRY], limits=limits)]},
    )


def test_requests_per_minute_exact_over_http(upstream, start_gateway):
    engine, up = upstream
    app, server = start_gateway(_config(up.url, requests_per_minute=3))

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        server.url + "/v1/chat/completions",
                        headers={"authorization": f"Bearer {KEY}"},
                        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
                    )
                    for _ in range(20)
                )
            )

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 3 + [429] * 17
    limited = next(r for r in responses if r.status_code == 429)
    error = limited.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert "requests_per_minute" in error["message"]
    assert 15 <= int(limited.headers["retry-after"]) <= 20  # 1 request refills in 20 s
    assert len(engine.inference_requests) == 3
    assert admission_state(app, server) == IDLE


def test_tokens_settle_to_usage(upstream, start_gateway):
    """Each request reserves prompt (1) + max_tokens (100) = 101 of 250 tokens/min; the
    scripted engine reports 6 tokens used, so many more than two requests fit."""
    _, up = upstream
    app, server = start_gateway(_config(up.url, tokens_per_minute=250))
    for _ in range(10):
        assert chat(server.url, KEY, max_tokens=100).status_code == 200
    assert admission_state(app, server) == IDLE


def test_streams_settle_from_usage_or_relayed_events(upstream, start_gateway):
    engine, up = upstream
    engine.script.chunks = 5
    app, server = start_gateway(_config(up.url, tokens_per_minute=250))
    for options in ({"stream_options": {"include_usage": True}}, {}):
        for _ in range(6):
            response = chat(server.url, KEY, max_tokens=100, stream=True, **options)
            assert response.status_code == 200
    assert admission_state(app, server) == IDLE


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
        ("/v1/responses", "max_output_tokens"),
    ],
)
def test_request_larger_than_the_quota_is_400_naming_the_field(
    upstream, start_gateway, path, field
):
    engine, up = upstream
    app, server = start_gateway(_config(up.url, tokens_per_minute=100))
    body = {"model": "m1", field: 200}
    body |= (
        {"input": "hi"}
        if path == "/v1/responses"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    response = httpx.post(
        server.url + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=10
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "tokens_exceed_quota"
    assert response.json()["error"]["param"] == field
    assert field in response.json()["error"]["message"]
    assert engine.inference_requests == []
    assert admission_state(app, server) == IDLE


@pytest.mark.parametrize(
    "body",
    [
        # Completions have no `max_completion_tokens` (engines ignore it): `max_tokens` counts.
        {"prompt": "hi", "max_completion_tokens": 1, "max_tokens": 200},
        # A batch of prompts generates up to `max_tokens` for each.
        {"prompt": [f"p{i}" for i in range(5)], "max_tokens": 40},
        {"prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 40},
    ],
)
def test_a_completions_request_reserves_what_the_engine_will_generate(
    upstream, start_gateway, body
):
    engine, up = upstream
    app, server = start_gateway(_config(up.url, tokens_per_minute=100))
    response = httpx.post(
        server.url + "/v1/completions",
        json={"model": "m1", **body},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "tokens_exceed_quota"
    assert engine.inference_requests == []
    assert admission_state(app, server) == IDLE
    one = {"model": "m1", "prompt": "hi", "max_tokens": 40}
    answer = httpx.post(
        server.url + "/v1/completions", json=one, headers={"authorization": f"Bearer {KEY}"}
    )
    assert answer.status_code == 200, answer.text


def test_a_background_response_under_a_token_quota_must_bound_its_output(upstream, start_gateway):
    """The engine generates a background response after answering: the gateway never sees its
    usage and charges the reservation, which counts only a `max_output_tokens` it was given."""
    engine, up = upstream
    app, server = start_gateway(_config(up.url, tokens_per_minute=1000))
    body = {"model": "m1", "input": "hi", "background": True, "store": True}
    headers = {"authorization": f"Bearer {KEY}"}
    refused = httpx.post(server.url + "/v1/responses", json=body, headers=headers)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("missing_required_parameter", "max_output_tokens")
    assert engine.inference_requests == []
    assert admission_state(app, server) == IDLE
    bounded = httpx.post(
        server.url + "/v1/responses", json={**body, "max_output_tokens": 50}, headers=headers
    )
    assert bounded.status_code == 200, bounded.text


@pytest.mark.parametrize("failure", ["upstream_500", "unknown_model", "bad_header"])
def test_failures_release_everything(upstream, start_gateway, failure):
    engine, up = upstream
    app, server = start_gateway(_config(up.url, requests_per_minute=2, max_concurrent=1))
    if failure == "upstream_500":
        engine.script.status = 500
        assert chat(server.url, KEY).status_code == 500
    elif failure == "unknown_model":
        assert chat(server.url, KEY, model="nope").status_code == 404
    else:
        response = chat(server.url, KEY, headers={"x-kvgate-workflow-step": "x"})
        assert response.status_code == 400
    assert admission_state(app, server) == IDLE


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"x-kvgate-timeout-ms": "abc"}, {}),
        ({"x-kvgate-first-token-timeout-ms": "0"}, {}),
        ({"x-kvgate-deadline": "-1"}, {}),
        ({"x-kvgate-workflow-step": "2/1", "x-kvgate-workflow-id": "w"}, {}),
        ({}, {"max_tokens": 0}),
        ({}, {"stream": "yes"}),
    ],
)
def test_a_refused_request_is_never_charged(upstream, start_gateway, headers, body):
    """Every client input is checked before admission: refusals take no quota, no queue place
    and no engine, so the tenant's whole allowance is still there afterwards."""
    engine, up = upstream
    app, server = start_gateway(_config(up.url, requests_per_minute=2))
    for _ in range(3):
        refused = chat(server.url, KEY, headers=headers, **body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["type"] == "invalid_request_error"
    assert engine.inference_requests == []
    assert admission_state(app, server) == IDLE
    assert [chat(server.url, KEY).status_code for _ in range(3)] == [200, 200, 429]
