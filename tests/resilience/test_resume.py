"""Mid-stream resume (pool opt-in): a stream broken on one engine continues on another and the
client sees exactly the answer an uninterrupted engine gives."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from kvgate.sim import EngineOptions, SimFleet
from tests.resilience.helpers import chat, pool_config, stream_outcome

PROMPT = "Once upon a time, by the river,"


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=3, options=EngineOptions(profile="fast")) as sim:
        yield sim


def events(raw: bytes) -> list[dict]:
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


def reference(fleet: SimFleet, path: str, body: dict) -> tuple[str, dict]:
    """Text and usage of the uninterrupted answer, straight from a healthy engine."""
    answer = httpx.post(
        fleet.engines[2].url + path, json={**body, "stream": False}, timeout=20
    ).json()
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, answer["usage"]


def resumes(server_url: str, outcome: str) -> float:
    for line in httpx.get(server_url + "/metrics").text.splitlines():
        if line.startswith("kvgate_stream_resumes_total{") and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("usage", [False, True])
def test_chat_resume_is_identical_to_an_uninterrupted_answer(fleet, start_gateway, usage):
    _app, server = start_gateway(pool_config(fleet, pool={"resume": True}))
    body = chat(
        max_tokens=40,
        ignore_eos=True,
        stream=True,
        **({"stream_options": {"include_usage": True}} if usage else {}),
    )
    expected, expected_usage = reference(fleet, "/v1/chat/completions", body)
    fleet.engines[0].set_fault({"mode": "crash_after_tokens", "tokens": 7})
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=20)
    outcome, text = stream_outcome(response.content)
    assert (outcome, text) == ("complete", expected)
    assert resumes(server.url, "ok") == 1
    chunks = events(response.content)
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 1
    if usage:
        reported = chunks[-1]["usage"]
        assert reported["completion_tokens"] == expected_usage["completion_tokens"] == 40
        assert reported["prompt_tokens"] == expected_usage["prompt_tokens"]
    else:
        assert all("usage" not in c or c["usage"] is None for c in chunks)


def test_completions_resume_with_prompt_plus_text(fleet, start_gateway):
    _app, server = start_gateway(pool_config(fleet, pool={"resume": True}))
    body = {
        "model": "sim-model",
        "prompt": PROMPT,
        "max_tokens": 30,
        "ignore_eos": True,
        "stream": True,
    }
    expected, _ = reference(fleet, "/v1/completions", body)
    fleet.engines[0].set_fault({"mode": "crash_after_tokens", "tokens": 11})
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=20)
    assert stream_outcome(response.content) == ("complete", expected)
    assert resumes(server.url, "ok") == 1


def test_resume_after_a_malformed_event(fleet, start_gateway):
    _app, server = start_gateway(pool_config(fleet, pool={"resume": True}))
    body = chat(max_tokens=24, ignore_eos=True, stream=True)
    expected, _ = reference(fleet, "/v1/chat/completions", body)
    fleet.engines[0].set_fault({"mode": "malformed_sse", "tokens": 5})
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=20)
    assert stream_outcome(response.content) == ("complete", expected)


def test_at_most_one_resume_then_a_well_formed_error(fleet, start_gateway):
    app, server = start_gateway(pool_config(fleet, pool={"resume": True}))
    for engine in fleet.engines:
        engine.set_fault({"mode": "crash_after_tokens", "tokens": 4})
    response = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=20,
        json=chat(max_tokens=40, ignore_eos=True, stream=True),
    )
    outcome, text = stream_outcome(response.content)
    assert outcome == "error" and text  # what was relayed stays; the end is an error event
    assert resumes(server.url, "failed") == 1
    assert sum(e.stats()["requests_received"] for e in fleet.engines) == 2
    assert all(e.inflight == 0 for e in app.fleet.endpoints)


def test_the_requests_own_deadline_mid_stream_is_not_resumed(fleet, start_gateway):
    """The total deadline is the client's: a stream it cuts ends with `deadline_exceeded`,
    not with a resume that cannot start in time and an engine's timeout."""
    _app, server = start_gateway(pool_config(fleet, pool={"resume": True}))
    for engine in fleet.engines:
        engine.set_fault({"mode": "stall_after_tokens", "tokens": 3, "delay_ms": 5000})
    response = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=20,
        headers={"x-kvgate-timeout-ms": "1000"},
        json=chat(max_tokens=40, ignore_eos=True, stream=True),
    )
    last = events(response.content)[-1]
    assert last["error"]["code"] == "deadline_exceeded"
    assert resumes(server.url, "failed") == resumes(server.url, "ok") == 0


def test_ineligible_requests_are_not_resumed(fleet, start_gateway):
    _app, server = start_gateway(pool_config(fleet, pool={"resume": True}))
    fleet.engines[0].set_fault({"mode": "crash_after_tokens", "tokens": 4})
    response = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=20,
        json=chat(max_tokens=40, ignore_eos=True, stream=True, logprobs=True),
    )
    assert stream_outcome(response.content)[0] == "error"
    assert resumes(server.url, "ok") == 0
