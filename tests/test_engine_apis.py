"""The engines' own JSON APIs beside OpenAI's (tokenize, detokenize, rerank, score, classify,
pooling) through kvgate to simulated vLLM engines: each reaches an engine on the path the
client used and is answered as the engine answers; bad ones reach no engine and leave nothing
behind; tokenize and detokenize count no tokens against a tenant's quota."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim import EngineOptions, SimFleet
from kvgate.sim.engine_apis import Vocabulary
from tests.chain.helpers import IDLE, admission_state, make_key, tenant
from tests.conftest import gateway_config
from tests.responses_store_fleet import received
from tests.sdk_clients import sdk_client

pytestmark = pytest.mark.timeout(60)

KEY, ENTRY = make_key("acme-1")
MODEL = "sim-model"
LONG = "The river runs to the sea, and the sea is never full. " * 40  # ≈ 550 tokens
# (path, body) of one request to each API; the bodies name no model (added per request).
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/rerank", {"query": "rivers", "documents": ["a river", "a cat", "the sea"]}),
    ("/rerank", {"query": "rivers", "documents": ["a river", "a cat"], "top_n": 1}),
    ("/v2/rerank", {"query": "rivers", "documents": [{"text": "a river"}, "a cat"]}),
    ("/v1/score", {"text_1": "rivers", "text_2": ["a river", "a cat"]}),
    ("/score", {"text_1": ["rivers"], "text_2": ["a river"]}),
    ("/classify", {"input": ["what a good day", "awful"]}),
    ("/pooling", {"input": "pool me"}),
    ("/tokenize", {"prompt": "Hello, world"}),
]
# Fields an engine draws anew for every answer.
_FRESH = ("id", "created")


@pytest.fixture(scope="module")
def fleet() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as sim:
        yield sim


@pytest.fixture
def served(fleet, start_gateway) -> tuple[Any, Any]:
    """A gateway over both engines for one tenant with a small token quota (about two of
    `LONG`'s worth a minute)."""
    config = gateway_config(
        fleet.urls,
        pool={"models": [MODEL]},
        auth={"tenants": [tenant("acme", "gold", [ENTRY], limits={"tokens_per_minute": 1200})]},
    )
    return start_gateway(config)


def _post(server: Any, path: str, body: Any, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        headers["content-type"] = "application/json"
        return httpx.post(server.url + path, content=body, headers=headers, timeout=10)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=10)


def _without_fresh(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in _FRESH}


@pytest.mark.parametrize(("path", "body"), CALLS)
def test_each_api_reaches_an_engine_on_its_path_and_is_answered_as_the_engine_answers(
    fleet, served, path, body
):
    _, server = served
    body = {"model": MODEL, **body}
    through = _post(server, path, body)
    assert through.status_code == 200, through.text
    endpoint = through.headers["x-kvgate-endpoint"]
    engine = fleet.engines[int(endpoint.rsplit("-", 1)[1])]
    assert engine.stats()["last_request"]["path"] == path
    assert engine.stats()["last_request"]["body"] == body
    direct = httpx.post(fleet.urls[0] + path, json=body, timeout=10)
    assert _without_fresh(through.json()) == _without_fresh(direct.json())


def test_the_sdk_reaches_rerank_and_score_under_its_base_url(served):
    _, server = served
    client = sdk_client(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    ranked = client.post(
        "/rerank",
        body={"model": MODEL, "query": "rivers", "documents": ["a river", "a cat", "the sea"]},
        cast_to=object,
    )
    scores = [result["relevance_score"] for result in ranked["results"]]
    assert sorted(r["index"] for r in ranked["results"]) == [0, 1, 2]
    assert scores == sorted(scores, reverse=True)
    scored = client.post(
        "/score", body={"model": MODEL, "text_1": "q", "text_2": ["a", "b"]}, cast_to=object
    )
    assert [d["index"] for d in scored["data"]] == [0, 1]
    with pytest.raises(openai.NotFoundError):
        client.post(
            "/rerank", body={"model": "nope", "query": "q", "documents": ["d"]}, cast_to=object
        )


def test_a_chat_tokenized_through_the_gateway_detokenizes_back_to_its_rendered_prompt(
    fleet, served
):
    _, server = served
    messages = [{"role": "user", "content": "How long is the Nile?"}]
    body = {"model": MODEL, "messages": messages, "return_token_strs": True}
    tokens = _post(server, "/tokenize", body).json()
    direct = httpx.post(fleet.urls[1] + "/tokenize", json=body, timeout=10).json()
    assert tokens == direct and tokens["count"] == len(tokens["tokens"])
    text = _post(server, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "".join(tokens["token_strs"])}
    assert "How long is the Nile?" in text["prompt"]


def test_tokenize_and_detokenize_count_no_tokens_against_the_quota_the_others_do(served):
    app, server = served
    for _ in range(5):  # about 2,750 tokens of text: more than the minute's 1,200
        assert _post(server, "/tokenize", {"model": MODEL, "prompt": LONG}).status_code == 200
    ranked = [
        _post(server, "/v1/rerank", {"model": MODEL, "query": "q", "documents": [LONG]})
        for _ in range(3)
    ]
    assert [r.status_code for r in ranked][:2] == [200, 200]
    assert ranked[2].status_code == 429, ranked[2].text
    assert admission_state(app, server) == IDLE


def test_requests_are_counted_under_their_route_and_a_reranks_tokens_as_prompt_tokens(served):
    _, server = served
    _post(server, "/classify", {"model": MODEL, "input": "x"})
    _post(server, "/detokenize", {"model": MODEL, "tokens": []})
    ranked = _post(server, "/rerank", {"model": MODEL, "query": "q", "documents": ["a b c"]})
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(metrics) for s in f.samples]
    routes = {s.labels["route"] for s in samples if s.name == "kvgate_requests_total" and s.value}
    assert {"classify", "detokenize", "rerank"} <= routes
    [prompt] = [s.value for s in samples if s.name == "kvgate_prompt_tokens_total"]
    assert prompt == ranked.json()["usage"]["total_tokens"] + 1  # classify's "x": one token


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/rerank", {"query": "q", "documents": ["d"]}, 400, "model"),
        ("/tokenize", {"prompt": "hi"}, 400, "model"),
        ("/detokenize", {"model": 7, "tokens": [1]}, 400, "model"),
        ("/pooling", b"[1, 2]", 400, None),
        ("/score", b"{not json", 400, None),
        ("/classify", {"model": "not-served", "input": "x"}, 404, "model"),
    ],
)
def test_bad_requests_reach_no_engine_and_leave_nothing_behind(
    fleet, served, path, body, status, param
):
    app, server = served
    before = received(fleet)
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert received(fleet) == before
    assert admission_state(app, server) == IDLE


def test_an_unknown_key_is_refused_before_any_engine(fleet, served):
    _, server = served
    before = received(fleet)
    response = _post(server, "/tokenize", {"model": MODEL, "prompt": "hi"}, key="sk-wrong")
    assert response.status_code == 401
    assert received(fleet) == before


def test_get_on_an_engine_api_is_405(served):
    _, server = served
    response = httpx.get(server.url + "/v1/rerank", timeout=10)
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_the_simulators_vocabulary_stops_growing_at_its_limit(monkeypatch):
    monkeypatch.setattr("kvgate.sim.engine_apis.VOCABULARY_LIMIT", 3)
    vocabulary = Vocabulary()
    vocabulary.learn(["a", "b", "c", "d"], [1, 2, 3, 4])
    assert len(vocabulary) == 3 and vocabulary.text([1, 2, 3]) == "abc"


def test_admin_explain_takes_the_engine_apis_paths(fleet, start_gateway):
    _, server = start_gateway(gateway_config(fleet.urls, pool={"models": [MODEL]}))
    ranked = httpx.post(
        server.url + "/admin/explain/v1/rerank",
        json={"model": MODEL, "query": "abcd", "documents": ["efgh"]},
        timeout=10,
    )
    assert ranked.status_code == 200, ranked.text
    assert ranked.json()["intent"]["estimated_prompt_tokens"] == 2
    assert ranked.json()["intent"]["max_tokens"] == 0
    tokenized = httpx.post(
        server.url + "/admin/explain/tokenize", json={"model": MODEL, "prompt": LONG}, timeout=10
    )
    assert tokenized.json()["intent"]["estimated_prompt_tokens"] == 0
