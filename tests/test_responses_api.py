"""`/v1/responses` through the gateway: proxied like chat completions (same chain, routing and
resilience) to pools whose engines serve it, streamed or not, with the OpenAI SDK against the
simulator; a clean 404 naming the reason where the pool's engines do not serve it."""

from __future__ import annotations

import time
from collections.abc import Iterator

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
from tests.upstreams import ScriptedUpstream

KEY, KEY_ENTRY = make_key("acme-1")


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as sim:
        yield sim


@pytest.fixture
def client(fleet, start_gateway) -> openai.OpenAI:
    _, server = start_gateway(
        gateway_config(list(fleet.urls), pool={"models": ["sim-model"]}, auth="none")
    )
    return sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_responses_with_the_sdk(client):
    response = client.responses.create(
        model="sim-model", input="Tell me a story", max_output_tokens=6
    )
    assert response.object == "response" and response.status == "incomplete"
    assert [item.status for item in response.output] == ["incomplete"]  # cut, as the response
    assert response.output_text
    assert response.usage is not None
    assert response.usage.output_tokens == 6
    assert response.usage.total_tokens == response.usage.input_tokens + 6


def test_streamed_responses_with_the_sdk(client):
    events = list(
        client.responses.create(
            model="sim-model",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}],
            instructions="Be brief.",
            max_output_tokens=5,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert kinds.count("response.output_text.delta") == 5
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_responses_stream_that_breaks_ends_with_the_responses_error_event(start_gateway):
    """OpenAI ends a Responses stream that fails with an `error` event (`type`, `code`,
    `message`, `param`, `sequence_number`), not a chat stream's `{"error": ...}`."""
    options = EngineOptions(profile="fast", fault={"mode": "crash_after_tokens", "tokens": 3})
    with SimFleet.in_thread(engines=1, options=options) as broken:
        _, server = start_gateway(gateway_config(list(broken.urls), auth="none"))
        client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
        events = list(
            client.responses.create(
                model="sim-model", input="Tell me a story", max_output_tokens=20, stream=True
            )
        )
    last = events[-1]
    assert last.type == "error"
    assert last.code == "upstream_connection_lost" and last.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events].count("response.output_text.delta") == 3


def test_an_engines_responses_error_event_ends_the_stream_once(upstream, start_gateway):
    """An engine's own `error` event ends a Responses stream, as at OpenAI: the client gets it
    (in OpenAI's shape) as the last event, not followed by a second error saying that the
    engine closed the stream unfinished."""
    engine, engine_server = upstream
    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1"}}
    failed = {"type": "error", "code": "server_error", "message": "engine blew up", "param": None}
    engine.script.stream_body = (
        b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n"
        b"event: error\ndata: " + orjson.dumps({**failed, "sequence_number": 1}) + b"\n\n"
    )
    _, server = start_gateway(
        gateway_config(
            [engine_server.url],
            pool={"engine": "openai", "models": ["m1"], "responses": True},
            auth="none",
        )
    )
    client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    events = list(client.responses.create(model="m1", input="hi", stream=True))
    assert [e.type for e in events] == ["response.created", "error"]
    assert events[-1].message == "engine blew up"
    assert [e.sequence_number for e in events] == [0, 1]
    assert len(engine.inference_requests) == 1


def test_responses_go_only_to_pools_that_serve_them(upstream, start_gateway, tmp_path):
    """A policy spreading a model over a vLLM pool and an SGLang one (which serves no
    Responses API) sends `/v1/responses` to the vLLM pool only; chat still uses both."""
    engine, engine_server = upstream
    policy = tmp_path / "both.yaml"
    policy.write_text(
        yaml.safe_dump({"name": "both", "pools": ["g1", "g2"], "picker": "round_robin"})
    )
    other = ScriptedUpstream()
    with ServerThread(other) as other_server:
        config = gateway_config(
            [engine_server.url], pool={"name": "g1", "models": ["m1"], "policy": str(policy)}
        )
        config["pools"].append(
            {
                "name": "g2",
                "engine": "sglang",
                "models": ["m1"],
                "endpoints": [{"url": other_server.url}],
            }
        )
        _, server = start_gateway(config)
        client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
        for i in range(4):
            client.responses.create(model="m1", input=f"hi {i}")
        for i in range(2):
            client.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": f"hi {i}"}]
            )
    assert {r.path for r in other.inference_requests} == {"/v1/chat/completions"}
    assert [r.path for r in engine.inference_requests].count("/v1/responses") == 4


def test_responses_is_404_where_the_pool_does_not_serve_it(upstream, start_gateway):
    engine, engine_server = upstream
    _, server = start_gateway(
        gateway_config(
            [engine_server.url], pool={"name": "sg", "engine": "sglang", "models": ["m1"]}
        )
    )
    client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model="m1", input="hi")
    body = refused.value.body
    assert body["code"] == "unsupported_route" and "'sg' (sglang engines)" in body["message"]
    assert engine.inference_requests == []


@pytest.mark.parametrize("engine_kind", ["openai", "vllm"])
def test_a_pool_flag_opens_responses_and_only_vllm_engines_get_the_cache_salt(
    upstream, start_gateway, engine_kind
):
    """A tenant's `cache_salt` is vLLM's field: an `engine: openai` pool (OpenAI's API refuses
    unknown parameters) gets every request without it, whatever the route, streamed or not,
    and wherever the client's own `cache_salt` stood in its body; a vLLM pool gets the
    tenant's salt in place of the client's."""
    engine, engine_server = upstream
    _, server = start_gateway(
        gateway_config(
            [engine_server.url],
            pool={"engine": engine_kind, "models": ["m1"], "responses": True},
            auth={"tenants": [tenant("acme", "gold", [KEY_ENTRY])]},
        )
    )
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    message = [{"role": "user", "content": "hi"}]
    bodies = [
        ("/v1/responses", {"model": "m1", "input": "hi"}),
        ("/v1/chat/completions", {"model": "m1", "messages": message}),
        ("/v1/chat/completions", {"cache_salt": "mine", "model": "m1", "messages": message}),
        ("/v1/chat/completions", {"model": "m1", "cache_salt": "mine", "messages": message}),
        ("/v1/chat/completions", {"model": "m1", "messages": message, "stream": True}),
        ("/v1/completions", {"model": "m1", "prompt": "hi", "cache_salt": "mine"}),
    ]
    for path, body in bodies:
        answer = httpx.post(server.url + path, content=orjson.dumps(body), headers=headers)
        assert answer.status_code == 200, answer.text
        received = engine.inference_requests[-1]
        assert received.path == path
        salt = received.body.get("cache_salt")
        if engine_kind == "openai":
            assert salt is None, received.body
            assert {k: v for k, v in received.body.items() if k != "stream_options"} == {
                k: v for k, v in body.items() if k != "cache_salt"
            }
        else:
            assert isinstance(salt, str) and salt != "mine"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "sim-model"}, "input"),
        ({"model": "sim-model", "input": []}, "input"),
        ({"model": "sim-model", "input": ["hi"]}, "input[0]"),
        ({"model": "sim-model", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "sim-model", "input": "hi", "stream": "yes"}, "stream"),
    ],
)
def test_malformed_responses_requests_are_400(fleet, start_gateway, body, param):
    _, server = start_gateway(gateway_config(list(fleet.urls), pool={"models": ["sim-model"]}))
    response = httpx.post(server.url + "/v1/responses", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_responses_tokens_and_cost_are_counted_as_chat_tokens_are(fleet, start_gateway):
    """The Responses API reports `input_tokens` / `output_tokens`; the gateway's token
    counters and cost read them as the prompt and completion tokens they are."""
    _, server = start_gateway(
        gateway_config(
            list(fleet.urls),
            pool={
                "models": ["sim-model"],
                "price": {
                    "input_per_mtok": 1.0,
                    "cached_input_per_mtok": 0.5,
                    "output_per_mtok": 4.0,
                },
            },
            auth="none",
        )
    )
    client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    context = "the shared context of every question here. " * 40
    usages = [
        client.responses.create(
            model="sim-model", input=f"{context} {i}", max_output_tokens=4
        ).usage
        for i in range(2)
    ]
    streamed = list(
        client.responses.create(
            model="sim-model", input=f"{context} streamed", max_output_tokens=4, stream=True
        )
    )
    usages.append(streamed[-1].response.usage)
    prompt = sum(u.input_tokens for u in usages)
    completion = sum(u.output_tokens for u in usages)
    cached = sum(u.input_tokens_details.cached_tokens for u in usages)
    assert cached > 0, "the engine never reported a prefix-cache hit"
    dollars = ((prompt - cached) * 1.0 + cached * 0.5 + completion * 4.0) / 1e6
    labels = {"tenant": "anonymous", "model": "sim-model", "pool": "default"}
    deadline = time.monotonic() + 5  # each request is settled just after its answer
    while True:
        text = httpx.get(server.url + "/metrics").text
        counted = sample_value(text, "kvgate_completion_tokens_total", **labels)
        if counted == completion or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sample_value(text, "kvgate_prompt_tokens_total", **labels) == prompt
    assert sample_value(text, "kvgate_completion_tokens_total", **labels) == completion
    assert sample_value(text, "kvgate_cached_prompt_tokens_total", **labels) == cached
    assert sample_value(text, "kvgate_cost_dollars_total", **labels) == pytest.approx(dollars)
