"""The admin API (kvgate/fleet_admin.py) on a served gateway over simulated engines: endpoints,
drain and undrain, the effective config with its secrets redacted, and every bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.admin_listener import AdminListener
from kvgate.config import parse_config
from kvgate.fleet_admin import REDACTED, redacted_config
from kvgate.hot_reload import ReloadableGateway
from kvgate.sim import EngineOptions, SimFleet
from tests.metrics_text import sample_value
from tests.observability.serving import ADMIN_KEY, ADMIN_SECRET, KEY, SECRET, chat, digest
from tests.servers import ServerThread

UPSTREAM_KEY = "sk-upstream-9f2e"
SALT_SECRET = "salt-secret-41d0"
RESPONSE_ID_SECRET = "response-id-secret-77c2"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    """Two engines at a realistic pace (about 15 ms a token)."""
    options = EngineOptions(models=["sim-model"], profile="realistic")
    with SimFleet.in_thread(engines=2, options=options) as engines:
        yield engines


def config_dict(urls: list[str], policy: str = "round_robin", **top: Any) -> dict[str, Any]:
    """Tenant `ops` (KEY), an admin key, a pool `sim` over `urls` (round robin unless
    `policy` says otherwise) whose first endpoint carries an upstream API key."""
    endpoints: list[dict[str, Any]] = [{"url": u} for u in urls]
    endpoints[0]["api_key"] = UPSTREAM_KEY
    return {
        "server": {"access_log": False, **top.pop("server", {})},
        "auth": {
            "admin_keys": [{"id": "root-1", "sha256": digest(ADMIN_SECRET)}],
            "cache_salt_secret": SALT_SECRET,
            "response_id_secret": RESPONSE_ID_SECRET,
            "tenants": [{"name": "ops", "keys": [{"id": "ops-1", "sha256": digest(SECRET)}]}],
        },
        "pools": [
            {
                "name": "sim",
                "models": ["sim-model"],
                "policy": policy,
                "endpoints": endpoints,
            }
        ],
        **top,
    }


def write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def served(tmp_path: Path, fleet: SimFleet) -> Iterator[tuple[ReloadableGateway, str]]:
    gateway = ReloadableGateway(write(tmp_path / "gw.yaml", config_dict(fleet.urls)))
    with ServerThread(gateway) as server:
        yield gateway, server.url


def endpoints(base: str) -> dict[str, dict[str, Any]]:
    answer = httpx.get(base + "/admin/endpoints", headers=ADMIN, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.json()["object"] == "list"
    return {e["name"]: e for e in answer.json()["data"]}


def received(fleet: SimFleet) -> int:
    return sum(e.stats()["requests_received"] for e in fleet.engines)


def test_endpoints_show_state_telemetry_breaker_in_flight_and_index(tmp_path, fleet):
    gateway = ReloadableGateway(
        write(tmp_path / "gw.yaml", config_dict(fleet.urls, policy="kvgate"))
    )
    with ServerThread(gateway) as server:
        served_by = chat(server.url, "a prompt of many blocks " * 40).headers["x-kvgate-endpoint"]
        listed = endpoints(server.url)
    assert listed[served_by]["prefix_index"]["blocks"] >= 10  # recorded at the decision
    assert list(listed) == ["sim-0", "sim-1"]
    for name, url in zip(listed, fleet.urls, strict=True):
        endpoint = listed[name]
        assert (endpoint["pool"], endpoint["url"], endpoint["engine"]) == ("sim", url, "vllm")
        assert endpoint["models"] == ["sim-model"]
        assert (endpoint["state"], endpoint["healthy"], endpoint["drained"]) == (
            "serving",
            True,
            False,
        )
        assert endpoint["in_flight"] == 0 and endpoint["peer_in_flight"] == 0
        telemetry = endpoint["telemetry"]
        assert set(telemetry) == {"running", "waiting", "kv_usage", "age_seconds", "stale"}
        assert telemetry["age_seconds"] >= 0 and telemetry["stale"] is False
        assert endpoint["breaker"] == {
            "state": "closed",
            "consecutive_failures": 0,
            "ejections": 0,
            "open_seconds_left": 0.0,
            "held_seconds_left": 0.0,
        }
        index = endpoint["prefix_index"]
        assert index["mode"] == "approximate"
        assert index["capacity"] >= index["blocks"] >= 0


def test_a_drained_endpoint_gets_no_new_request_and_its_stream_finishes(served, fleet, caplog):
    caplog.set_level("WARNING", logger="kvgate")
    _, base = served
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={
            "model": "sim-model",
            "max_tokens": 200,
            "stream": True,
            "messages": [{"role": "user", "content": "a long story"}],
        },
        timeout=30,
    ) as stream:
        busy = stream.headers["x-kvgate-endpoint"]
        other = "sim-1" if busy == "sim-0" else "sim-0"
        drained = httpx.post(f"{base}/admin/endpoints/{busy}/drain", headers=ADMIN, timeout=10)
        assert drained.status_code == 200
        assert (drained.json()["name"], drained.json()["drained"]) == (busy, True)
        assert drained.json()["state"] == "drained"
        assert drained.json()["in_flight"] == 1
        assert f"endpoint {busy} drained by admin key root-1" in caplog.text  # who did it
        engine = fleet.engines[int(busy[-1])]
        before = engine.stats()["requests_received"]
        assert {chat(base).headers["x-kvgate-endpoint"] for _ in range(4)} == {other}
        assert engine.stats()["requests_received"] == before
        body = b"".join(stream.iter_bytes())
    assert body.rstrip().endswith(b"data: [DONE]")
    listed = endpoints(base)
    assert (listed[busy]["drained"], listed[busy]["in_flight"]) == (True, 0)
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert sample_value(metrics, "kvgate_endpoint_drained", endpoint=busy) == 1
    assert sample_value(metrics, "kvgate_endpoint_drained", endpoint=other) == 0
    undrained = httpx.post(f"{base}/admin/endpoints/{busy}/undrain", headers=ADMIN, timeout=10)
    assert (undrained.status_code, undrained.json()["state"]) == (200, "serving")
    assert {chat(base).headers["x-kvgate-endpoint"] for _ in range(4)} == {"sim-0", "sim-1"}


def test_draining_every_endpoint_answers_503(served):
    _, base = served
    for name in ("sim-0", "sim-1"):
        httpx.post(f"{base}/admin/endpoints/{name}/drain", headers=ADMIN, timeout=10)
    answer = chat(base)
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "no_healthy_endpoint"
    ready = httpx.get(f"{base}/readyz", timeout=10)  # nothing to serve: out of rotation
    assert ready.status_code == 503
    assert ready.json()["pools_without_healthy_endpoint"] == ["sim"]
    httpx.post(f"{base}/admin/endpoints/sim-1/undrain", headers=ADMIN, timeout=10)
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200


BAD_INPUTS = [
    # (method, path, headers, status, code)
    ("GET", "/admin/endpoints", {}, 401, None),
    ("GET", "/admin/endpoints", {"authorization": "Bearer root-1.wrong-secret"}, 401, None),
    ("GET", "/admin/endpoints", {"authorization": f"Bearer {KEY}"}, 403, None),
    ("POST", "/admin/endpoints/sim-0/drain", {}, 401, None),
    ("POST", "/admin/endpoints/sim-0/drain", {"authorization": f"Bearer {KEY}"}, 403, None),
    ("GET", "/admin/config", {"authorization": f"Bearer {KEY}"}, 403, None),
    ("POST", "/admin/endpoints/sim-9/drain", ADMIN, 404, "unknown_endpoint"),
    ("POST", "/admin/endpoints/sim-9/undrain", ADMIN, 404, "unknown_endpoint"),
    ("POST", "/admin/endpoints//drain", ADMIN, 404, "unknown_url"),
    ("POST", "/admin/endpoints/sim-0/explode", ADMIN, 404, "unknown_url"),
    ("POST", "/admin/endpoints/sim-0/drain/now", ADMIN, 404, "unknown_url"),
    ("POST", "/admin/endpoints/sim-0", ADMIN, 404, "unknown_url"),
    ("GET", "/admin/endpoints/sim-0/drain", ADMIN, 405, "method_not_allowed"),
    ("DELETE", "/admin/endpoints/sim-0/undrain", ADMIN, 405, "method_not_allowed"),
    ("POST", "/admin/endpoints", ADMIN, 405, "method_not_allowed"),
    ("PUT", "/admin/config", ADMIN, 405, "method_not_allowed"),
]


def test_every_bad_admin_input_is_refused_reaches_no_engine_and_changes_nothing(served, fleet):
    _, base = served
    before = received(fleet)
    for method, path, headers, status, code in BAD_INPUTS:
        answer = httpx.request(method, base + path, headers=headers, timeout=10)
        assert answer.status_code == status, (method, path, answer.text)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (method, path)
        assert error["type"] == "invalid_request_error"
        if code is not None:
            assert error["code"] == code, (method, path)
    unknown = httpx.post(base + "/admin/endpoints/sim-9/drain", headers=ADMIN, timeout=10)
    assert unknown.json()["error"]["param"] == "name"
    assert received(fleet) == before
    assert [e["drained"] for e in endpoints(base).values()] == [False, False]


def test_admin_config_is_the_effective_config_with_every_secret_redacted(served):
    _, base = served
    answer = httpx.get(base + "/admin/config", headers=ADMIN, timeout=10)
    assert answer.status_code == 200
    secrets = (UPSTREAM_KEY, SALT_SECRET, RESPONSE_ID_SECRET, digest(SECRET), digest(ADMIN_SECRET))
    for secret in (*secrets, SECRET):
        assert secret not in answer.text
    body = answer.json()
    assert body["source"].endswith("gw.yaml")
    config = body["config"]
    auth = config["auth"]
    assert auth["cache_salt_secret"] == auth["response_id_secret"] == REDACTED
    assert auth["admin_keys"] == [{"id": "root-1", "sha256": REDACTED, "revoked": False}]
    assert auth["tenants"][0]["keys"] == [{"id": "ops-1", "sha256": REDACTED, "revoked": False}]
    first, second = config["pools"][0]["endpoints"]
    assert (first["api_key"], second["api_key"]) == (REDACTED, None)
    # Everything else is the effective config, defaults included.
    assert config["server"]["drain_seconds"] == 30.0
    assert config["state"]["key_prefix"] == "kvgate"
    assert config["pools"][0]["policy"] == "round_robin"


def test_redis_passwords_in_urls_are_redacted(fleet):
    config = parse_config(
        config_dict(
            fleet.urls,
            state={
                "backend": "redis",
                "url": "redis://kvgate:hunter2@redis.internal:6379/0?password=hunter3&db=0",
            },
        )
    )
    state = redacted_config(config)["state"]
    assert state["url"] == "redis://kvgate:***@redis.internal:6379/0?password=***&db=0"


@pytest.mark.parametrize("name", ["apikey", "api-key", "auth", "sig", "X-Amz-Signature"])
def test_secret_query_parameters_of_endpoint_urls_are_redacted(fleet, name):
    """As the log filter masks them: a query parameter whose name holds a secret word."""
    config = config_dict(fleet.urls)
    config["pools"][0]["endpoints"][1]["url"] = f"{fleet.urls[1]}/x?{name}=s3cr3t&region=eu"
    pools = redacted_config(parse_config(config))["pools"]
    assert pools[0]["endpoints"][1]["url"] == f"{fleet.urls[1]}/x?{name}=***&region=eu"


def test_admin_routes_on_the_admin_listener_only(tmp_path, fleet):
    config = write(tmp_path / "gw.yaml", config_dict(fleet.urls, server={"admin_port": 0}))
    gateway = ReloadableGateway(config)
    admin = AdminListener(gateway.admin_routes, gateway.render_metrics)
    with ServerThread(gateway) as public, ServerThread(admin, lifespan="off") as listener:
        assert httpx.get(public.url + "/admin/endpoints", headers=ADMIN).status_code == 404
        drained = httpx.post(listener.url + "/admin/endpoints/sim-1/drain", headers=ADMIN)
        assert drained.json()["drained"] is True
        assert {chat(public.url).headers["x-kvgate-endpoint"] for _ in range(3)} == {"sim-0"}
        assert httpx.get(listener.url + "/admin/endpoints").status_code == 401
