"""Every fault mode, observed from a real HTTP client."""

import asyncio
import itertools
import time

import httpx
import orjson
import pytest

from kvgate.sim import EngineOptions, SimFleet

from .helpers import chat_body, content_of, read_stream

STREAM_BODY = chat_body("stream please", max_tokens=30, ignore_eos=True, stream=True)


@pytest.fixture
async def fleet():
    async with SimFleet(1, options=EngineOptions(speed=20, kv_blocks=2000, seed=5)) as fleet:
        yield fleet


async def _set_fault(client: httpx.AsyncClient, url: str, **spec) -> None:
    response = await client.post(f"{url}/sim/faults", json=spec)
    assert response.status_code == 200, response.text


async def test_refuse_closes_the_port_until_cleared(fleet):
    engine = fleet.engines[0]
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, engine.url, mode="refuse")
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{engine.url}/health")
        engine.clear_fault()  # HTTP cannot reach a refusing engine: clear it in-process
        assert (await client.get(f"{engine.url}/health")).status_code == 200
        engine.set_fault({"mode": "refuse"})
        await asyncio.sleep(0.05)  # let the engine close the pooled keep-alive connection
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{engine.url}/health")
    engine.clear_fault()
    async with httpx.AsyncClient(timeout=5) as client:
        assert (await client.get(f"{engine.url}/health")).status_code == 200


async def test_reset_before_first_byte_drops_the_connection(fleet):
    url = fleet.urls[0]
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, url, mode="reset_before_first_byte")
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.post(f"{url}/v1/chat/completions", json=chat_body("hi", max_tokens=3))
        stats = (await client.get(f"{url}/sim/stats")).json()
    assert stats["requests_received"] == 1
    assert stats["last_request"]["body"]["messages"][0]["content"] == "hi"


async def test_crash_after_tokens_cuts_the_stream_without_terminator(fleet):
    url = fleet.urls[0]
    chunks = []
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, url, mode="crash_after_tokens", tokens=4)
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            async with client.stream("POST", f"{url}/v1/chat/completions", json=STREAM_BODY) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        chunks.append(line)
        stats = (await client.get(f"{url}/sim/stats")).json()
    texts = [content_of(orjson.loads(line[6:])) for line in chunks]
    assert len([text for text in texts if text]) == 4
    assert "data: [DONE]" not in chunks
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0


async def test_http_error_uses_status_retry_after_and_flavour_shape(fleet):
    url = fleet.urls[0]
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, url, mode="http_error", status=503, retry_after=7)
        response = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "7"
    assert response.json()["error"]["code"] == 503


async def test_slow_first_token_delays_the_first_token(fleet):
    url = fleet.urls[0]
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, url, mode="slow_first_token", delay_ms=300)
        started = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=STREAM_BODY) as r:
            events, ttft = await read_stream(r, started)
    assert ttft is not None and ttft >= 0.3
    assert events[-1] == "[DONE]"


async def test_stall_after_tokens_pauses_mid_stream(fleet):
    url = fleet.urls[0]
    arrivals = []
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, url, mode="stall_after_tokens", tokens=3, delay_ms=400)
        async with client.stream("POST", f"{url}/v1/chat/completions", json=STREAM_BODY) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and content_of(orjson.loads(line[6:])):
                    arrivals.append(time.perf_counter())
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert len(arrivals) == 30
    assert gaps[2] >= 0.35  # between token 3 and token 4
    assert max(gaps[:2] + gaps[3:]) < 0.35


async def test_malformed_sse_emits_a_non_json_event(fleet):
    url = fleet.urls[0]
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, url, mode="malformed_sse", tokens=2)
        async with client.stream("POST", f"{url}/v1/chat/completions", json=STREAM_BODY) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    bad = []
    for line in lines:
        if line == "data: [DONE]":
            continue
        try:
            orjson.loads(line[6:])
        except orjson.JSONDecodeError:
            bad.append(line)
    assert len(bad) == 1


async def test_hang_never_answers_but_the_request_arrived(fleet):
    url = fleet.urls[0]
    async with httpx.AsyncClient(timeout=0.4) as client:
        await _set_fault(client, url, mode="hang")
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{url}/v1/chat/completions", json=chat_body("anyone?"))
        stats = (await client.get(f"{url}/sim/stats")).json()
    assert stats["requests_received"] == 1
    assert stats["faults_applied"] == 1


async def test_count_applies_to_the_next_k_requests_and_delete_clears(fleet):
    url = fleet.urls[0]
    body = chat_body("hello", max_tokens=2)
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, url, mode="http_error", status=500, count=2)
        statuses = [
            (await client.post(f"{url}/v1/chat/completions", json=body)).status_code
            for _ in range(4)
        ]
        assert statuses == [500, 500, 200, 200]
        await _set_fault(client, url, mode="http_error", status=502)
        assert (await client.post(f"{url}/v1/chat/completions", json=body)).status_code == 502
        assert (await client.delete(f"{url}/sim/faults")).status_code == 200
        assert (await client.post(f"{url}/v1/chat/completions", json=body)).status_code == 200
        assert (await client.get(f"{url}/sim/faults")).json()["fault"] is None


async def test_probability_fires_on_a_seeded_fraction(fleet):
    url = fleet.urls[0]
    body = chat_body("hello", max_tokens=1)
    async with httpx.AsyncClient(timeout=5) as client:
        await _set_fault(client, url, mode="http_error", status=503, probability=0.5)
        statuses = await asyncio.gather(
            *(client.post(f"{url}/v1/chat/completions", json=body) for _ in range(60))
        )
    failures = sum(response.status_code == 503 for response in statuses)
    assert 10 < failures < 50


async def test_invalid_fault_is_rejected(fleet):
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.post(f"{fleet.urls[0]}/sim/faults", json={"mode": "explode"})
    assert response.status_code == 400
    assert "unknown fault mode" in response.json()["error"]["message"]


async def test_fault_given_at_start_applies():
    options = EngineOptions(profile="fast", fault={"mode": "http_error", "status": 429})
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=5) as client:
        response = await client.post(f"{fleet.urls[0]}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 429
