"""Per GPU-hour prices: the pool's dollars per second over the tokens per second its engines
processed, measured from their own counters."""

from __future__ import annotations

import time

import httpx
import pytest

from kvgate.config import PriceConfig
from kvgate.observability.cost import (
    MIN_THROUGHPUT_SPAN,
    THROUGHPUT_WINDOW,
    ChargedTokens,
    PoolPrice,
)
from kvgate.routing.endpoints import Endpoint
from kvgate.routing.telemetry import EngineTelemetry
from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.sdk_clients import sdk_client

# $3.60 a GPU-hour, 2 GPUs: $0.002 a second.
_PRICE = {"gpu_hour": 3.6, "gpus": 2}


def _endpoint(name: str) -> Endpoint:
    return Endpoint(name, f"http://{name}", "gpu", "vllm", frozenset({"m"}))


def _scrape(endpoint: Endpoint, at: float, prompt: float, hits: float, generated: float) -> None:
    endpoint.telemetry = EngineTelemetry(
        scraped_at=at, prompt_tokens=prompt, prefix_hits=hits, generation_tokens=generated
    )


def test_a_token_costs_the_pool_per_second_over_its_measured_tokens_per_second():
    a, b = _endpoint("a"), _endpoint("b")
    price = PoolPrice(PriceConfig(**_PRICE), [a, b])
    tokens = ChargedTokens(input=600, cached=5000, output=400)
    _scrape(a, 90.0, 0, 0, 0)
    assert price.dollars(tokens) is None  # one sample: no rate yet
    # b's first scrape: what it counted since it started is no work of this minute.
    _scrape(b, 100.0, 50_000, 0, 50_000)
    _scrape(a, 100.0, 0, 0, 0)
    assert price.dollars(tokens) is None
    _scrape(a, 100.0 + MIN_THROUGHPUT_SPAN / 2, 10, 0, 10)
    assert price.dollars(tokens) is None  # too short a span to trust
    # 10 s later the two engines processed 900 + 100 uncached prompt tokens and 1000 output.
    _scrape(a, 110.0, 1000, 100, 600)
    _scrape(b, 109.0, 50_100, 0, 50_400)
    # 2000 tokens in 10 s: 200 tokens/s, so 1000 charged tokens are 5 s of the pool.
    assert price.dollars(tokens) == pytest.approx(5 * 0.002)
    # A minute later, the rate is that of the last minute only: 12000 tokens in 60 s.
    _scrape(a, 110.0 + THROUGHPUT_WINDOW, 1000 + 6000, 100, 600 + 6000)
    assert price.dollars(tokens) == pytest.approx(1000 * 0.002 / (12000 / THROUGHPUT_WINDOW))
    # An engine that restarts (its counters begin again) starts the measurement over.
    _scrape(a, 200.0, 10, 0, 10)
    assert price.dollars(tokens) is None


def test_gpu_hour_cost_is_counted_from_the_engines_throughput(start_gateway):
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="realistic")) as fleet:
        config = gateway_config(fleet.urls, pool={"price": _PRICE})
        config["routing"] = {"scrape_interval": 0.1}
        _, server = start_gateway(config)
        client = sdk_client(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        started = time.monotonic()
        i = 0
        # Requests until the counters span enough time to price, then for one second more.
        while time.monotonic() - started < MIN_THROUGHPUT_SPAN + 1.5:
            client.chat.completions.create(
                model="sim-model",
                max_tokens=4,
                messages=[{"role": "user", "content": f"question {i} " * 30}],
            )
            i += 1
        elapsed = time.monotonic() - started
        text = httpx.get(server.url + "/metrics", timeout=5).text
    labels = {"tenant": "anonymous", "model": "sim-model", "pool": "default"}
    cost = sample_value(text, "kvgate_cost_dollars_total", **labels)
    # The gateway is the pool's only client and keeps it busy: the requests priced (those of
    # the last 1.5 s or so) cost about the pool's dollars over that time, never the whole run.
    assert cost is not None and 0 < cost < 0.002 * elapsed
