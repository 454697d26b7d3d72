"""/metrics mirrors what each engine last reported (running, waiting, KV cache use)."""

from __future__ import annotations

import time

import httpx

from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.metrics_text import sample_value

_MIRRORS = (
    "kvgate_engine_running_requests",
    "kvgate_engine_waiting_requests",
    "kvgate_engine_kv_cache_usage_ratio",
)


def _mirrored(base: str) -> dict[str, float | None]:
    text = httpx.get(base + "/metrics", timeout=5).text
    return {name: sample_value(text, name, endpoint="default-0") for name in _MIRRORS}


def test_engine_telemetry_is_mirrored_per_endpoint(start_gateway):
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="realistic")) as fleet:
        config = gateway_config(fleet.urls)
        config["routing"] = {"scrape_interval": 0.1}
        _, server = start_gateway(config)
        body = {
            "model": "sim-model",
            "max_tokens": 300,  # ~5 s of decoding: running while the mirrors are read
            "ignore_eos": True,
            "stream": True,
            "messages": [{"role": "user", "content": "x " * 400}],
        }
        seen: list[dict[str, float | None]] = []
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=body, timeout=30
        ) as answer:
            for i, _ in enumerate(answer.iter_raw()):
                if i % 10 == 0:
                    seen.append(_mirrored(server.url))
                if seen and seen[-1]["kvgate_engine_running_requests"] == 1:
                    break
        busy = seen[-1]
        assert busy["kvgate_engine_running_requests"] == 1, seen
        assert busy["kvgate_engine_waiting_requests"] == 0
        usage = busy["kvgate_engine_kv_cache_usage_ratio"]
        assert usage is not None and 0 < usage < 1
        deadline = time.monotonic() + 5
        while _mirrored(server.url)["kvgate_engine_running_requests"] != 0:  # cancelled
            assert time.monotonic() < deadline
            time.sleep(0.05)
