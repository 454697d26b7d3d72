"""Prefix caching, queueing under KV pressure, preemption and aborts, seen over HTTP."""

import asyncio
import contextlib

import httpx
import pytest

from kvgate.sim import EngineOptions, SimFleet

from .helpers import LONG_TEXT, chat_body, read_stream


async def _stream_chat(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list, float]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events, ttft = await read_stream(response)
    assert events[-1] == "[DONE]"
    assert ttft is not None
    return events, ttft


async def test_repeated_prompt_hits_the_prefix_cache_and_answers_sooner():
    # ~8k prompt tokens: 0.8 s of prefill at 10k tokens/s, divided by speed 4.
    options = EngineOptions(speed=4, kv_blocks=4000)
    prompt = LONG_TEXT * 240
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=30) as client:
        url = fleet.urls[0]
        first, first_ttft = await _stream_chat(client, url, chat_body(prompt, max_tokens=4))
        second, second_ttft = await _stream_chat(client, url, chat_body(prompt, max_tokens=4))
        salted, salted_ttft = await _stream_chat(
            client, url, chat_body(prompt, max_tokens=4, cache_salt="tenant-b")
        )
    prompt_tokens = first[-2]["usage"]["prompt_tokens"]
    assert prompt_tokens > 7000
    assert first[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block but the one holding the last prompt token is reused.
    expected_hit = (prompt_tokens - 1) // 16 * 16
    assert second[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit
    assert salted[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second_ttft < first_ttft / 2
    assert second_ttft < salted_ttft / 2


async def test_full_kv_cache_queues_requests_then_drains():
    # 48 blocks = 768 tokens; each request needs ~300 prompt + 120 output tokens.
    options = EngineOptions(speed=10, kv_blocks=48, max_model_len=768)
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=30) as client:
        engine = fleet.engines[0]
        bodies = [
            chat_body(f"request {index} " + LONG_TEXT * 8, max_tokens=120, ignore_eos=True)
            for index in range(6)
        ]
        tasks = [asyncio.create_task(_stream_chat(client, fleet.urls[0], body)) for body in bodies]
        most_waiting = 0
        while not all(task.done() for task in tasks):
            most_waiting = max(most_waiting, engine.stats()["num_waiting"])
            await asyncio.sleep(0.005)
        results = [task.result() for task in tasks]
        stats = engine.stats()
    assert most_waiting >= 2
    ttfts = sorted(ttft for _, ttft in results)
    assert ttfts[-1] > 3 * ttfts[0]
    assert all(events[-2]["usage"]["completion_tokens"] == 120 for events, _ in results)
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0
    assert stats["kv_cache_usage"] == 0.0
    assert stats["requests_completed"] == 6


async def test_growing_outputs_preempt_the_newest_request():
    # Both prompts fit at admission, but their outputs cannot both grow to 300 tokens.
    options = EngineOptions(speed=20, kv_blocks=40, max_model_len=640)
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=30) as client:
        bodies = [
            chat_body(f"conversation {index}", max_tokens=300, ignore_eos=True)
            for index in range(3)
        ]
        results = await asyncio.gather(
            *(_stream_chat(client, fleet.urls[0], body) for body in bodies)
        )
        stats = fleet.engines[0].stats()
        async with client.stream("GET", f"{fleet.urls[0]}/metrics") as response:
            metrics = (await response.aread()).decode()
    assert all(events[-2]["usage"]["completion_tokens"] == 300 for events, _ in results)
    assert stats["preemptions"] >= 1
    assert "vllm:num_preemptions_total" in metrics
    assert stats["kv_cache_usage"] == 0.0


async def test_client_disconnect_aborts_the_request_promptly():
    options = EngineOptions(speed=1, kv_blocks=1000)
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=30) as client:
        engine = fleet.engines[0]
        body = chat_body("tell me everything", max_tokens=5000, ignore_eos=True, stream=True)
        async with client.stream("POST", f"{fleet.urls[0]}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if '"content":" ' in line or ('"content":"' in line and "role" not in line):
                    break
        assert engine.stats()["num_running"] <= 1
        for _ in range(100):
            if engine.stats()["requests_aborted"] == 1:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
    assert stats["requests_aborted"] == 1
    assert stats["num_running"] == 0
    assert stats["kv_cache_usage"] == 0.0


async def test_non_streaming_disconnect_aborts_too():
    options = EngineOptions(speed=1, kv_blocks=1000)
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=0.3) as client:
        engine = fleet.engines[0]
        body = chat_body("a long answer please", max_tokens=5000, ignore_eos=True)
        with contextlib.suppress(httpx.ReadTimeout):
            await client.post(f"{fleet.urls[0]}/v1/chat/completions", json=body)
        for _ in range(100):
            if engine.stats()["requests_aborted"] == 1:
                break
            await asyncio.sleep(0.01)
        assert engine.stats()["requests_aborted"] == 1
        assert engine.stats()["kv_cache_usage"] == 0.0


@pytest.mark.parametrize(("flavor", "shared"), [("vllm", True), ("sglang", False)])
async def test_a_prefix_scheduled_in_the_same_step_is_shared_as_vllm_shares_it(flavor, shared):
    """vLLM V1 caches a request's blocks when it schedules them, so a second request with the
    same prompt admitted in the same step reuses them; SGLang caches a prefill once it is
    computed, so the second computes it too."""
    options = EngineOptions(flavor=flavor, speed=4, kv_blocks=4000)
    prompt = "A question of its own. " + LONG_TEXT * 30  # shares no block with the blocker
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=30) as client:
        url = fleet.urls[0]
        # A long prefill holds the engine for a step while both copies of the prompt queue.
        blocker = asyncio.create_task(
            _stream_chat(client, url, chat_body(LONG_TEXT * 240, max_tokens=2))
        )
        await asyncio.sleep(0.05)
        (first, _), (second, _) = await asyncio.gather(
            _stream_chat(client, url, chat_body(prompt, max_tokens=2)),
            _stream_chat(client, url, chat_body(prompt, max_tokens=2)),
        )
        await blocker
    usages = [events[-2]["usage"] for events in (first, second)]
    cached = sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    expected = (usages[0]["prompt_tokens"] - 1) // 16 * 16 if shared else 0
    assert cached == [0, expected]


async def test_first_tokens_say_where_each_requests_time_went():
    # Two ~2k-token prompts at once, then the first again: speed 4, so 25 µs per prefill token.
    options = EngineOptions(speed=4, kv_blocks=4000)
    per_token = options.timing.prefill_token_seconds / options.speed
    bodies = [chat_body(f"prompt {index} " + LONG_TEXT * 60, max_tokens=4) for index in range(2)]
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=30) as client:
        url = fleet.urls[0]
        pair = await asyncio.gather(*(_stream_chat(client, url, body) for body in bodies))
        again, _ = await _stream_chat(client, url, bodies[0])
        records = (await client.get(f"{url}/sim/first-tokens")).json()["first_tokens"]
    streams = [events for events, _ in pair] + [again]
    assert sorted(r["id"] for r in records) == sorted(events[0]["id"] for events in streams)
    for record in records:
        uncached = record["prompt_tokens"] - record["cached_tokens"]
        assert record["own_prefill"] == pytest.approx(uncached * per_token)
        # `waiting` is the rest of the time: never negative unless a step was counted twice.
        assert record["waiting"] > -0.001 and record["decodes"] == 0
    first, second, third = records
    # Whichever came second either shared the other's step or waited for it to end.
    delayed = max(r["waiting"] + r["shared_prefill"] for r in (first, second))
    assert delayed >= 0.5 * min(first["own_prefill"], second["own_prefill"])
    assert third["cached_tokens"] > 1500 and third["shared_prefill"] == 0
    assert third["own_prefill"] < first["own_prefill"] / 10
