"""Stored responses behind kvgate, with the OpenAI SDK against simulated vLLM engines that keep
them (as `VLLM_ENABLE_RESPONSES_API_STORE=1` does): every response id the client gets names
the engine that stores it, so retrieve, cancel and `previous_response_id` reach that engine,
on any gateway replica with the same engines."""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.routing.response_ids import client_id, signing_key
from kvgate.sim import EngineOptions, SimFleet
from tests.chain.helpers import make_key, tenant
from tests.conftest import gateway_config
from tests.responses_store_fleet import received
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread

ACME_KEY, ACME_ENTRY = make_key("acme-1")
ISSUED = re.compile(r"resp_[0-9a-f]{32}_kvg[0-9a-f]{16}")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client(store_fleet, start_gateway) -> openai.OpenAI:
    """A gateway over both engines that alternates between them (round robin): a request it
    routed, rather than pinned, would land on the engine without the conversation. The tenant
    may use `sim-*` models only (the routes under an id name none)."""
    config = gateway_config(
        store_fleet.urls,
        pool={"models": ["sim-model"], "policy": "round_robin"},
        auth={"tenants": [tenant("acme", "gold", [ACME_ENTRY], models=["sim-*"])]},
    )
    _, server = start_gateway(config)
    return sdk_client(base_url=server.url + "/v1", api_key=ACME_KEY, max_retries=0)


def storing(store_fleet: SimFleet, response_id: str) -> list[int]:
    """The engines (indexes) that store the response the issued `response_id` names."""
    engine_id = response_id.rsplit("_kvg", 1)[0]
    return [i for i, engine in enumerate(store_fleet.engines) if engine_id in engine.responses]


def test_a_created_response_is_retrieved_by_the_id_the_client_got(store_fleet, client):
    created = client.responses.create(
        model="sim-model", input="Tell me about rivers", max_output_tokens=6
    )
    assert ISSUED.fullmatch(created.id)
    [home] = storing(store_fleet, created.id)
    before = received(store_fleet)
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.id == created.id and retrieved.output_text == created.output_text
    assert [after - b for after, b in zip(received(store_fleet), before, strict=True)] == [
        int(i == home) for i in range(2)
    ]


def test_a_retrieve_settles_without_the_usage_the_response_was_charged_at_its_making(
    store_fleet, start_gateway
):
    app, server = start_gateway(gateway_config(store_fleet.urls, auth="none"))
    settled: list[tuple[str, object]] = []
    settle = app.stored_chain.settle

    def watched(ctx: Any) -> None:
        settled.append((ctx.route, ctx.usage))
        settle(ctx)

    app.stored_chain.settle = watched
    client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    created = client.responses.create(model="sim-model", input="Count me", max_output_tokens=2)
    assert client.responses.retrieve(created.id).usage == created.usage
    # Settled once the answer is sent, which the client may see first.
    deadline = time.monotonic() + 10
    while not settled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert settled == [("responses_retrieve", None)]
    tasks = [
        (sample.labels["model"], sample.value)
        for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
        for sample in family.samples
        if sample.name == "kvgate_successful_tasks_total"
    ]
    assert tasks == [("sim-model", 1.0)]  # the create; reading it back is no task


def test_a_conversation_continues_on_the_engine_that_stores_it(store_fleet, client):
    turn = client.responses.create(model="sim-model", input="Once upon a time", max_output_tokens=4)
    [home] = storing(store_fleet, turn.id)
    before = received(store_fleet)
    prompts = [turn.usage.input_tokens]
    for text in ("there was a river", "and a stone", "and a bridge"):
        previous = turn.id
        turn = client.responses.create(
            model="sim-model", input=text, max_output_tokens=4, previous_response_id=previous
        )
        assert ISSUED.fullmatch(turn.id) and turn.previous_response_id == previous
        assert storing(store_fleet, turn.id) == [home]
        prompts.append(turn.usage.input_tokens)
    assert prompts == sorted(prompts) and len(set(prompts)) == 4  # the stored turns come first
    assert [after - b for after, b in zip(received(store_fleet), before, strict=True)] == [
        3 * int(i == home) for i in range(2)
    ]


def test_a_continuation_waits_for_its_own_engine_not_for_any(store_fleet, start_gateway):
    """Each endpoint takes one request at a time (`max_inflight: 1`). While the engine that
    stores a conversation is busy, its next turn waits in the gateway even though the other
    engine is free (it can run nowhere else), and goes as soon as its engine is free."""
    config = gateway_config(
        store_fleet.urls,
        pool={"models": ["sim-model"], "policy": "round_robin"},
        auth={"tenants": [tenant("acme", "gold", [ACME_ENTRY], models=["sim-*"])]},
    )
    for endpoint in config["pools"][0]["endpoints"]:
        endpoint["max_inflight"] = 1
    _, server = start_gateway(config)
    client = sdk_client(base_url=server.url + "/v1", api_key=ACME_KEY, max_retries=0)
    first = client.responses.create(model="sim-model", input="Rivers?", max_output_tokens=3)
    [home] = storing(store_fleet, first.id)
    store_fleet.engines[home].set_fault({"mode": "slow_first_token", "delay_ms": 1500, "count": 1})
    before = received(store_fleet)
    finished: list[str] = []

    def turn(text: str) -> None:
        client.responses.create(
            model="sim-model", input=text, max_output_tokens=3, previous_response_id=first.id
        )
        finished.append(text)

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(turn, "slow")
        deadline = time.monotonic() + 10
        while received(store_fleet)[home] == before[home]:
            assert time.monotonic() < deadline, "the first turn never reached its engine"
            time.sleep(0.01)
        waiting = pool.submit(turn, "waiting")
        time.sleep(0.5)
        assert received(store_fleet)[home] == before[home] + 1  # held in the gateway
        slow.result(timeout=20)
        waiting.result(timeout=20)
    assert finished == ["slow", "waiting"]
    after = received(store_fleet)
    assert after[home] == before[home] + 2 and after[1 - home] == before[1 - home]


def test_with_a_response_id_secret_an_id_made_without_it_reaches_no_engine(
    store_fleet, start_gateway
):
    """`auth.response_id_secret` keys the ids: the gateway's own ids work as ever, turn after
    turn, and one made without the secret (from an engine id seen in another tenant's
    response id, say) is refused before any engine sees it."""
    secret = "shared-by-every-replica-0123456789"
    config = gateway_config(
        store_fleet.urls,
        pool={"models": ["sim-model"], "policy": "round_robin"},
        auth={
            "response_id_secret": secret,
            "tenants": [tenant("acme", "gold", [ACME_ENTRY], models=["sim-*"])],
        },
    )
    _, server = start_gateway(config)
    client = sdk_client(base_url=server.url + "/v1", api_key=ACME_KEY, max_retries=0)
    first = client.responses.create(model="sim-model", input="A secret", max_output_tokens=3)
    [home] = storing(store_fleet, first.id)
    engine_id = first.id.rsplit("_kvg", 1)[0]
    url = store_fleet.urls[home]
    assert first.id == client_id(engine_id, "acme", url, signing_key(secret))
    second = client.responses.create(
        model="sim-model", input="kept", max_output_tokens=3, previous_response_id=first.id
    )
    assert storing(store_fleet, second.id) == [home]
    assert client.responses.retrieve(first.id).output_text == first.output_text
    before = received(store_fleet)
    made = client_id(engine_id, "acme", url)  # unkeyed, as it would be without the secret
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.retrieve(made)
    assert refused.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model="sim-model", input="x", max_output_tokens=2, previous_response_id=made
        )
    assert received(store_fleet) == before


def test_every_id_of_a_stream_is_the_issued_one_and_retrieves_it(store_fleet, client):
    events = list(
        client.responses.create(
            model="sim-model", input="Stream a story", max_output_tokens=5, stream=True
        )
    )
    ids = [e.response.id for e in events if hasattr(e, "response")]
    assert [e.type for e in events if hasattr(e, "response")] == [
        "response.created",
        "response.in_progress",
        "response.incomplete",
    ]
    assert len(set(ids)) == 1 and ISSUED.fullmatch(ids[0])
    assert storing(store_fleet, ids[0])
    assert client.responses.retrieve(ids[0]).output_text == events[-1].response.output_text


def test_a_cancel_reaches_the_engine_that_stores_the_response_and_its_answer_is_relayed(
    store_fleet, client
):
    created = client.responses.create(model="sim-model", input="Be quick", max_output_tokens=3)
    [home] = storing(store_fleet, created.id)
    before = received(store_fleet)
    with pytest.raises(openai.BadRequestError) as refused:  # vLLM: not a background response
        client.responses.cancel(created.id)
    assert refused.value.body["message"] == "Cannot cancel a synchronous response."
    assert [after - b for after, b in zip(received(store_fleet), before, strict=True)] == [
        int(i == home) for i in range(2)
    ]


def test_a_background_response_is_cancelled_where_it_runs(start_gateway):
    """Slow engines (about 15 ms a token): the background response is still generating when
    the cancel arrives."""
    options = EngineOptions(profile="realistic", responses_store=True)
    with SimFleet.in_thread(engines=2, options=options) as slow:
        config = gateway_config(slow.urls, pool={"models": ["sim-model"]}, auth="none")
        _, server = start_gateway(config)
        client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
        queued = client.responses.create(
            model="sim-model", input="A long tale", max_output_tokens=400, background=True
        )
        assert queued.status == "queued" and ISSUED.fullmatch(queued.id)
        cancelled = client.responses.cancel(queued.id)
        assert (cancelled.id, cancelled.status) == (queued.id, "cancelled")
        assert client.responses.retrieve(queued.id).status == "cancelled"
        [home] = storing(slow, queued.id)
        assert [e.stats()["requests_received"] for e in slow.engines] == [
            3 * int(i == home) for i in range(2)
        ]


ENGINE_ID = "resp_5e9d0c1b2a3f4e5d6c7b8a9f0e1d2c3b"


def _event(kind: str, number: int, **fields: Any) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": number, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class SplittingEngine:
    """An engine storing one response, `ENGINE_ID`. `POST /v1/responses` answers it; `GET
    /v1/responses/{id}?stream=true` replays its events, each write cut inside the id, so that
    the gateway reads the id in two pieces (within the last event and in a comment after it,
    which the relay passes on as read); any other request under the id is answered with what
    reached the engine."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        path, query = scope["path"], scope["query_string"]
        if path in ("/health", "/metrics", "/v1/models"):
            status = 404 if path == "/metrics" else 200
            await _reply(send, status, {"object": "list", "data": [{"id": "m1"}]})
            return
        self.received.append((scope["method"], path, query))
        if path == "/v1/responses":
            await _reply(send, 200, {"id": ENGINE_ID, "object": "response", "status": "completed"})
            return
        if b"stream=true" in query.split(b"&"):
            await self._replay(send)
            return
        await _reply(send, 200, {"method": scope["method"], "path": path, "query": query.decode()})

    async def _replay(self, send: Any) -> None:
        response = {"id": ENGINE_ID, "object": "response", "status": "completed", "output": []}
        stream = (
            _event("response.output_text.done", 2, item_id="msg_1", text="done")
            + _event("response.completed", 3, response=response)
            + b": replayed "
            + ENGINE_ID.encode()
            + b"\n\n"
        )
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        cuts = [m.start() + 12 for m in re.finditer(ENGINE_ID.encode(), stream)]
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            await send({"type": "http.response.body", "body": stream[start:end], "more_body": True})
            await asyncio.sleep(0.05)  # the next write arrives in a read of its own
        await send({"type": "http.response.body", "body": b""})


async def _reply(send: Any, status: int, body: dict[str, Any]) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": orjson.dumps(body)})


def test_a_replayed_stream_whose_id_a_read_splits_reaches_the_client_rewritten(start_gateway):
    engine = SplittingEngine()
    with ServerThread(engine, lifespan="off") as upstream:
        _, server = start_gateway(gateway_config([upstream.url], auth="none"))
        client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
        issued = client.responses.create(model="m1", input="hi").id
        assert ISSUED.fullmatch(issued) and issued.startswith(ENGINE_ID)
        events = list(client.responses.retrieve(issued, stream=True, starting_after=1))
        assert [e.type for e in events] == ["response.output_text.done", "response.completed"]
        assert events[-1].response.id == issued
        with httpx.stream("GET", f"{server.url}/v1/responses/{issued}?stream=true") as raw:
            relayed = b"".join(raw.iter_bytes())
        assert relayed.count(issued.encode()) == 2 and relayed.count(ENGINE_ID.encode()) == 2
    method, path, query = engine.received[1]  # as the SDK sent it, with the engine's id
    assert (method, path) == ("GET", f"/v1/responses/{ENGINE_ID}")
    assert sorted(query.split(b"&")) == [b"starting_after=1", b"stream=true"]


def test_any_other_call_under_an_id_is_forwarded_as_it_came(start_gateway):
    engine = SplittingEngine()
    with ServerThread(engine, lifespan="off") as upstream:
        _, server = start_gateway(gateway_config([upstream.url], auth="none"))
        issued = httpx.post(server.url + "/v1/responses", json={"model": "m1", "input": "hi"})
        response_id = issued.json()["id"]
        answer = httpx.delete(f"{server.url}/v1/responses/{response_id}/input_items?limit=2")
    assert engine.received[-1] == ("DELETE", f"/v1/responses/{ENGINE_ID}/input_items", b"limit=2")
    assert answer.status_code == 200
    # The engine's answer names its id: relayed as the client's, as every id of an answer is.
    assert answer.json()["path"] == f"/v1/responses/{response_id}/input_items"
