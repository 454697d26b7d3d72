"""Three tenants of different tiers and quotas, end to end: OpenAI SDK → gateway → simulated
vLLM engines, checked with the engines' own /sim/stats."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvgate.chain.tenants import cache_salt_for
from kvgate.sim import EngineOptions, SimFleet
from tests.chain.helpers import IDLE, admission_state, make_key, tenant
from tests.conftest import gateway_config
from tests.sdk_clients import sdk_client

GOLD, GOLD_ENTRY = make_key("acme-1")
SILVER, SILVER_ENTRY = make_key("globex-1")
BRONZE, BRONZE_ENTRY = make_key("initech-1")
MESSAGES = [{"role": "user", "content": "Tell me about KV caches."}]


@pytest.fixture(scope="module")
def fleet():
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as sim:
        yield sim


@pytest.fixture
def gateway(fleet, start_gateway):
    config = gateway_config(
        list(fleet.urls),
        pool={"models": ["sim-model"]},
        auth={
            "cache_salt_secret": "e2e-secret",
            "tenants": [
                # The shape, as written.
                {
                    "name": "acme",
                    "tier": "gold",
                    "keys": [GOLD_ENTRY],
                    "limits": {
                        "requests_per_minute": 600,
                        "tokens_per_minute": 200000,
                        "max_concurrent": 8,
                    },
                },
                tenant(
                    "globex",
                    "silver",
                    [SILVER_ENTRY],
                    limits={
                        "requests_per_minute": 60,
                        "tokens_per_minute": 20000,
                        "max_concurrent": 2,
                    },
                    models=["sim-*"],
                ),
                tenant(
                    "initech",
                    "bronze",
                    [BRONZE_ENTRY],
                    limits={
                        "requests_per_minute": 3,
                        "tokens_per_minute": 5000,
                        "max_concurrent": 1,
                        "max_queued": 2,
                    },
                ),
            ],
        },
    )
    return start_gateway(config)


def _client(server, key: str) -> openai.OpenAI:
    return sdk_client(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_three_tenants_with_the_openai_sdk(fleet, gateway):
    app, server = gateway
    for key, name in ((GOLD, "acme"), (SILVER, "globex"), (BRONZE, "initech")):
        client = _client(server, key)
        stream = client.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,
            stream=True,
            max_tokens=16,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": "mine"},
            extra_headers={"x-kvgate-tenant": "acme", "x-kvgate-priority": "0"},
        )
        chunks = list(stream)
        assert len(chunks) > 2 and chunks[-1].usage is not None
        answer = client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=8)
        assert answer.choices[0].message.content
        salts = {
            e.stats()["last_request"]["body"].get("cache_salt")
            for e in fleet.engines
            if e.stats()["last_request"]
        }
        assert cache_salt_for(name, "e2e-secret") in salts and "mine" not in salts
    # bronze: 3 requests per minute, two already used
    bronze = _client(server, BRONZE)
    bronze.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=8)
    with pytest.raises(openai.RateLimitError) as limited:
        bronze.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=8)
    assert limited.value.response.headers["retry-after"]
    assert limited.value.body["code"] == "rate_limit_exceeded"
    assert limited.value.body["type"] == "requests"
    with pytest.raises(openai.AuthenticationError):
        _client(server, "acme-1.not-the-secret").chat.completions.create(
            model="sim-model", messages=MESSAGES
        )
    with pytest.raises(openai.PermissionDeniedError):
        _client(server, SILVER).chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        _client(server, GOLD).chat.completions.create(model="other", messages=MESSAGES)
    assert admission_state(app, server) == IDLE
    metrics = httpx.get(server.url + "/metrics").text
    assert (
        'kvgate_quota_rejections_total{limit="requests_per_minute",tenant="initech"} 1.0' in metrics
    )
