"""The official OpenAI SDK, sync and async, through the gateway to a real upstream socket."""

from __future__ import annotations

import openai
import orjson
import pytest

from tests.chain.helpers import make_key, tenant
from tests.conftest import gateway_config
from tests.sdk_clients import sdk_client


def _client(server, **kw) -> openai.OpenAI:
    return sdk_client(base_url=server.url + "/v1", api_key="client-secret", max_retries=0, **kw)


def test_non_streaming_chat_completions_and_embeddings(upstream, gateway):
    engine, _ = upstream
    _, server = gateway
    client = _client(server)
    chat = client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "hello"
    assert chat.usage is not None and chat.usage.total_tokens == 6
    completion = client.completions.create(model="m1", prompt="once upon")
    assert completion.choices[0].text == "hello"
    embedding = client.embeddings.create(model="m1", input="x")
    assert embedding.data[0].embedding == [0.1, 0.2]
    assert [r.path for r in engine.inference_requests] == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
    ]


def test_embeddings_with_a_stream_field_are_answered_and_never_count_against_the_engine(
    upstream, gateway
):
    """Embeddings never stream: vLLM ignores a `stream` field there and answers JSON. The
    gateway passes the field through and relays that answer; expecting a stream instead made
    every such request a 502 and a failure of the endpoint, so a few of them opened its
    breaker."""
    engine, _ = upstream
    _, server = gateway
    client = _client(server)
    for _ in range(12):
        embedding = client.embeddings.create(model="m1", input="x", extra_body={"stream": True})
        assert embedding.data[0].embedding == [0.1, 0.2]
    assert [r.body.get("stream") for r in engine.inference_requests] == [True] * 12


def test_streaming_chat_with_usage(upstream, gateway):
    engine, _ = upstream
    engine.script.chunks = 4
    _, server = gateway
    stream = _client(server).chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 tok3 "
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert engine.inference_requests[0].body["stream_options"] == {"include_usage": True}


def test_streaming_completions(upstream, gateway):
    _, server = gateway
    stream = _client(server).completions.create(model="m1", prompt="abc", stream=True)
    assert len(list(stream)) == 3


async def test_async_client_streams(upstream, gateway):
    _, server = gateway
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    stream = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    contents = [c.choices[0].delta.content async for c in stream]
    assert contents == ["tok0 ", "tok1 ", "tok2 "]
    result = await client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}]
    )
    assert result.choices[0].message.content == "hello"
    await client.close()


def test_unknown_model_is_typed_not_found(upstream, gateway):
    engine, _ = upstream
    _, server = gateway
    with pytest.raises(openai.NotFoundError) as info:
        _client(server).chat.completions.create(
            model="gpt-secret", messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.body["code"] == "model_not_found"
    assert "127.0.0.1" not in info.value.message
    assert engine.inference_requests == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("status", "body", "exc"),
    [
        (
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 10 tokens",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
            openai.BadRequestError,
        ),
        (
            400,
            {
                "object": "error",
                "message": "flat shape: too long",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            openai.BadRequestError,
        ),
        (
            503,
            {
                "object": "error",
                "message": "queue full",
                "type": "ServiceUnavailable",
                "param": None,
                "code": 503,
            },
            openai.InternalServerError,
        ),
    ],
)
def test_upstream_errors_in_either_shape_become_typed_sdk_errors(
    upstream, gateway, status, body, exc, stream
):
    engine, _ = upstream
    engine.script.status = status
    engine.script.error_body = orjson.dumps(body)
    _, server = gateway
    with pytest.raises(exc) as info:
        _client(server).chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], stream=stream
        )
    assert info.value.status_code == status
    assert info.value.body["message"] == body.get("message", body.get("error", {}).get("message"))
    assert set(info.value.body) == {"message", "type", "param", "code"}


def test_round_robin_over_endpoints_serving_the_model(start_gateway):
    from tests.servers import ServerThread
    from tests.upstreams import ScriptedUpstream

    engines = [ScriptedUpstream(), ScriptedUpstream()]
    with ServerThread(engines[0]) as a, ServerThread(engines[1]) as b:
        _, server = start_gateway(gateway_config([a.url, b.url], pool={"policy": "round_robin"}))
        client = _client(server)
        for _ in range(6):
            client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
        assert [len(e.inference_requests) for e in engines] == [3, 3]


def test_an_inline_image_counts_one_media_estimate_against_the_tenants_quota(
    upstream, start_gateway
):
    """A megabyte of inline image is about a thousand prompt tokens to an engine, not the
    250,000 its bytes would be as text: a tenant with 5,000 tokens a minute is served, and the
    engine gets the image as the client sent it."""
    engine, engine_server = upstream
    key, entry = make_key("pix-1")
    auth = {"tenants": [tenant("pix", "gold", [entry], limits={"tokens_per_minute": 5000})]}
    _, server = start_gateway(gateway_config([engine_server.url], auth=auth))
    image = "data:image/png;base64," + "iVBORw0K" * 125_000
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": image}},
    ]
    client = sdk_client(base_url=server.url + "/v1", api_key=key, max_retries=0)
    chat = client.chat.completions.create(
        model="m1", max_tokens=16, messages=[{"role": "user", "content": content}]
    )
    assert chat.choices[0].message.content == "hello"
    assert engine.inference_requests[-1].body["messages"][0]["content"] == content
