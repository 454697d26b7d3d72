"""Auth: every way a key can be wrong is a 401 that reaches no engine; 403 for models and admin
keys; unknown ids and wrong secrets are answered alike; no secret is ever logged."""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time

import httpx
import openai
import pytest

from kvgate.chain.auth import Authenticator
from kvgate.chain.settings import AuthConfig
from kvgate.chain.tenants import TenantDirectory
from kvgate.cli import main
from kvgate.errors import AuthenticationFailed
from tests.chain.helpers import chat, make_key, tenant
from tests.conftest import gateway_config
from tests.sdk_clients import sdk_client

GOOD, GOOD_ENTRY = make_key("acme-1")
REVOKED, REVOKED_ENTRY = make_key("acme-old")
ADMIN, ADMIN_ENTRY = make_key("ops-1")
LIMITED, LIMITED_ENTRY = make_key("narrow-1")
SECRETS = [k.partition(".")[2] for k in (GOOD, REVOKED, ADMIN, LIMITED)]


def _wrong_secret() -> str:
    """GOOD's secret with its last character changed (to a different one, always)."""
    secret = GOOD.partition(".")[2]
    return secret[:-1] + ("B" if secret.endswith("A") else "A")


def _auth() -> dict:
    return {
        "tenants": [
            tenant("acme", "gold", [GOOD_ENTRY, {**REVOKED_ENTRY, "revoked": True}]),
            tenant("narrow", "bronze", [LIMITED_ENTRY], models=["other-*"]),
        ],
        "admin_keys": [ADMIN_ENTRY],
    }


@pytest.fixture
def keyed(upstream, start_gateway):
    _, server = start_gateway(
        gateway_config([upstream[1].url], auth=_auth(), pool={"models": ["m1"]})
    )
    return server


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        (None, "missing_api_key"),
        ("Basic dXNlcjpwYXNz", "invalid_api_key"),
        ("Bearer", "invalid_api_key"),
        ("Bearer no-dot-here", "invalid_api_key"),
        ("Bearer bad id!.secret", "invalid_api_key"),
        ("Bearer nobody-1." + GOOD.partition(".")[2], "invalid_api_key"),
        ("Bearer acme-1.wrong-secret", "invalid_api_key"),
        ("Bearer " + REVOKED, "revoked_api_key"),
    ],
)
def test_bad_keys_are_401_and_reach_no_engine(upstream, keyed, authorization, code):
    engine, _ = upstream
    headers = {"authorization": authorization} if authorization else {}
    response = chat(keyed.url, None, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == code
    assert engine.inference_requests == []


def test_unknown_id_and_wrong_secret_get_the_same_answer(keyed):
    unknown = chat(keyed.url, "nobody-1." + GOOD.partition(".")[2]).json()
    wrong = chat(keyed.url, "acme-1." + _wrong_secret()).json()
    assert unknown == wrong


def test_good_key_works_with_the_sdk_and_bearer_is_not_forwarded(upstream, keyed):
    engine, _ = upstream
    client = sdk_client(base_url=keyed.url + "/v1", api_key=GOOD, max_retries=0)
    answer = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content == "hello"
    assert "authorization" not in engine.inference_requests[0].headers
    wrong = sdk_client(base_url=keyed.url + "/v1", api_key="acme-1.nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert len(engine.inference_requests) == 1


def test_model_not_allowed_and_admin_key_for_inference_are_403(upstream, keyed):
    engine, _ = upstream
    denied = chat(keyed.url, LIMITED)
    assert denied.status_code == 403
    assert denied.json()["error"]["code"] == "model_not_allowed"
    assert denied.json()["error"]["param"] == "model"
    admin = chat(keyed.url, ADMIN)
    assert admin.status_code == 403
    assert engine.inference_requests == []


def test_admin_routes_need_an_admin_key(keyed):
    url = keyed.url + "/admin/admission"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"authorization": f"Bearer {GOOD}"}).status_code == 403
    state = httpx.get(url, headers={"authorization": f"Bearer {ADMIN}"})
    assert state.status_code == 200
    assert state.json()["open_reservations"] == {"requests": 0, "tokens": 0}


def test_no_secret_in_logs(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    for key in (GOOD, REVOKED, ADMIN, LIMITED, "acme-1.wrong-secret-value-xyz"):
        chat(keyed.url, key)
    text = caplog.text
    assert "acme-1" in text or "acme-old" in text  # key ids are logged, for tracing
    for secret in [*SECRETS, "wrong-secret-value-xyz"]:
        assert secret not in text


def test_unknown_id_and_wrong_secret_take_the_same_time():
    """Statistical and generous: the medians of many timed checks differ by less than 2x."""
    directory = TenantDirectory(AuthConfig.model_validate(_auth()), {})
    authenticator = Authenticator(directory)
    secret = GOOD.partition(".")[2]
    cases = {
        "unknown": [(b"authorization", f"Bearer nobody-9.{secret}".encode())],
        "wrong": [(b"authorization", f"Bearer acme-1.{_wrong_secret()}".encode())],
    }
    timings: dict[str, list[float]] = {"unknown": [], "wrong": []}
    for _ in range(3000):
        for name, headers in cases.items():
            start = time.perf_counter_ns()
            with pytest.raises(AuthenticationFailed):
                authenticator.verify(headers)
            timings[name].append(time.perf_counter_ns() - start)
    unknown, wrong = (statistics.median(timings[n]) for n in ("unknown", "wrong"))
    assert 0.5 < unknown / wrong < 2.0


def test_keys_new_prints_a_key_whose_hash_is_the_config_line(capsys):
    assert main(["keys", "new", "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    key = next(
        line.strip()
        for line in out.splitlines()
        if "." in line and "acme-" in line and "sha256" not in line
    )
    key_id, _, secret = key.partition(".")
    assert key_id.startswith("acme-") and len(secret) >= 43
    assert hashlib.sha256(secret.encode()).hexdigest() in out
    directory = TenantDirectory(
        AuthConfig.model_validate(
            {
                "tenants": [
                    tenant(
                        "acme",
                        "gold",
                        [{"id": key_id, "sha256": hashlib.sha256(secret.encode()).hexdigest()}],
                    )
                ]
            }
        ),
        {},
    )
    record = Authenticator(directory).verify([(b"authorization", f"Bearer {key}".encode())])
    assert record.tenant is not None and record.tenant.name == "acme"


def test_missing_auth_warns_loudly_and_auth_none_does_not(upstream, start_gateway, caplog):
    caplog.set_level(logging.WARNING, logger="kvgate")
    start_gateway(gateway_config([upstream[1].url]))
    assert "NO AUTHENTICATION" in caplog.text
    caplog.clear()
    _, server = start_gateway(gateway_config([upstream[1].url], auth="none"))
    assert "NO AUTHENTICATION" not in caplog.text
    assert chat(server.url, "anything-at-all").status_code == 200


@pytest.mark.parametrize(
    ("admin_key", "status", "explained"),
    [
        (None, 200, False),  # explain asked without an admin key: answered, not explained
        (ADMIN, 200, True),
        ("ops-1.wrong", 401, False),  # a credential that is sent is checked
        (GOOD, 403, False),  # a tenant key is not an admin key
    ],
)
def test_explain_needs_an_admin_key(upstream, keyed, admin_key, status, explained):
    engine, _ = upstream
    headers = {"x-kvgate-explain": "1"}
    if admin_key is not None:
        headers["x-kvgate-admin-key"] = admin_key
    response = chat(keyed.url, GOOD, headers=headers)
    assert response.status_code == status
    assert ("x-kvgate-route-explain" in response.headers) == explained
    assert len(engine.inference_requests) == (1 if status == 200 else 0)
    if explained:
        assert "x-kvgate-admin-key" not in engine.inference_requests[0].headers


def test_access_log_names_tenant_key_and_endpoint_never_secret_or_prompt(
    upstream, start_gateway, caplog
):
    _, server = start_gateway(
        gateway_config(
            [upstream[1].url], auth=_auth(), pool={"models": ["m1"]}, server={"access_log": True}
        )
    )
    with caplog.at_level(logging.INFO, logger="kvgate.access"):
        response = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=10,
            headers={"authorization": f"Bearer {GOOD}"},
            json={"model": "m1", "messages": [{"role": "user", "content": "my private prompt"}]},
        )
        assert response.status_code == 200
        deadline = time.monotonic() + 5
        while not any(r.name == "kvgate.access" for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    line = next(r.getMessage() for r in caplog.records if r.name == "kvgate.access")
    record = json.loads(line)
    assert record["request_id"] == response.headers["x-request-id"]
    assert (record["tenant"], record["key_id"], record["status"]) == ("acme", "acme-1", 200)
    assert record["endpoint"] == "default-0" and record["attempts"] == 1
    assert GOOD.partition(".")[2] not in line and "private prompt" not in line
