"""End to end on real sockets: the gateway routes a shared prefix to one simulated engine until
it saturates, then spills; an endpoint whose /metrics stops answering follows the stale policy;
a Responses API conversation resent whole stays with the engine holding it."""

from __future__ import annotations

import gc
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml

from kvgate.sim import EngineOptions, SimFleet
from tests.chain.helpers import make_key, tenant
from tests.conftest import gateway_config
from tests.metrics_text import sample_value
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread

SYSTEM = "You are the support assistant of a bicycle shop; answer briefly and kindly. " * 30


def _chat(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 400,
        "ignore_eos": True,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **extra,
    }


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_shared_prefix_lands_on_one_engine_until_it_saturates_then_spills(start_gateway):
    options = EngineOptions(profile="realistic", speed=1.0, kv_blocks=4000)
    with SimFleet.in_thread(engines=3, options=options) as fleet:
        config = gateway_config(fleet.urls, routing={"scrape_interval": 0.2})
        for endpoint in config["pools"][0]["endpoints"]:
            endpoint["max_inflight"] = 3
        app, server = start_gateway(config)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            streams, chosen = [], []
            try:
                for i in range(5):
                    stream = client.stream(
                        "POST", "/v1/chat/completions", json=_chat(f"Question {i}?")
                    )
                    response = stream.__enter__()
                    streams.append(stream)
                    assert response.status_code == 200
                    chosen.append(response.headers["x-kvgate-endpoint"])
                    chunks = response.iter_raw()
                    while not re.search(rb'"content":"[^"]', next(chunks)):
                        pass  # until the first token: the engine holds the prefix now
                    streams.append(chunks)  # keep the iterator: dropping it closes the stream
            finally:
                for stream in streams:
                    if not hasattr(stream, "__next__"):
                        stream.__exit__(None, None, None)
        assert chosen[0] == chosen[1] == chosen[2]
        assert chosen[3] != chosen[0] and chosen[4] == chosen[3]
        _wait(
            lambda: all(
                e.inflight == 0 and e.decoding == 0 and e.prefill_tokens == 0
                for e in app.fleet.endpoints
            )
        )
        again = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=30,
            json={**_chat("Once more?"), "stream": False, "max_tokens": 2},
        )
        assert again.headers["x-kvgate-endpoint"] in (chosen[0], chosen[3])
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0  # the engine really held the prefix the gateway routed to


class MetricsUpstream:
    """A tiny engine: answers chat requests and serves vLLM metrics (nothing waiting, its
    `kv_usage`) until told not to."""

    def __init__(self) -> None:
        self.metrics_up = True
        self.requests = 0
        self.kv_usage = 0.0
        self.waiting = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        path, status, body = scope["path"], 200, b"{}"
        if path == "/metrics":
            status = 200 if self.metrics_up else 503
            body = (
                b'vllm:num_requests_running{engine="0"} 0\n'
                b'vllm:num_requests_waiting{engine="0"} %d\n'
                b'vllm:kv_cache_usage_perc{engine="0"} %f\n' % (self.waiting, self.kv_usage)
            )
        elif path == "/v1/models":
            body = orjson.dumps({"object": "list", "data": [{"id": "m1", "object": "model"}]})
        elif path == "/v1/chat/completions":
            self.requests += 1
            body = orjson.dumps(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "model": "m1",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "ok"},
                        }
                    ],
                }
            )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("policy", ["local", "exclude"])
def test_endpoint_whose_metrics_stop_answering_follows_the_stale_policy(start_gateway, policy):
    """Scraped every 0.1 s, stale after 2 s: an endpoint goes stale only when its scrapes fail,
    never because a loaded machine ran one cycle of the scraper late (a cycle is the interval
    plus at most the 0.5 s scrape timeout; with 3 intervals, 0.3 s, the answering endpoint went
    stale too and `exclude` left no endpoint at all)."""
    engines = [MetricsUpstream(), MetricsUpstream()]
    with ServerThread(engines[0]) as a, ServerThread(engines[1]) as b:
        routing = {"scrape_interval": 0.1, "stale_after_intervals": 20, "stale_policy": policy}
        app, server = start_gateway(gateway_config([a.url, b.url], routing=routing))
        assert app.config.routing.stale_after > 3 * (0.1 + app.config.routing.scrape_timeout)
        body = {"model": "m1", "messages": [{"role": "user", "content": SYSTEM}]}

        def route() -> str:
            response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
            assert response.status_code == 200, response.text
            return response.headers["x-kvgate-endpoint"]

        home = route()
        assert route() == home
        home_index = [e.name for e in app.fleet.endpoints].index(home)
        engines[home_index].metrics_up = False
        endpoint = app.fleet.endpoints[home_index]
        _wait(lambda: endpoint.stale)
        expected = home if policy == "local" else app.fleet.endpoints[1 - home_index].name
        assert {route() for _ in range(4)} == {expected}
        metrics = httpx.get(server.url + "/metrics").text
        assert f'kvgate_endpoint_telemetry_stale{{endpoint="{home}"}} 1.0' in metrics
        held = sample_value(metrics, "kvgate_prefix_index_memory_bytes")
        assert held == app.routing.index.memory_bytes > 0
        engines[home_index].metrics_up = True
        _wait(lambda: not endpoint.stale)
        assert endpoint.routable


def test_the_prefix_index_tables_are_out_of_the_garbage_collectors_reach(gateway):
    """A full collection walks every entry of a tracked ordered dict; the index's tables are
    made at startup and frozen with the other startup objects, so none is walked."""
    app, _ = gateway
    tables = [blocks._entries for blocks in app.routing.index._blocks.values()]
    assert len(tables) == len(app.fleet.endpoints)
    walked = {id(o) for generation in range(3) for o in gc.get_objects(generation=generation)}
    assert not any(id(table) in walked for table in tables)


@pytest.mark.parametrize("max_kv_usage", [None, 0.9])
def test_a_full_kv_cache_alone_holds_nothing_in_the_gateway(start_gateway, max_kv_usage):
    """An engine whose KV cache is full queues what does not fit, and its waiting count shows
    it; KV use read from a scrape up to an interval old would hold requests in the gateway
    while the engine frees blocks every step. By default it saturates nothing; an operator's
    threshold still holds requests until the reading falls."""
    engine = MetricsUpstream()
    engine.kv_usage = 0.99
    with ServerThread(engine) as up:
        # Readings stay fresh for 10 s: a scrape that a loaded machine delays must not make the
        # endpoint's state unknown (the stale policy would then admit the request).
        routing: dict[str, Any] = {"scrape_interval": 0.1, "stale_after_intervals": 100}
        if max_kv_usage is not None:
            routing["saturation"] = {"max_kv_usage": max_kv_usage}
        app, server = start_gateway(gateway_config([up.url], routing=routing))
        endpoint = app.fleet.endpoints[0]
        _wait(lambda: endpoint.telemetry is not None and endpoint.telemetry.kv_usage > 0.98)
        body = {"model": "m1", "messages": [{"role": "user", "content": "hello"}]}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                httpx.post, server.url + "/v1/chat/completions", json=body, timeout=30
            )
            if max_kv_usage is not None:
                _wait(lambda: len(app.admission.queue) == 1)
                assert engine.requests == 0  # held in the gateway
                engine.kv_usage = 0.5
            assert answer.result().status_code == 200
        assert engine.requests == 1
        waited = sample_value(
            httpx.get(server.url + "/metrics").text,
            "kvgate_admission_wait_seconds_count",
            **{"class": "standard", "result": "admitted"},
        )
        assert waited == (None if max_kv_usage is None else 1.0)
        assert len(app.admission.queue) == 0


def test_a_saturated_home_region_holds_its_tenants_despite_a_fallback_pool_elsewhere(
    start_gateway, tmp_path
):
    """A tenant kept to the EU waits in the gateway when the EU pool is saturated, though the
    policy falls back to a US pool the tenant may not use: the fallback does not count as
    room for it, and nothing reaches the saturated engine until it has room again."""
    key, entry = make_key("globex-1")
    globex = tenant("globex", "silver", [entry], residency=["eu"])
    policy = tmp_path / "spill.yaml"
    policy.write_text(yaml.safe_dump({"name": "spill", "fallback": {"pool": "us"}}))
    eu_engine, us_engine = MetricsUpstream(), MetricsUpstream()
    eu_engine.waiting = 100
    with ServerThread(eu_engine) as eu, ServerThread(us_engine) as us:
        config = gateway_config(
            [],
            pool={
                "name": "eu",
                "models": ["m1"],
                "policy": str(policy),
                "endpoints": [{"url": eu.url, "labels": {"jurisdiction": "eu"}}],
            },
            auth={"tenants": [globex]},
            routing={"scrape_interval": 0.1},
        )
        config["pools"].append(
            {
                "name": "us",
                "models": ["m1"],
                "endpoints": [{"url": us.url, "labels": {"jurisdiction": "us"}}],
            }
        )
        app, server = start_gateway(config)
        home = app.fleet.endpoints[0]
        _wait(lambda: home.telemetry is not None and home.telemetry.waiting == 100)
        body = {"model": "m1", "messages": [{"role": "user", "content": "hello"}]}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                httpx.post,
                server.url + "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {key}"},
                timeout=30,
            )
            _wait(lambda: len(app.admission.queue) == 1)
            assert eu_engine.requests == us_engine.requests == 0  # held in the gateway
            eu_engine.waiting = 0
            assert answer.result().status_code == 200
        assert (eu_engine.requests, us_engine.requests) == (1, 0)


@pytest.mark.parametrize("where", ["policy", "rule"])
def test_residency_holds_under_a_policy_whose_filters_leave_it_out(start_gateway, tmp_path, where):
    """A policy (or one of its rules) that lists its own filters without `jurisdiction` still
    keeps a tenant's requests in its jurisdiction: residency is not the policy's to drop."""
    profile = {"filters": ["not_saturated"], "scorers": [], "picker": "round_robin"}
    spec: dict[str, Any] = {"name": "no-residency", **profile}
    if where == "rule":
        spec = {"name": "no-residency", "rules": [{"name": "everyone", **profile}]}
    policy = tmp_path / "no-residency.yaml"
    policy.write_text(yaml.safe_dump(spec))
    key, entry = make_key("globex-1")
    globex = tenant("globex", "silver", [entry], residency=["eu"])
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        config = gateway_config(
            fleet.urls,
            pool={"models": ["sim-model"], "policy": str(policy)},
            auth={"tenants": [globex]},
        )
        for endpoint, place in zip(config["pools"][0]["endpoints"], ["us", "eu"], strict=True):
            endpoint["labels"] = {"jurisdiction": place}
        app, server = start_gateway(config)
        [eu] = [e.name for e in app.fleet.endpoints if e.labels["jurisdiction"] == "eu"]
        served = []
        for i in range(6):
            answer = httpx.post(
                server.url + "/v1/chat/completions",
                json={
                    "model": "sim-model",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"q{i}"}],
                },
                headers={"authorization": f"Bearer {key}"},
                timeout=30,
            )
            assert answer.status_code == 200
            served.append(answer.headers["x-kvgate-endpoint"])
        assert served == [eu] * 6


def test_a_class_rule_listed_first_does_not_shadow_a_residency_rule(start_gateway):
    """Residency narrows whatever rule chose the class: an agent's GDPR request matches the
    class rule first and the residency rule after it, and goes to the EU engine only, streamed
    (the SDK) or not, and the EU engine's outage refuses it instead of sending it to the US."""
    key, entry = make_key("acme-1")
    rules = [
        {"name": "agents", "when": {"tools": True}, "then": {"class": "interactive"}},
        {"name": "gdpr", "when": {"regex": r"\bGDPR\b"}, "then": {"residency": ["eu"]}},
    ]
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        config = gateway_config(
            fleet.urls,
            auth={"tenants": [tenant("acme", "gold", [entry])]},
            classification={"rules": rules},
        )
        for endpoint, place in zip(config["pools"][0]["endpoints"], ["us", "eu"], strict=True):
            endpoint["labels"] = {"jurisdiction": place}
        app, server = start_gateway(config)
        [eu] = [e.name for e in app.fleet.endpoints if e.labels["jurisdiction"] == "eu"]
        client = sdk_client(base_url=server.url + "/v1", api_key=key, max_retries=0)
        tools = [{"type": "function", "function": {"name": "erase", "parameters": {}}}]
        served = []
        for i in range(4):
            raw = client.chat.completions.with_raw_response.create(
                model="sim-model",
                max_tokens=2,
                stream=i % 2 == 1,
                tools=tools,
                messages=[{"role": "user", "content": f"Process GDPR erasure request {i}"}],
            )
            served.append(raw.headers["x-kvgate-endpoint"])
            raw.parse()
        assert served == [eu] * 4
        us, eu_url = fleet.urls
        # The EU engine fails every request: no fall-through to the US engine.
        httpx.post(eu_url + "/sim/faults", json={"mode": "http_error", "status": 503}, timeout=5)
        with pytest.raises(openai.APIStatusError):
            client.chat.completions.create(
                model="sim-model",
                max_tokens=2,
                tools=tools,
                messages=[{"role": "user", "content": "Process GDPR erasure request 9"}],
            )
        assert httpx.get(us + "/sim/stats", timeout=5).json()["requests_received"] == 0


def test_a_responses_conversation_resent_whole_stays_with_the_engine_holding_it(start_gateway):
    """The Responses API without stored state: the client sends the whole conversation as
    `input` items every turn. Each turn goes where the conversation's prefix is, and finds it
    cached there."""
    with SimFleet.in_thread(engines=3, options=EngineOptions(profile="fast")) as fleet:
        _, server = start_gateway(gateway_config(fleet.urls))
        client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
        for topic in ("rivers", "mountains", "deserts"):
            items: list[dict[str, Any]] = []
            placed, cached = set(), []
            for turn in range(3):
                items.append({"role": "user", "content": f"Turn {turn}: tell me about {topic}."})
                raw = client.responses.with_raw_response.create(
                    model="sim-model",
                    instructions=SYSTEM,
                    input=items,
                    max_output_tokens=8,
                )
                answer = raw.parse()
                placed.add(raw.headers["x-kvgate-endpoint"])
                cached.append(answer.usage.input_tokens_details.cached_tokens)
                items.append({"role": "assistant", "content": answer.output_text})
            assert len(placed) == 1, (topic, placed)
            assert all(c > 0 for c in cached[1:]), (topic, cached)
