"""A stream cut after k tokens, continued with its own text, reproduces the full answer."""

import httpx
import orjson
import pytest

from kvgate.sim import EngineOptions, SimFleet

from .helpers import content_of, read_stream

MESSAGES = [
    {"role": "system", "content": "You are a storyteller."},
    {"role": "user", "content": "Tell me about the river and the stone."},
]


async def _first_tokens(client: httpx.AsyncClient, url: str, path: str, body: dict, k: int) -> str:
    """Stream `body` and hang up after `k` content chunks; return their text."""
    pieces = []
    async with client.stream("POST", f"{url}{path}", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                text = content_of(orjson.loads(line[6:]))
                if text:
                    pieces.append(text)
                if len(pieces) == k:
                    break
    assert len(pieces) == k
    return "".join(pieces)


@pytest.mark.parametrize("ignore_eos", [True, False])
async def test_chat_continuation_reproduces_the_uninterrupted_answer(ignore_eos):
    limits = {"max_tokens": 40, "ignore_eos": True} if ignore_eos else {}
    async with (
        SimFleet(2, options=EngineOptions(speed=50)) as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        full = await client.post(
            f"{fleet.urls[0]}/v1/chat/completions", json={"messages": MESSAGES, **limits}
        )
        full_text = full.json()["choices"][0]["message"]["content"]
        full_tokens = full.json()["usage"]["completion_tokens"]
        k = min(7, full_tokens // 2)
        partial = await _first_tokens(
            client, fleet.urls[0], "/v1/chat/completions", {"messages": MESSAGES, **limits}, k
        )
        continued_limits = {**limits, "max_tokens": 40 - k} if ignore_eos else {}
        # Continue on the other engine: the text depends only on the text so far.
        body = {
            "messages": [*MESSAGES, {"role": "assistant", "content": partial}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "stream": True,
            **continued_limits,
        }
        async with client.stream(
            "POST", f"{fleet.urls[1]}/v1/chat/completions", json=body
        ) as response:
            events, _ = await read_stream(response)
    assert k >= 2
    rest = "".join(content_of(event) for event in events)
    assert partial + rest == full_text
    if ignore_eos:
        assert full_tokens == 40


async def test_completion_continuation_with_prompt_plus_text():
    prompt = "Once upon a time, in a kingdom by the sea,"
    async with (
        SimFleet(1, options=EngineOptions(speed=50)) as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        url = fleet.urls[0]
        body = {"prompt": prompt, "max_tokens": 30, "ignore_eos": True}
        full_text = (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0][
            "text"
        ]
        partial = await _first_tokens(client, url, "/v1/completions", body, 11)
        rest = (
            await client.post(
                f"{url}/v1/completions",
                json={"prompt": prompt + partial, "max_tokens": 19, "ignore_eos": True},
            )
        ).json()["choices"][0]["text"]
    assert partial + rest == full_text


async def test_stop_strings_cut_the_text_and_report_the_reason():
    async with (
        SimFleet(1, options=EngineOptions(profile="fast")) as fleet,
        httpx.AsyncClient(timeout=30) as client,
    ):
        url = fleet.urls[0]
        base = {"prompt": "Write a list", "max_tokens": 200, "ignore_eos": True}
        text = (await client.post(f"{url}/v1/completions", json=base)).json()["choices"][0]["text"]
        stop = text[20:24]
        cut = (await client.post(f"{url}/v1/completions", json={**base, "stop": [stop]})).json()
        async with client.stream(
            "POST", f"{url}/v1/completions", json={**base, "stop": stop, "stream": True}
        ) as response:
            events, _ = await read_stream(response)
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["stop_reason"] == stop
    assert "".join(content_of(event) for event in events) == text[: text.index(stop)]
