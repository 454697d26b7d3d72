"""Routing decisions per endpoint and policy, read from /metrics after known traffic."""

from __future__ import annotations

import httpx

from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.sdk_clients import sdk_client


def test_each_choice_is_counted_per_endpoint_and_policy(start_gateway):
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        _, server = start_gateway(gateway_config(fleet.urls, pool={"policy": "round_robin"}))
        client = sdk_client(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for i in range(6):
            client.chat.completions.create(
                model="sim-model", max_tokens=2, messages=[{"role": "user", "content": f"{i}"}]
            )
        text = httpx.get(server.url + "/metrics", timeout=5).text
    for endpoint in ("default-0", "default-1"):
        decisions = sample_value(
            text, "kvgate_routing_decisions_total", endpoint=endpoint, policy="round_robin"
        )
        assert decisions == 3, (endpoint, decisions)
