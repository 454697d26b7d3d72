"""Client headers cannot change tenant or priority, and a client's `cache_salt` never reaches
an engine for an isolated tenant: the gateway's per-tenant salt does."""

from __future__ import annotations

import httpx
import orjson
import pytest

from kvgate.chain.tenants import cache_salt_for
from kvgate.ingress import request_context
from tests.chain.helpers import chat, make_key, tenant
from tests.conftest import gateway_config

GOLD, GOLD_ENTRY = make_key("gold-1")
BRONZE, BRONZE_ENTRY = make_key("bronze-1")
OPEN, OPEN_ENTRY = make_key("open-1")
SECRET = "salt-secret-for-tests"


def _config(url: str) -> dict:
    return gateway_config(
        [url],
        pool={"models": ["m1"]},
        auth={
            "cache_salt_secret": SECRET,
            "tenants": [
                tenant("gold", "gold", [GOLD_ENTRY]),
                tenant("bronze", "bronze", [BRONZE_ENTRY]),
                tenant("open", "silver", [OPEN_ENTRY], cache_isolation="shared"),
            ],
            "admin_keys": [],
        },
        classification={
            "rules": [
                {
                    "name": "wants-interactive",
                    "when": {"headers": {"x-app": "chat"}},
                    "then": {"class": "interactive"},
                }
            ]
        },
    )


INJECTED = {
    "x-kvgate-tenant": "gold",
    "x-kvgate-priority": "0",
    "x-kvgate-tier": "gold",
    "x-tenant": "gold",
    "x-priority": "0",
}


def test_client_cache_salt_is_overwritten_and_headers_do_not_travel(upstream, start_gateway):
    engine, up = upstream
    _, server = start_gateway(_config(up.url))
    response = chat(server.url, BRONZE, headers=INJECTED, cache_salt="steal-gold-cache")
    assert response.status_code == 200
    received = engine.inference_requests[-1]
    assert received.body["cache_salt"] == cache_salt_for("bronze", SECRET)
    assert received.body["cache_salt"] != cache_salt_for("gold", SECRET)
    assert not any(name.startswith("x-kvgate-") for name in received.headers)
    assert received.body["messages"] == [{"role": "user", "content": "hi"}]


def test_a_tenants_body_reaches_the_engine_as_sent_plus_its_salt(upstream, start_gateway):
    """The salt is added before the body's closing brace, not by serialising the body again:
    the client's bytes (its spacing, a 97-bit integer JSON parsers turn into a float) reach
    the engine unchanged, plus the salt. A client's own `cache_salt` is replaced in a body
    serialised again, once."""
    engine, up = upstream
    _, server = start_gateway(_config(up.url))
    sent = (
        b'{ "model" : "m1", "seed": 123456789012345678901234567890,\n'
        b'  "messages": [{"role": "user", "content": "hi"}] }\n'
    )
    headers = {"authorization": f"Bearer {BRONZE}", "content-type": "application/json"}
    assert httpx.post(server.url + "/v1/chat/completions", content=sent, headers=headers).is_success
    salt = cache_salt_for("bronze", SECRET)
    assert engine.inference_requests[-1].raw == sent.rstrip()[:-1] + (
        b',"cache_salt":"%s"}' % salt.encode()
    )
    own = b'{"model": "m1", "cache_salt": "mine", "messages": [{"role": "user", "content": "hi"}]}'
    assert httpx.post(server.url + "/v1/chat/completions", content=own, headers=headers).is_success
    assert orjson.loads(engine.inference_requests[-1].raw)["cache_salt"] == salt


def _config_on(url: str, engine_kind: str) -> dict:
    config = _config(url)
    config["pools"][0]["engine"] = engine_kind
    return config


@pytest.mark.parametrize(
    ("engine_kind", "sent", "received"),
    [
        # vLLM: lower runs first; read as pydantic's lax int reads it
        (
            "vllm",
            [-100, 5, 0, -5.0, "-5", " -7", -0.5, "x", True],
            [0, 5, 0, 0, 0, 0, 0, "x", True],
        ),
        # SGLang: higher runs first (its default order)
        ("sglang", [1000, "3", 2.0, -5, 0, True, False], [0, 0, 0, -5, 0, 0, False]),
    ],
)
def test_a_tenant_cannot_put_its_requests_ahead_with_the_engines_priority(
    upstream, start_gateway, engine_kind, sent, received
):
    """The engine's `priority` is the client's to lower, not to raise above a request that
    sets none: a value the engine would read as more urgent than 0 (vLLM: below; SGLang:
    above; as a whole float or a numeric string too) is sent as 0. An open gateway has no
    tenants to keep apart and passes it on."""
    engine, up = upstream
    _, server = start_gateway(_config_on(up.url, engine_kind))
    for given in sent:
        assert chat(server.url, BRONZE, priority=given).status_code == 200
    assert [r.body["priority"] for r in engine.inference_requests] == received
    _, open_server = start_gateway(gateway_config([up.url], pool={"models": ["m1"]}))
    chat(open_server.url, None, priority=-100)
    assert engine.inference_requests[-1].body["priority"] == -100


def test_salts_differ_per_tenant_and_a_shared_tenants_own_salts_stay_in_its_namespace(
    upstream, start_gateway
):
    """A shared tenant may salt its requests (to keep its own users apart), but the salt that
    reaches the engine is one of its own: sending the gold tenant's salt (derivable from its
    name without `cache_salt_secret`) does not read the gold tenant's cache."""
    engine, up = upstream
    _, server = start_gateway(_config(up.url))
    chat(server.url, GOLD)
    chat(server.url, BRONZE)
    chat(server.url, OPEN)
    for given in ("client-choice", "client-choice", "other", cache_salt_for("gold", SECRET)):
        chat(server.url, OPEN, cache_salt=given)
    gold, bronze, unsalted, choice, again, other, stolen = [
        r.body.get("cache_salt") for r in engine.inference_requests
    ]
    assert gold != bronze and gold and bronze
    assert unsalted is None  # no salt given: the shared cache
    assert choice == again and len({choice, other, stolen, gold, "client-choice"}) == 5


def test_headers_cannot_change_tenant_or_raise_priority(upstream, start_gateway):
    _, up = upstream
    app, server = start_gateway(_config(up.url))

    def explain(key: str, headers: dict[str, str]) -> dict:
        """Classify as the chain does: the tenant comes from the key, never from headers."""
        raw = [(k.encode(), v.encode()) for k, v in headers.items()]
        payload = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        ctx = request_context("chat", payload, headers=raw)
        tenant_ = app.tenants.keys[key.partition(".")[0]].tenant
        return app.classifier.classify(ctx, tenant_).explain()

    bronze = explain(BRONZE, {**INJECTED, "x-app": "chat"})
    assert bronze["tier"] == "bronze"
    assert bronze["class"] == "standard" and bronze["capped_by_tier"] is True
    gold = explain(GOLD, {"x-app": "chat"})
    assert gold["class"] == "interactive"
    assert chat(server.url, BRONZE, headers=INJECTED).status_code == 200


def test_admin_explain_reports_rule_and_tenant(upstream, start_gateway):
    _, up = upstream
    admin, admin_entry = make_key("ops-1")
    config = _config(up.url)
    config["auth"]["admin_keys"] = [admin_entry]
    _, server = start_gateway(config)
    response = httpx.post(
        server.url + "/admin/explain/v1/chat/completions?tenant=gold",
        headers={
            "authorization": f"Bearer {admin}",
            "x-app": "chat",
            "x-kvgate-workflow-id": "wf-9",
            "x-kvgate-workflow-step": "3/5",
        },
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 200
    body = response.json()
    assert body["tenant"] == "gold" and body["intent"]["rule"] == "wants-interactive"
    assert body["intent"]["workflow"] == {"id": "wf-9", "step": 3, "total": 5}
    assert body["priority"] == 0
    assert body["model_allowed"] is True
    # This gateway serves no anonymous request: an explanation must name its tenant.
    unnamed = httpx.post(
        server.url + "/admin/explain/v1/chat/completions",
        headers={"authorization": f"Bearer {admin}"},
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert unnamed.status_code == 400
    assert unnamed.json()["error"]["param"] == "tenant"
