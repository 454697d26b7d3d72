"""Every bad input gets a clear OpenAI-shaped error, reaches no engine and leaves nothing behind."""

from __future__ import annotations

import gzip
import json
import logging
import socket

import httpx
import orjson
import pytest

from tests.conftest import gateway_config
from tests.metrics_text import sample_value

CHAT_URL = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _assert_openai_error(
    response: httpx.Response, status: int, param: str | None = None, inference: bool = True
):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    if inference:
        assert response.headers["x-request-id"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT_URL, b"{not json", None),
        (CHAT_URL, b"[1, 2]", None),
        (CHAT_URL, b'{"messages": []}', "model"),
        (CHAT_URL, b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "model"),
        # Echoed in the 404 and written to every log line: no served name is that long.
        (
            CHAT_URL,
            b'{"model": "' + b"m" * 1025 + b'", "messages": [{"role": "user", "content": "x"}]}',
            "model",
        ),
        (CHAT_URL, b'{"model": "m1"}', "messages"),
        (CHAT_URL, b'{"model": "m1", "messages": []}', "messages"),
        (CHAT_URL, b'{"model": "m1", "messages": "hi"}', "messages"),
        (CHAT_URL, b'{"model": "m1", "messages": ["hi"]}', "messages[0]"),
        (CHAT_URL, b'{"model": "m1", "messages": [{"content": "hi"}]}', "messages[0].role"),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            "stream",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
            "max_tokens",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            "max_tokens",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], "n": true}',
            "n",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], '
            b'"stream_options": {"include_usage": true}}',
            "stream_options",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": true, '
            b'"stream_options": {"include_usage": "yes"}}',
            "stream_options.include_usage",
        ),
        (CHAT_URL, b'{"model": "m1", "messages": [{"role": "user"}]}', "messages[0].content"),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": 7, "content": "x"}]}',
            "messages[0].role",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "", "content": "x"}]}',
            "messages[0].role",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "user", "content": {"a": 1}}]}',
            "messages[0].content",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "system", "content": "s"}, '
            b'{"role": "user", "content": [{"text": "no type"}]}]}',
            "messages[1].content[0].type",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "user", "content": '
            b'[{"type": "image_url", "image_url": {"detail": "low"}}]}]}',
            "messages[0].content[0].image_url.url",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "assistant", "content": null}]}',
            "messages[0].content",
        ),
        (
            CHAT_URL,
            b'{"model": "m1", "messages": [{"role": "tool", "content": "42"}]}',
            "messages[0].tool_call_id",
        ),
        ("/v1/completions", b'{"model": "m1"}', "prompt"),
        ("/v1/completions", b'{"model": "m1", "prompt": {"a": 1}}', "prompt"),
        ("/v1/completions", b'{"model": "m1", "prompt": [1, "a"]}', "prompt"),
        ("/v1/completions", b'{"model": "m1", "prompt": []}', "prompt"),
        ("/v1/embeddings", b'{"model": "m1"}', "input"),
    ],
)
def test_invalid_bodies_are_400_naming_the_field(upstream, gateway, path, body, param):
    engine, _ = upstream
    app, server = gateway
    response = httpx.post(
        server.url + path, content=body, headers={"content-type": "application/json"}
    )
    _assert_openai_error(response, 400, param)
    assert engine.inference_requests == []
    assert app.fleet.endpoints[0].inflight == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # vLLM's prompt embeddings stand for the prompt (its own tests send prompt=None).
        ("/v1/completions", {"model": "m1", "prompt": None, "prompt_embeds": "AAAA"}),
        ("/v1/completions", {"model": "m1", "prompt_embeds": ["AAAA", "BBBB"]}),
        # vLLM's chat embeddings: messages in place of input.
        ("/v1/embeddings", {"model": "m1", "messages": MSGS}),
        # Roles of the model's chat template beyond OpenAI's: vLLM passes them on.
        (
            CHAT_URL,
            {
                "model": "m1",
                "messages": [
                    {"role": "system", "content": "Environment: ipython"},
                    {"role": "user", "content": "2+2?"},
                    {"role": "ipython", "content": "4"},
                    {"role": "document", "content": None},
                ],
            },
        ),
        # An assistant's tool call with no content parts: as no content, which it may have.
        (
            CHAT_URL,
            {
                "model": "m1",
                "messages": [
                    {"role": "user", "content": "weather?"},
                    {
                        "role": "assistant",
                        "content": [],
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "weather", "arguments": "{}"},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                ],
            },
        ),
        # Whole floats are integers to vLLM (`json.dumps` writes a computed budget so).
        (
            CHAT_URL,
            {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 512.0},
        ),
        (CHAT_URL, {"model": "m1", "messages": [{"role": "user", "content": "x"}], "n": 1.0}),
        # A completion that echoes its prompt and generates nothing (OpenAI's and vLLM's).
        ("/v1/completions", {"model": "m1", "prompt": "x", "echo": True, "max_tokens": 0}),
        # Empty `stream_options` without streaming: vLLM refuses only options that say
        # something.
        (
            CHAT_URL,
            {"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream_options": {}},
        ),
        # A media part without `type`: vLLM takes the type from its key.
        (
            CHAT_URL,
            {
                "model": "m1",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"image_url": "http://example.com/a.png"},
                            {"type": "text", "text": "describe"},
                        ],
                    }
                ],
            },
        ),
    ],
)
def test_vllm_extension_bodies_reach_the_engine_untouched(upstream, gateway, path, body):
    engine, _ = upstream
    _, server = gateway
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == 200, response.text
    assert engine.inference_requests[-1].body == body


def test_a_user_message_with_no_content_parts_is_a_value_error(upstream, gateway):
    """The type is right (an array); it is empty, which only a message that may go without
    content (an assistant's tool call) may be."""
    engine, _ = upstream
    _, server = gateway
    body = {"model": "m1", "messages": [{"role": "user", "content": []}]}
    response = httpx.post(server.url + CHAT_URL, json=body)
    assert _assert_openai_error(response, 400, "messages[0].content")["code"] == "invalid_value"
    assert engine.inference_requests == []


@pytest.mark.parametrize(
    ("path", "field", "value", "code"),
    [
        (CHAT_URL, "max_tokens", "9", "invalid_type"),
        (CHAT_URL, "max_tokens", True, "invalid_type"),
        (CHAT_URL, "max_tokens", 0, "invalid_value"),
        (CHAT_URL, "max_completion_tokens", 2.5, "invalid_type"),
        (CHAT_URL, "n", -1, "invalid_value"),
        ("/v1/completions", "n", "2", "invalid_type"),
        ("/v1/completions", "max_tokens", 0, "invalid_value"),  # 0 only with echo
        (CHAT_URL, "max_tokens", 2**63, "invalid_value"),  # past what an engine reads
        (CHAT_URL, "n", 1e21, "invalid_value"),
        ("/v1/responses", "max_output_tokens", "5", "invalid_type"),
        ("/v1/responses", "max_output_tokens", 0, "invalid_value"),
    ],
)
def test_a_count_of_the_wrong_type_and_one_out_of_range_get_their_own_codes(
    upstream, gateway, path, field, value, code
):
    engine, _ = upstream
    _, server = gateway
    carrier = {
        CHAT_URL: {"messages": MSGS},
        "/v1/completions": {"prompt": "x"},
        "/v1/responses": {"input": "x"},
    }[path]
    response = httpx.post(server.url + path, json={"model": "m1", **carrier, field: value})
    assert _assert_openai_error(response, 400, field)["code"] == code
    assert engine.inference_requests == []


def test_every_shape_openai_allows_reaches_the_engine_untouched(upstream, gateway):
    engine, _ = upstream
    _, server = gateway
    body = {
        "model": "m1",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                    {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "function", "name": "f", "content": None},
        ],
        "some_engine_extension": {"kept": [1, 2, 3]},
    }
    response = httpx.post(server.url + CHAT_URL, json=body)
    assert response.status_code == 200, response.text
    assert engine.inference_requests[-1].body == body
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        completion = {"model": "m1", "prompt": prompt}
        assert httpx.post(server.url + "/v1/completions", json=completion).status_code == 200
        assert engine.inference_requests[-1].body == completion


def test_body_over_limit_by_content_length_is_413(upstream, start_gateway):
    engine, upstream_server = upstream
    _, server = start_gateway(
        gateway_config([upstream_server.url], server={"max_body_bytes": 1000})
    )
    big = b'{"model": "m1", "messages": [{"role": "user", "content": "' + b"x" * 2000 + b'"}]}'
    response = httpx.post(server.url + CHAT_URL, content=big)
    _assert_openai_error(response, 413)
    assert engine.inference_requests == []


def test_a_compressed_body_is_415_and_no_encoding_header_reaches_the_engine(upstream, gateway):
    """Neither kvgate nor the engines decode a compressed body: it is refused by name, not
    read as broken JSON; an `identity` encoding passes and is not forwarded (the engine gets
    the bytes kvgate read, salted or not, never a header describing other bytes)."""
    engine, _ = upstream
    app, server = gateway
    body = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
    for encoding in ("gzip", "br", "deflate, gzip"):
        content = gzip.compress(body) if encoding == "gzip" else body
        response = httpx.post(
            server.url + CHAT_URL, content=content, headers={"content-encoding": encoding}
        )
        error = _assert_openai_error(response, 415)
        assert error["code"] == "unsupported_content_encoding"
        assert repr(encoding) in error["message"]
    assert engine.inference_requests == []
    assert app.fleet.endpoints[0].inflight == 0
    response = httpx.post(
        server.url + CHAT_URL, content=body, headers={"content-encoding": "identity"}
    )
    assert response.status_code == 200, response.text
    assert "content-encoding" not in engine.inference_requests[-1].headers


def test_chunked_body_over_limit_is_cut_off_with_413(upstream, start_gateway):
    engine, upstream_server = upstream
    app, server = start_gateway(
        gateway_config([upstream_server.url], server={"max_body_bytes": 1000})
    )

    def body():
        yield b'{"model": "m1", "messages": [{"role": "user", "content": "'
        for _ in range(50):
            yield b"x" * 100
        yield b'"}]}'

    response = httpx.post(server.url + CHAT_URL, content=body())
    _assert_openai_error(response, 413)
    assert engine.inference_requests == []
    assert app.fleet.endpoints[0].inflight == 0


def test_content_length_is_checked_before_the_body_is_sent(upstream, start_gateway):
    engine, upstream_server = upstream
    _, server = start_gateway(
        gateway_config([upstream_server.url], server={"max_body_bytes": 1000})
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
        )
        answer = conn.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413")
    assert engine.inference_requests == []


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_wrong_method_is_405(upstream, gateway, method):
    engine, _ = upstream
    _, server = gateway
    response = httpx.request(method, server.url + CHAT_URL)
    _assert_openai_error(response, 405)
    assert response.headers["allow"] == "POST"
    assert engine.inference_requests == []


def test_post_to_operational_route_is_405_and_unknown_route_404(gateway):
    _, server = gateway
    _assert_openai_error(httpx.post(server.url + "/v1/models"), 405, inference=False)
    error = _assert_openai_error(httpx.get(server.url + "/v1/unknown"), 404, inference=False)
    assert error["code"] == "unknown_url"


def test_a_request_for_an_unknown_route_is_counted_and_logged(upstream, start_gateway, caplog):
    """As a proxy logs every request: a scan or a misdirected client shows in the access log
    and in `kvgate_requests_total` (route `unknown`), with the request id it was answered."""
    _, up = upstream
    _, server = start_gateway(gateway_config([up.url], server={"access_log": True}))
    with caplog.at_level(logging.INFO, logger="kvgate.access"):
        answer = httpx.get(server.url + "/wp-login.php", timeout=10)
    assert answer.status_code == 404
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    assert line == {
        "request_id": answer.headers["x-request-id"],
        "route": "unknown",
        "status": 404,
        "outcome": "unknown_url",
    }
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    labels = {"route": "unknown", "model": "_unknown", "status": "404", "outcome": "unknown_url"}
    assert sample_value(metrics, "kvgate_requests_total", **labels) == 1.0
