"""A response id the gateway cannot serve gets a clear OpenAI-shaped error, reaches no engine and
leaves nothing behind, however it is given: retrieved, cancelled or continued."""

from __future__ import annotations

import http.client
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from kvgate.app import GatewayApp
from kvgate.routing.response_ids import client_id
from kvgate.sim import SimFleet
from tests.chain.helpers import IDLE, admission_state, make_key, tenant
from tests.conftest import gateway_config
from tests.responses_store_fleet import received
from tests.servers import ServerThread

ACME_KEY, ACME_ENTRY = make_key("acme-1")
GLOBEX_KEY, GLOBEX_ENTRY = make_key("globex-1")

pytestmark = pytest.mark.timeout(60)


def config(urls: list[str]) -> dict[str, Any]:
    return gateway_config(
        urls,
        pool={"models": ["sim-model"]},
        auth={
            "tenants": [
                tenant("acme", "gold", [ACME_ENTRY]),
                tenant("globex", "gold", [GLOBEX_ENTRY]),
            ]
        },
        health={"interval": 60},  # no probe undoes what a test marks
    )


@pytest.fixture
def gateway(store_fleet, start_gateway) -> tuple[GatewayApp, ServerThread]:
    return start_gateway(config(store_fleet.urls))


def create(server: ServerThread, key: str = ACME_KEY, **body: Any) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/responses",
        json={
            "model": "sim-model",
            "input": "Tell me about stones",
            "max_output_tokens": 3,
            **body,
        },
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )


def retrieve(server: ServerThread, response_id: str) -> httpx.Response:
    return httpx.get(
        f"{server.url}/v1/responses/{response_id}",
        headers={"authorization": f"Bearer {ACME_KEY}"},
        timeout=10,
    )


def cancel(server: ServerThread, response_id: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/responses/{response_id}/cancel",
        headers={"authorization": f"Bearer {ACME_KEY}"},
        timeout=10,
    )


def raw_post(server: ServerThread, path: str) -> httpx.Response:
    """POST `path` exactly as given (no client normalises its dots or escapes), as acme."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request("POST", path, headers={"authorization": f"Bearer {ACME_KEY}"})
        reply = connection.getresponse()
        return httpx.Response(reply.status, headers=reply.getheaders(), content=reply.read())
    finally:
        connection.close()


def continuation(server: ServerThread, response_id: str) -> httpx.Response:
    return create(server, previous_response_id=response_id)


ASKS: list[tuple[Callable[[ServerThread, str], httpx.Response], str]] = [
    (retrieve, "response_id"),
    (cancel, "response_id"),
    (continuation, "previous_response_id"),
]


def stored(store_fleet: SimFleet, server: ServerThread, key: str = ACME_KEY) -> tuple[str, int]:
    """A response created through `server` for `key`'s tenant: its id and the engine storing it."""
    response_id = create(server, key).json()["id"]
    engine_id = response_id.rsplit("_kvg", 1)[0]
    [home] = [i for i, e in enumerate(store_fleet.engines) if engine_id in e.responses]
    return response_id, home


def assert_refused_cleanly(
    answer: httpx.Response,
    status: int,
    code: str,
    param: str | None,
    store_fleet: SimFleet,
    before: list[int],
    app: GatewayApp,
    server: ServerThread,
) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["code"], error["param"]) == (code, param)
    assert answer.headers["x-request-id"]
    assert received(store_fleet) == before  # no engine reached
    assert admission_state(app, server) == IDLE
    assert [e.inflight for e in app.fleet.endpoints] == [0] * len(app.fleet.endpoints)


@pytest.mark.parametrize(("ask", "param"), ASKS)
def test_an_id_the_gateway_did_not_issue_is_404(store_fleet, gateway, ask, param):
    app, server = gateway
    before = received(store_fleet)
    answer = ask(server, "resp_0f3c6d2e9a8b47c1b2d3e4f5a6b7c8d9")
    assert_refused_cleanly(
        answer, 404, "unknown_response_id", param, store_fleet, before, app, server
    )
    assert "did not issue" in answer.json()["error"]["message"]


@pytest.mark.parametrize(("ask", "param"), ASKS)
def test_a_forged_suffix_is_404(store_fleet, gateway, ask, param):
    app, server = gateway
    response_id, _ = stored(store_fleet, server)
    forged = response_id[:-1] + ("0" if response_id[-1] != "0" else "1")
    before = received(store_fleet)
    answer = ask(server, forged)
    assert_refused_cleanly(
        answer, 404, "response_not_found", param, store_fleet, before, app, server
    )


@pytest.mark.parametrize(("ask", "param"), ASKS)
def test_another_tenants_id_is_404(store_fleet, gateway, ask, param):
    app, server = gateway
    theirs, _ = stored(store_fleet, server, GLOBEX_KEY)
    before = received(store_fleet)
    answer = ask(server, theirs)
    assert_refused_cleanly(
        answer, 404, "response_not_found", param, store_fleet, before, app, server
    )


@pytest.mark.parametrize(("ask", "param"), ASKS)
def test_an_id_whose_engine_left_the_fleet_is_404(store_fleet, gateway, start_gateway, ask, param):
    _, first = gateway
    response_id, home = stored(store_fleet, first)
    app, server = start_gateway(config([store_fleet.urls[1 - home]]))  # a gateway without it
    before = received(store_fleet)
    answer = ask(server, response_id)
    assert_refused_cleanly(
        answer, 404, "response_not_found", param, store_fleet, before, app, server
    )


def test_an_id_serves_on_another_gateway_with_the_same_engines(store_fleet, gateway, start_gateway):
    """No state in the gateway: a replica (or a restart, or a reload) that knows the engine by
    its URL serves it, whatever it calls it (the engines listed the other way round)."""
    _, first = gateway
    response_id, _ = stored(store_fleet, first)
    _, other = start_gateway(config(list(reversed(store_fleet.urls))))
    assert retrieve(other, response_id).json()["id"] == response_id


def _mark(app: GatewayApp, server: ServerThread, url: str, **state: Any) -> None:
    async def mark() -> None:
        [endpoint] = [e for e in app.fleet.endpoints if e.url == url]
        for name, value in state.items():
            setattr(endpoint, name, value)
        app.fleet.refresh()

    server.call(mark())


@pytest.mark.parametrize(("ask", "param"), ASKS)
def test_an_id_whose_engine_is_unhealthy_is_503(store_fleet, gateway, ask, param):
    app, server = gateway
    response_id, home = stored(store_fleet, server)
    _mark(app, server, store_fleet.urls[home], healthy=False)
    before = received(store_fleet)
    answer = ask(server, response_id)
    assert_refused_cleanly(
        answer, 503, "stored_response_unavailable", None, store_fleet, before, app, server
    )
    assert answer.headers["retry-after"] == "1"


def test_a_drained_engine_answers_for_what_it_stores_but_continues_nothing(store_fleet, gateway):
    app, server = gateway
    response_id, home = stored(store_fleet, server)
    _mark(app, server, store_fleet.urls[home], drained=True)
    assert retrieve(server, response_id).status_code == 200
    before = received(store_fleet)
    answer = continuation(server, response_id)
    assert_refused_cleanly(
        answer, 503, "stored_response_unavailable", None, store_fleet, before, app, server
    )


def test_a_draining_gateway_refuses_the_id_routes_as_it_refuses_new_requests(store_fleet, gateway):
    app, server = gateway
    response_id, _ = stored(store_fleet, server)

    async def drain() -> None:
        app.begin_drain(60)

    server.call(drain())
    before = received(store_fleet)
    answer = retrieve(server, response_id)
    assert_refused_cleanly(answer, 503, "draining", None, store_fleet, before, app, server)


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS"])
def test_a_method_the_gateway_does_not_forward_is_405(store_fleet, gateway, method):
    _, server = gateway
    response_id, _ = stored(store_fleet, server)
    before = received(store_fleet)
    answer = httpx.request(method, f"{server.url}/v1/responses/{response_id}")
    assert answer.status_code == 405
    assert answer.headers["allow"] == "GET, POST, DELETE, PUT, PATCH"
    assert received(store_fleet) == before


def test_a_continuation_for_a_model_its_engine_does_not_serve_is_400(store_fleet, gateway):
    """The conversation continues only on the engine that stores it: a model that engine does
    not serve is refused by name, not sent there to come back "does not exist"."""
    app, server = gateway
    first = create(server)
    assert first.status_code == 200, first.text
    before = received(store_fleet)
    answer = create(server, model="other-model", previous_response_id=first.json()["id"])
    assert_refused_cleanly(answer, 400, "invalid_value", "model", store_fleet, before, app, server)
    assert "sim-model" in answer.json()["error"]["message"]


def test_a_previous_response_id_that_is_not_a_string_is_400(store_fleet, gateway):
    app, server = gateway
    before = received(store_fleet)
    answer = create(server, previous_response_id=7)
    assert_refused_cleanly(
        answer, 400, "invalid_type", "previous_response_id", store_fleet, before, app, server
    )


@pytest.mark.parametrize(
    ("engine_id", "code", "param"),
    [
        ("..", "unknown_response_id", "response_id"),
        (".", "unknown_response_id", "response_id"),
        ("%2e%2e", "unknown_response_id", "response_id"),
        ("a/..", "unknown_url", None),  # its encoded `/` splits the id
    ],
)
def test_a_made_id_whose_engine_part_is_a_path_step_is_404(
    store_fleet, gateway, engine_id, code, param
):
    """Without `response_id_secret` anyone can make a token for an engine id: one that is `..`
    (or holds a `/`) would put a path step into the engine's path after the id's prefix."""
    app, server = gateway
    made = client_id(engine_id, "acme", store_fleet.urls[0])
    before = received(store_fleet)
    answer = raw_post(server, f"/v1/responses/{quote(made, safe='')}/reset_prefix_cache")
    assert_refused_cleanly(answer, 404, code, param, store_fleet, before, app, server)


@pytest.mark.parametrize(
    "subpath",
    [
        "/../../../reset_prefix_cache",
        "/cancel/..",
        "/./cancel",
        "/%2e%2e/%2E%2E/%2e%2e/reset_prefix_cache",
        "/..%2F..%2F..%2Freset_prefix_cache",
        "%2F..",
    ],
)
def test_a_subpath_that_could_leave_the_ids_routes_is_404(store_fleet, gateway, subpath):
    """A hop that normalises paths would turn `/v1/responses/{id}/../../../x` into `/x`, sent
    with the gateway's engine key: no `.` or `..` segment, literal or encoded, and no encoded
    `/` reaches an engine."""
    app, server = gateway
    response_id, _ = stored(store_fleet, server)
    before = received(store_fleet)
    answer = raw_post(server, f"/v1/responses/{response_id}{subpath}")
    assert_refused_cleanly(answer, 404, "unknown_url", None, store_fleet, before, app, server)
