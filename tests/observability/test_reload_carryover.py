"""What a reload keeps (kvgate/reload_carryover.py): the prefix index, breakers, drained flags
and quotas of the endpoints and tenants that remain; what it drops: those that are gone."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvgate.hot_reload import ReloadableGateway
from kvgate.sim import EngineOptions, SimFleet
from kvgate.sim.faults import Fault
from tests.metrics_text import sample_value
from tests.observability.serving import KEY, chat
from tests.observability.test_admin_api import ADMIN, config_dict, endpoints, write
from tests.servers import ServerThread

PROMPTS = [f"Conversation {i}: " + f"the shared history of session {i}, " * 30 for i in range(4)]


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    options = EngineOptions(models=["sim-model"], profile="fast")
    with SimFleet.in_thread(engines=3, options=options) as engines:
        yield engines


def reload(base: str) -> None:
    answer = httpx.post(base + "/admin/reload", headers=ADMIN, timeout=20)
    assert (answer.status_code, answer.json()) == (200, {"status": "reloaded"}), answer.text


def holder_url(base: str, content: str) -> str:
    answer = chat(base, content)
    assert answer.status_code == 200, answer.text
    return endpoints(base)[answer.headers["x-kvgate-endpoint"]]["url"]


def test_the_prefix_index_survives_a_reload_that_renames_every_endpoint(tmp_path, fleet):
    first, second, newcomer = fleet.urls
    path = write(tmp_path / "gw.yaml", config_dict([first, second], policy="kvgate"))
    gateway = ReloadableGateway(path)
    with ServerThread(gateway) as server:
        holders = [holder_url(server.url, prompt) for prompt in PROMPTS]
        # The newcomer goes first: the endpoints that remain are renamed sim-1 and sim-2.
        write(path, config_dict([newcomer, first, second], policy="kvgate"))
        reload(server.url)
        listed = endpoints(server.url)
        by_url = {e["url"]: e for e in listed.values()}
        assert by_url[newcomer]["name"] == "sim-0"
        # The routing decisions made so far moved to the endpoints' new names.
        text = httpx.get(server.url + "/metrics", timeout=5).text
        decisions = {
            name: sample_value(
                text, "kvgate_routing_decisions_total", endpoint=name, policy="kvgate"
            )
            for name in ("sim-0", "sim-1", "sim-2")
        }
        assert decisions["sim-0"] is None
        assert (decisions["sim-1"] or 0) + (decisions["sim-2"] or 0) == len(PROMPTS)
        assert by_url[newcomer]["prefix_index"]["blocks"] == 0
        for url in set(holders):
            assert by_url[url]["prefix_index"]["blocks"] > 0
        # Each prompt still goes to the engine that holds it, not to the empty newcomer.
        assert [holder_url(server.url, prompt) for prompt in PROMPTS] == holders


def test_the_replaced_app_is_freed_once_it_has_shut_down(tmp_path, fleet):
    """A reload frees what the old config built (its prefix index can hold millions of
    entries): nothing keeps the replaced app alive, not even until the next reload."""
    path = write(tmp_path / "gw.yaml", config_dict(fleet.urls[:2], policy="kvgate"))
    gateway = ReloadableGateway(path)
    with ServerThread(gateway) as server:
        for prompt in PROMPTS:
            assert chat(server.url, prompt).status_code == 200
        replaced = weakref.ref(gateway.current)
        reload(server.url)
        deadline = time.monotonic() + 10
        while replaced() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replaced() is None
        assert chat(server.url, PROMPTS[0]).status_code == 200


def test_an_open_breaker_stays_open_and_a_drained_endpoint_drained_across_a_reload(tmp_path, fleet):
    first, second, third = fleet.urls
    resilience = {"breaker": {"consecutive_failures": 1, "base_ejection": 60}}
    path = write(tmp_path / "gw.yaml", config_dict([first, second], resilience=resilience))
    gateway = ReloadableGateway(path)
    with ServerThread(gateway) as server:
        failing = fleet.engines[0]
        failing.set_fault(Fault(mode="http_error", status=503))
        for _ in range(2):  # round robin: one of them reaches the failing engine
            assert chat(server.url).status_code == 200  # retried on the other engine
        assert endpoints(server.url)["sim-0"]["breaker"]["state"] == "open"
        drained = httpx.post(server.url + "/admin/endpoints/sim-1/drain", headers=ADMIN)
        assert drained.status_code == 200
        failing.clear_fault()
        write(path, config_dict([third, first, second], resilience=resilience))
        reload(server.url)
        by_url = {e["url"]: e for e in endpoints(server.url).values()}
        assert by_url[first]["name"] == "sim-1"
        assert by_url[first]["breaker"]["state"] == "open"
        assert by_url[first]["breaker"]["ejections"] == 1
        assert by_url[first]["breaker"]["open_seconds_left"] > 30
        assert (by_url[second]["drained"], by_url[second]["state"]) == (True, "drained")
        assert by_url[third]["breaker"]["state"] == "closed"
        sent = failing.stats()["requests_received"]
        assert {chat(server.url).headers["x-kvgate-endpoint"] for _ in range(4)} == {"sim-0"}
        assert failing.stats()["requests_received"] == sent
        # The removed endpoint is gone: a reload without it lists only those configured.
        write(path, config_dict([third], resilience=resilience))
        reload(server.url)
        assert [e["url"] for e in endpoints(server.url).values()] == [third]


def test_a_named_endpoint_keeps_its_name_and_metric_series_across_a_reload(tmp_path, fleet):
    """Names of the operator's (`endpoints[].name`) do not move when an endpoint before them is
    removed: the header, the admin routes and the metrics' `endpoint` label keep meaning one
    engine."""
    first, second, _ = fleet.urls
    config = config_dict([first, second])
    config["pools"][0]["endpoints"][1]["name"] = "node-b:8000"
    path = write(tmp_path / "gw.yaml", config)
    gateway = ReloadableGateway(path)
    with ServerThread(gateway) as server:
        assert set(endpoints(server.url)) == {"sim-0", "node-b:8000"}
        for _ in range(2):  # round robin: one each
            assert chat(server.url).status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=5).text
        before = sample_value(
            text, "kvgate_routing_decisions_total", endpoint="node-b:8000", policy="round_robin"
        )
        assert before == 1
        config["pools"][0]["endpoints"] = config["pools"][0]["endpoints"][1:]
        write(path, config)
        reload(server.url)
        assert {name: e["url"] for name, e in endpoints(server.url).items()} == {
            "node-b:8000": second
        }
        answer = chat(server.url)
        assert answer.headers["x-kvgate-endpoint"] == "node-b:8000"
        text = httpx.get(server.url + "/metrics", timeout=5).text
        assert (
            sample_value(
                text, "kvgate_routing_decisions_total", endpoint="node-b:8000", policy="round_robin"
            )
            == 2
        )
        drained = httpx.post(server.url + "/admin/endpoints/node-b:8000/drain", headers=ADMIN)
        assert (drained.status_code, drained.json()["state"]) == (200, "drained")


def _tenant_limits(config: dict[str, Any], **limits: int) -> dict[str, Any]:
    config["auth"]["tenants"][0]["limits"] = limits
    return config


def test_a_tenants_used_quota_carries_over_a_reload(tmp_path, fleet):
    path = write(
        tmp_path / "gw.yaml", _tenant_limits(config_dict(fleet.urls), requests_per_minute=2)
    )
    gateway = ReloadableGateway(path)
    with ServerThread(gateway) as server:
        assert [chat(server.url).status_code for _ in range(2)] == [200, 200]
        write(path, _tenant_limits(config_dict(fleet.urls), requests_per_minute=3))
        reload(server.url)
        # Two of the three requests a minute are spent: one more, then 429.
        assert [chat(server.url).status_code for _ in range(2)] == [200, 429]


def test_a_request_in_flight_holds_its_concurrency_place_across_a_reload(tmp_path):
    options = EngineOptions(models=["sim-model"], profile="realistic")
    with SimFleet.in_thread(engines=1, options=options) as slow:
        limits = {"max_concurrent": 1, "max_queued": 0}
        path = write(tmp_path / "gw.yaml", _tenant_limits(config_dict(slow.urls), **limits))
        gateway = ReloadableGateway(path)
        with ServerThread(gateway) as server:
            started, results = threading.Event(), []

            def long_stream() -> None:
                with httpx.stream(
                    "POST",
                    server.url + "/v1/chat/completions",
                    headers={"authorization": f"Bearer {KEY}"},
                    json={
                        "model": "sim-model",
                        "max_tokens": 150,
                        "ignore_eos": True,
                        "stream": True,
                        "messages": [{"role": "user", "content": "a long story"}],
                    },
                    timeout=30,
                ) as stream:
                    started.set()
                    results.append(b"".join(stream.iter_bytes()))

            reader = threading.Thread(target=long_stream)
            reader.start()
            assert started.wait(20)
            reload(server.url)
            refused = chat(server.url)
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert "max_queued" in refused.json()["error"]["message"]
            reader.join(30)
            assert results[0].rstrip().endswith(b"data: [DONE]")
            assert chat(server.url).status_code == 200  # its place was given back
