"""End to end: the gateway routes on the simulated engines' KV events (precise mode).

Real sockets throughout: engines with `--kv-events` in a thread, the gateway on uvicorn, the
OpenAI SDK as client. The precise index's answer is checked against the engines' own
`cached_tokens`; a stopped publisher puts its endpoint in approximate mode (visible in
metrics and `/readyz`) without failing a request, and a restarted one brings it back.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio
from tokenizers import pre_tokenizers

from kvgate.app import GatewayApp, salted_precise_tenants
from kvgate.config import parse_config
from kvgate.sim import EngineOptions, SimFleet
from tests.conftest import gateway_config
from tests.hf_tokenizers import LLAMA3_LIKE, bpe_tokenizer
from tests.metrics_text import sample_value
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread
from tests.upstreams import ScriptedUpstream

from .helpers import TOPIC, ScriptedPublisher, batch, block, cleared, seq_frame, until

SCRAPE = 0.2
SYSTEMS = [
    f"You are assistant number {i} of a bicycle shop; answer briefly, kindly and precisely. " * 12
    for i in range(4)
]
Start = Callable[[dict[str, Any]], tuple[GatewayApp, ServerThread]]


@pytest.fixture
def engines() -> Iterator[SimFleet]:
    options = EngineOptions(profile="fast", speed=50.0, kv_events=True, kv_blocks=3000)
    with SimFleet.in_thread(engines=3, options=options) as fleet:
        yield fleet


def precise_config(fleet: SimFleet, **routing: Any) -> dict[str, Any]:
    config = gateway_config(
        fleet.urls,
        routing={"scrape_interval": SCRAPE, **routing},
        pool={"tokenizer": {"kind": "sim"}},
    )
    for endpoint, engine in zip(config["pools"][0]["endpoints"], fleet.engines, strict=True):
        assert engine.kv_events is not None
        endpoint["kv_events"] = {
            "url": engine.kv_events.url,
            "replay_url": engine.kv_events.replay_url,
        }
    return config


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def caught_up(app: GatewayApp, fleet: SimFleet) -> None:
    """Wait until every batch each engine published was applied by its subscriber."""
    precise = app.routing.precise
    assert precise is not None

    def applied() -> bool:
        for endpoint, engine in zip(app.fleet.endpoints, fleet.engines, strict=True):
            counters = precise.counters(endpoint.name)
            assert engine.kv_events is not None
            if counters is None or counters.batches_applied < engine.kv_events.batches_published:
                return False
        return True

    wait_for(applied)


def modes(app: GatewayApp) -> dict[str, str]:
    precise = app.routing.precise
    assert precise is not None
    return {name: precise.mode(name)[0] for name in precise.endpoints}  # type: ignore[index]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_precise_index_agrees_with_the_engines_and_places_shared_prefixes(
    engines: SimFleet, start_gateway: Start, api: str
) -> None:
    app, server = start_gateway(precise_config(engines))
    wait_for(lambda: set(modes(app).values()) == {"precise"})
    client = sdk_client(base_url=server.url + "/v1", api_key="none")
    agreed = disagreed = 0
    chosen: dict[int, set[str]] = {}
    for turn in range(60):
        group = turn % len(SYSTEMS)
        question = f"Question {turn} about gears?"
        raw: Any
        if api == "chat":
            raw = client.chat.completions.with_raw_response.create(
                model="sim-model",
                max_tokens=4,
                messages=[
                    {"role": "system", "content": SYSTEMS[group]},
                    {"role": "user", "content": question},
                ],
            )
        else:
            raw = client.responses.with_raw_response.create(
                model="sim-model", max_output_tokens=4, instructions=SYSTEMS[group], input=question
            )
        chosen.setdefault(group, set()).add(raw.headers["x-kvgate-endpoint"])
        caught_up(app, engines)  # steady state: what the engines published has arrived
        usage = raw.parse().usage
        details = usage.prompt_tokens_details if api == "chat" else usage.input_tokens_details
        assert details is not None
        if turn < len(SYSTEMS):
            continue  # the first request of each group: the engines learn the prefix
        drift = app.routing.feedback.drift
        agreed = sum(d.exact_agreed for d in drift.values())
        disagreed = sum(d.exact_disagreed for d in drift.values())
    assert agreed + disagreed >= 56
    assert agreed / (agreed + disagreed) >= 0.995, (agreed, disagreed)
    assert all(len(endpoints) == 1 for endpoints in chosen.values()), chosen
    metrics = httpx.get(server.url + "/metrics").text
    name = next(iter(chosen[0]))
    assert sample_value(metrics, "kvgate_kv_events_applied_total", endpoint=name) > 0
    assert (
        sample_value(
            metrics, "kvgate_precise_answers_total", endpoint=next(iter(chosen[0])), outcome="agree"
        )
        > 0
    )
    ready = httpx.get(server.url + "/readyz").json()
    assert ready == {"status": "ready", "approximate_endpoints": []}


def test_a_stopped_publisher_falls_back_within_three_intervals_and_recovers(
    engines: SimFleet, start_gateway: Start
) -> None:
    app, server = start_gateway(precise_config(engines))
    wait_for(lambda: set(modes(app).values()) == {"precise"})
    client = sdk_client(base_url=server.url + "/v1", api_key="none")

    def ask(text: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", max_tokens=4, messages=[{"role": "user", "content": text}]
        )
        assert raw.status_code == 200
        return raw.headers["x-kvgate-endpoint"]

    first = ask(SYSTEMS[0] + " First question?")
    victim = engines.engines[[e.name for e in app.fleet.endpoints].index(first)]
    victim.set_kv_event_fault({"mode": "stop"})
    stopped = time.monotonic()
    # Traffic that fills blocks on the victim starts its stall clock; keep it coming.
    served = []
    for i in range(100_000):
        text = f" Follow-up {i}: " + " ".join(f"word{i}x{k}" for k in range(40))
        served.append(ask(SYSTEMS[0] + text))
        if modes(app)[first] == "approximate" or time.monotonic() - stopped > 10:
            break
    elapsed = time.monotonic() - stopped
    assert modes(app)[first] == "approximate", served
    assert elapsed < 3 * SCRAPE + 3.0  # the stall limit (3 intervals) plus slack for CI
    assert httpx.get(server.url + "/readyz").json()["approximate_endpoints"] == [first]
    listed = httpx.get(server.url + "/admin/endpoints").json()["data"]
    index_modes = {e["name"]: e["prefix_index"] for e in listed}
    assert index_modes[first] == {
        **index_modes[first],
        "mode": "approximate",
        "mode_reason": "stalled",
    }
    assert all(m["mode"] == "precise" for name, m in index_modes.items() if name != first)
    metrics = httpx.get(server.url + "/metrics").text
    assert sample_value(metrics, "kvgate_kv_events_precise", endpoint=first, reason="stalled") == 0
    victim.set_kv_event_fault(None)  # batches flow again; the ones held back are replayed
    for i in range(100_000):
        ask(SYSTEMS[0] + f" After the stall {i}: " + " ".join(f"w{i}y{k}" for k in range(40)))
        if modes(app)[first] == "precise" or time.monotonic() - stopped > 20:
            break
    assert modes(app)[first] == "precise"
    victim.set_kv_event_fault({"mode": "restart"})  # a new process: sequence 0, new salt
    restarted = time.monotonic()
    for i in range(100_000):
        ask(SYSTEMS[0] + f" After the restart {i}: " + " ".join(f"v{i}z{k}" for k in range(40)))
        counters = app.routing.precise.counters(first)  # type: ignore[union-attr]
        if counters is not None and counters.restarts and modes(app)[first] == "precise":
            break
        if time.monotonic() - restarted > 10:
            break
    assert modes(app)[first] == "precise"


async def test_malformed_event_payloads_are_counted_and_dropped(
    upstream: tuple[ScriptedUpstream, ServerThread], start_gateway: Start
) -> None:
    context = zmq.asyncio.Context()
    async with ScriptedPublisher(context) as publisher:
        config = gateway_config([upstream[1].url], pool={"tokenizer": {"kind": "sim"}})
        events = {"url": publisher.url, "replay_url": publisher.replay_url}
        config["pools"][0]["endpoints"][0]["kv_events"] = events
        app, server = start_gateway(config)
        precise = app.routing.precise
        assert precise is not None
        name = precise.endpoints[0]
        await publisher.wait_for_subscriber()
        await until(lambda: precise.mode(name) == ("precise", "fresh_start"))
        await publisher.send(0, block(1))
        await publisher.send_frames([TOPIC, seq_frame(1)])  # two frames, not three
        await publisher.send(1, b"\xc1 is no msgpack")
        await publisher.send(2, block(2))
        counters = precise.counters(name)
        assert counters is not None
        await until(lambda: counters.batches_applied == 2)
        assert counters.malformed_dropped == 2
        assert precise.mode(name) == ("approximate", "malformed_batch")
        async with httpx.AsyncClient(base_url=server.url) as client:
            metrics = (await client.get("/metrics")).text
            labels = {"endpoint": name}
            assert sample_value(metrics, "kvgate_kv_events_malformed_total", **labels) == 2
            assert sample_value(metrics, "kvgate_kv_events_applied_total", **labels) == 2
            reason = {"reason": "malformed_batch", **labels}
            assert sample_value(metrics, "kvgate_kv_events_precise", **reason) == 0
            await publisher.send(3, batch(cleared()))  # the engine's cache reset: exact again
            await until(lambda: precise.mode(name) == ("precise", "cleared"))
            assert (await client.get("/readyz")).json()["approximate_endpoints"] == []
    context.term()


def test_an_endpoint_back_from_an_outage_is_approximate_until_its_next_batch(
    engines: SimFleet, start_gateway: Start
) -> None:
    """Its engine may have restarted empty, or kept its cache through a health-check outage
    (and never publishes again the blocks it holds): the endpoint is routed approximately
    until its next batch tells. One that continues the sequence brings it back to precise
    with the blocks it held still indexed; a restart is the subscriber's (tested apart)."""
    config = precise_config(engines)
    config["health"] = {"interval": 0.1, "timeout": 0.05, "discovery_interval": 30}
    app, server = start_gateway(config)
    wait_for(lambda: set(modes(app).values()) == {"precise"})
    wait_for(lambda: all(e.healthy for e in app.fleet.endpoints), seconds=30)
    client = sdk_client(base_url=server.url + "/v1", api_key="none")
    raw = client.chat.completions.with_raw_response.create(
        model="sim-model", max_tokens=4, messages=[{"role": "user", "content": SYSTEMS[1]}]
    )
    name = raw.headers["x-kvgate-endpoint"]
    caught_up(app, engines)
    precise = app.routing.precise
    assert precise is not None
    held = precise.index.blocks(name)
    assert held > 0
    endpoint = next(e for e in app.fleet.endpoints if e.name == name)
    victim = engines.engines[app.fleet.endpoints.index(endpoint)]
    victim.set_fault({"mode": "hang_health"})  # the engine and its cache carry on
    wait_for(lambda: not endpoint.healthy)
    victim.clear_fault()
    wait_for(lambda: endpoint.healthy)
    assert precise.mode(name) == ("approximate", "engine_back")
    assert precise.index.blocks(name) == held  # not forgotten: the engine may still hold them
    httpx.post(  # the engine stores a new prompt: its next batch continues the sequence
        victim.url + "/v1/chat/completions",
        json={
            "model": "sim-model",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": SYSTEMS[2]}],
        },
        timeout=30,
    ).raise_for_status()
    wait_for(lambda: precise.mode(name) == ("precise", "resumed"))
    assert precise.index.blocks(name) > held
    again = client.chat.completions.create(
        model="sim-model", max_tokens=4, messages=[{"role": "user", "content": SYSTEMS[1]}]
    )
    details = again.usage.prompt_tokens_details if again.usage is not None else None
    assert details is not None and details.cached_tokens  # still a hit where it was placed


def test_explain_shows_which_index_prices_each_candidate(
    engines: SimFleet, start_gateway: Start
) -> None:
    """In precise mode `x-kvgate-route-explain` gives the tokenizer's prompt count and, per
    candidate, `index=precise` with the tokens the engine's events say it holds."""
    app, server = start_gateway(precise_config(engines, explain="always"))
    wait_for(lambda: set(modes(app).values()) == {"precise"})
    client = sdk_client(base_url=server.url + "/v1", api_key="none")
    asked: dict[str, Any] = {"model": "sim-model", "max_tokens": 2}
    messages = [{"role": "user", "content": SYSTEMS[3]}]
    first = client.chat.completions.with_raw_response.create(**asked, messages=messages)
    caught_up(app, engines)
    again = client.chat.completions.with_raw_response.create(
        **asked, messages=messages, extra_headers={"x-kvgate-explain": "1"}
    )
    explained = again.headers["x-kvgate-route-explain"]
    assert "exact_prompt_tokens=" in explained
    holder = first.headers["x-kvgate-endpoint"]
    term = re.search(rf"{holder} [^;]*index=precise held_tokens=(\d+)", explained)
    assert term is not None and int(term.group(1)) > 0, explained
    assert explained.count("index=precise") == len(engines.engines)
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    # every run the engines stored chained to a block the index knew
    assert sample_value(metrics, "kvgate_precise_orphan_runs_total", endpoint=holder) == 0


def test_tenants_whose_requests_are_salted_are_named_when_pools_route_on_kv_events():
    """Their requests carry a cache salt the events cannot show: the gateway warns at start
    that precise routing does not apply to them."""
    pool = {"name": "p", "tokenizer": {"kind": "sim"}, "endpoints": [{"url": "http://e:1"}]}
    tenants = [
        {"name": "isolated", "keys": []},
        {"name": "sharing", "keys": [], "cache_isolation": "shared"},
    ]
    events = {**pool, "kv_events": {"port_offset": 1000}}
    assert salted_precise_tenants(
        parse_config({"pools": [events], "auth": {"tenants": tenants}})
    ) == ["isolated"]
    assert (
        salted_precise_tenants(parse_config({"pools": [pool], "auth": {"tenants": tenants}})) == []
    )
    assert salted_precise_tenants(parse_config({"pools": [events]})) == []


def test_a_hugging_face_tokenizer_encodes_each_prompt_once_off_the_event_loop(
    engines: SimFleet, start_gateway: Start, tmp_path: Path
) -> None:
    """`tokenizers` encodes without the GIL: the prompt's ids are computed on the gateway's
    tokenizer thread before admission, once per request, and the pick reuses them."""
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    bpe_tokenizer(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False), specials, LLAMA3_LIKE)
    config = precise_config(engines)
    config["pools"][0]["tokenizer"] = {"kind": "hf", "path": str(tmp_path)}
    app, server = start_gateway(config)
    precise = app.routing.precise
    assert precise is not None
    tokenizer = precise._tokenizers["default"]
    threads: list[str] = []

    class Watched:
        off_loop = tokenizer.off_loop

        def prompt_ids(self, route: str, payload: dict[str, Any]) -> list[int] | None:
            threads.append(threading.current_thread().name)
            return tokenizer.prompt_ids(route, payload)

    precise._tokenizers["default"] = Watched()
    client = sdk_client(base_url=server.url + "/v1", api_key="none")
    for turn in range(3):
        client.chat.completions.create(
            model="sim-model",
            max_tokens=2,
            messages=[{"role": "user", "content": f"the gears turn {turn} times"}],
        )
    assert len(threads) == 3 and all(t.startswith("kvgate-tokenize") for t in threads), threads
