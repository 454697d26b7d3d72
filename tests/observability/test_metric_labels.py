"""Label sets stay bounded: tenants and models beyond `observability.max_label_values` are
counted as `other`; breaker state is one 0/1 series per endpoint and state."""

from __future__ import annotations

import time

import httpx

from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.observability.serving import digest
from tests.sdk_clients import sdk_client


def test_tenants_beyond_the_cap_are_counted_as_other(start_gateway):
    tenants = [
        {"name": name, "keys": [{"id": f"{name}-1", "sha256": digest(f"{name}-secret")}]}
        for name in ("ops", "dev", "lab")
    ]
    config = gateway_config([], auth={"tenants": tenants})
    config["observability"] = {"max_label_values": 1}
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast")) as fleet:
        config["pools"][0]["endpoints"] = [{"url": u} for u in fleet.urls]
        _, server = start_gateway(config)
        expected = {"ops": 0, "other": 0}
        for name in ("ops", "dev", "lab", "ops"):
            client = sdk_client(
                base_url=server.url + "/v1", api_key=f"{name}-1.{name}-secret", max_retries=0
            )
            usage = client.chat.completions.create(
                model="sim-model",
                max_tokens=3,
                messages=[{"role": "user", "content": f"hello from {name}"}],
            ).usage
            assert usage is not None
            expected["ops" if name == "ops" else "other"] += usage.completion_tokens
        deadline = time.monotonic() + 5
        while True:
            text = httpx.get(server.url + "/metrics", timeout=5).text
            counted = {
                tenant: sample_value(
                    text,
                    "kvgate_completion_tokens_total",
                    tenant=tenant,
                    model="sim-model",
                    pool="default",
                )
                for tenant in expected
            }
            if counted == expected:
                break
            assert time.monotonic() < deadline, (counted, expected)
            time.sleep(0.02)
    # The first configured tenant keeps its label; no other tenant name appears at all.
    assert 'tenant="dev"' not in text and 'tenant="lab"' not in text


def test_breaker_state_is_one_series_per_state(start_gateway):
    fault = {"mode": "http_error", "status": 503}
    with SimFleet.in_thread(engines=1, options=EngineOptions(profile="fast", fault=fault)) as f:
        config = gateway_config(f.urls)
        config["resilience"] = {
            "retries": {"max_attempts": 1},
            "breaker": {"consecutive_failures": 1, "max_ejected_fraction": 1.0},
        }
        _, server = start_gateway(config)

        def states() -> dict[str, float | None]:
            text = httpx.get(server.url + "/metrics", timeout=5).text
            return {
                state: sample_value(text, "kvgate_breaker_state", endpoint="default-0", state=state)
                for state in ("closed", "half_open", "open")
            }

        assert states() == {"closed": 1, "half_open": 0, "open": 0}
        answer = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert answer.status_code >= 500
        assert states() == {"closed": 0, "half_open": 0, "open": 1}
