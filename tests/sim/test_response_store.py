"""The simulated engine's Responses API store, as vLLM keeps one: per engine process, off unless
enabled, bounded here, vLLM's errors for an unknown id, a continued conversation that grows
the prompt."""

import httpx
import pytest

from kvgate.sim import EngineOptions, SimFleet
from kvgate.sim.engine_core import EngineCore
from kvgate.sim.openai_api import ApiError
from kvgate.sim.response_store import ResponseStore
from kvgate.sim.responses_api import ResponseGeneration, parse_response_request
from kvgate.sim.stats import EngineCounters

OPTIONS = EngineOptions(profile="fast", responses_store=True)


def generation(keeper: ResponseStore, text: str, **body) -> ResponseGeneration:
    """A request parsed as the engine parses it, answered at once (the `fast` profile; on
    the running loop, as in the engine)."""
    request = {"model": "sim-model", "input": text, "max_output_tokens": 2, **body}
    parsed = parse_response_request(request, OPTIONS, 0.0, keeper)
    EngineCore(OPTIONS, EngineCounters()).submit(parsed.request)
    return parsed


async def test_the_store_keeps_the_newest_and_forgets_the_oldest():
    store = ResponseStore(enabled=True, capacity=2)
    kept = [generation(store, f"turn {i}") for i in range(3)]
    for g in kept:
        store.keep(g, created=0)
    ids = [g.request.request_id for g in kept]
    assert len(store) == 2 and ids[0] not in store and ids[1] in store and ids[2] in store
    with pytest.raises(ApiError) as unknown:
        store.get(ids[0])
    assert unknown.value.status == 404
    assert unknown.value.body("vllm") == {
        "error": {
            "message": f"Response with id '{ids[0]}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }


async def test_a_response_asked_not_to_be_stored_is_not():
    store = ResponseStore(enabled=True)
    store.keep(generation(store, "hi", store=False), created=0)
    assert len(store) == 0


async def test_ids_are_unique_per_engine():
    store = ResponseStore(enabled=True)
    assert len({generation(store, "same").request.request_id for _ in range(100)}) == 100


async def test_a_continuation_starts_with_the_stored_conversation():
    store = ResponseStore(enabled=True)
    first = generation(store, "Once upon a time", instructions="Be brief.")
    store.keep(first, created=0)
    second = generation(store, "go on", previous_response_id=first.request.request_id)
    assert second.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": "".join(first.request.output_tokens)},
        {"role": "user", "content": "go on"},
    ]
    assert len(second.request.prompt_tokens) > len(first.request.prompt_tokens)


async def test_with_the_store_off_nothing_is_kept_and_every_id_is_unknown():
    async with SimFleet(1, options=EngineOptions(profile="fast")) as fleet:
        url = fleet.urls[0]
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": "sim-model", "input": "hi", "max_output_tokens": 2}
            created = (await client.post("/v1/responses", json=body)).json()
            assert created["store"] is False
            unknown = await client.get(f"/v1/responses/{created['id']}")
            assert unknown.status_code == 404
            continued = await client.post(
                "/v1/responses", json={**body, "previous_response_id": created["id"]}
            )
            assert continued.status_code == 404
            background = await client.post("/v1/responses", json={**body, "background": True})
            assert background.status_code == 400
            assert "VLLM_ENABLE_RESPONSES_API_STORE" in background.json()["error"]["message"]
        assert fleet.engines[0].stats()["responses_stored"] == 0


async def test_an_engine_answers_only_for_what_it_stores():
    async with SimFleet(2, options=OPTIONS) as fleet:
        async with httpx.AsyncClient() as client:
            body = {"model": "sim-model", "input": "hi", "max_output_tokens": 2}
            created = (await client.post(fleet.urls[0] + "/v1/responses", json=body)).json()
            path = f"/v1/responses/{created['id']}"
            assert (await client.get(fleet.urls[0] + path)).json() == created
            assert (await client.get(fleet.urls[1] + path)).status_code == 404
            continued = {**body, "previous_response_id": created["id"]}
            assert (
                await client.post(fleet.urls[1] + "/v1/responses", json=continued)
            ).status_code == 404
        assert [e.stats()["responses_stored"] for e in fleet.engines] == [1, 0]
