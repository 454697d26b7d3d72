"""The routing benchmark's TTFT floor (benchmarks/cache_ideals.py) is a floor: a simulated
engine never answers a prompt's first token sooner, cold or with the prompt cached, and the
floor follows the cache (a repeated prompt's floor is its last block's prefill only)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvgate.sim import EngineOptions, SimFleet
from tests import benchmark_modules

cache_ideals_module = benchmark_modules.load("cache_ideals")
cache_ideals = cache_ideals_module.cache_ideals
prefill_seconds = cache_ideals_module.prefill_seconds

SPEED = 5.0


async def _ttft(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, int]:
    """Seconds to the first streamed event, and the engine's cached prompt tokens."""
    sent = time.perf_counter()
    first = None
    cached = -1
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - sent
            if '"prompt_tokens_details"' in line:
                usage = json.loads(line[6:])["usage"]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert first is not None
    return first, cached


def test_a_chunked_prefill_pays_one_step_per_chunk():
    assert prefill_seconds(8192, 1.0, 8192) == pytest.approx(0.015 + 0.8192)
    assert prefill_seconds(8193, 2.0, 8192) == pytest.approx((2 * 0.015 + 0.8193) / 2)


async def test_the_engine_never_beats_the_floor_cold_or_cached():
    words = " ".join(f"w{i}" for i in range(2500))
    body = {
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    cold, warm = cache_ideals([body, body], capacity_blocks=10_000, speed=SPEED).ttft_floors
    assert warm < cold / 10  # the repeat only computes the block holding its last token
    async with (
        SimFleet(1, options=EngineOptions(speed=SPEED)) as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        first, cached_first = await _ttft(client, fleet.urls[0], body)
        second, cached_second = await _ttft(client, fleet.urls[0], body)
    assert cached_first == 0 and cached_second > 0
    assert first >= cold
    assert second >= warm
