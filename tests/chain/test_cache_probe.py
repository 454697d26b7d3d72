"""Cross-tenant cache probing, on simulated engines: tenant B sending tenant A's cached prompt
sees a miss (its `cached_tokens` is 0, and routing predicts the same time to first token on
every endpoint: none holds its prefix), while A's own repeats hit. The gateway sets each
tenant's `cache_salt`; the engines hash it into their block hashes, as vLLM does."""

from __future__ import annotations

import re
from collections.abc import Iterator

import openai
import pytest

from kvgate.sim import EngineOptions, SimFleet
from tests.chain.helpers import make_key, tenant
from tests.conftest import gateway_config
from tests.sdk_clients import sdk_client

A_KEY, A_ENTRY = make_key("alpha-1")
B_KEY, B_ENTRY = make_key("beta-1")
ADMIN, ADMIN_ENTRY = make_key("ops-1")
# Long enough to fill many KV blocks (the simulator's blocks are 16 tokens).
PROMPT = "The quarterly figures of the secret merger, line by line: " + " ".join(
    f"item {i} is worth {i * 37 % 101} units." for i in range(60)
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as sim:
        yield sim


def _ask(client: openai.OpenAI) -> tuple[int, list[float]]:
    """(cached prompt tokens, the predicted_ttft score of every candidate endpoint: equal on
    idle endpoints unless one holds part of the prompt)."""
    raw = client.chat.completions.with_raw_response.create(
        model="sim-model",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        extra_headers={"x-kvgate-explain": "1", "x-kvgate-admin-key": ADMIN},
    )
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    explain = raw.headers["x-kvgate-route-explain"]
    scores = [float(s) for s in re.findall(r"predicted_ttft=([0-9.]+)", explain)]
    assert len(scores) == 2, explain
    return answer.usage.prompt_tokens_details.cached_tokens or 0, scores


def test_tenant_b_cannot_see_tenant_a_cached_prompt(fleet, start_gateway):
    _, server = start_gateway(
        gateway_config(
            list(fleet.urls),
            pool={"models": ["sim-model"]},
            auth={
                "tenants": [
                    tenant("alpha", "gold", [A_ENTRY]),
                    tenant("beta", "gold", [B_ENTRY]),
                ],
                "admin_keys": [ADMIN_ENTRY],
            },
        )
    )
    alpha = sdk_client(base_url=server.url + "/v1", api_key=A_KEY, max_retries=0)
    beta = sdk_client(base_url=server.url + "/v1", api_key=B_KEY, max_retries=0)
    first_cached, first_scores = _ask(alpha)
    assert first_cached == 0 and len(set(first_scores)) == 1
    repeat_cached, repeat_scores = _ask(alpha)
    assert repeat_cached > 0 and len(set(repeat_scores)) == 2  # same tenant: a hit, seen
    probe_cached, probe_scores = _ask(beta)
    assert probe_cached == 0 and len(set(probe_scores)) == 1  # other tenant: a miss everywhere
    again_cached, _ = _ask(beta)
    assert again_cached > 0  # B's own repeat hits its own blocks
