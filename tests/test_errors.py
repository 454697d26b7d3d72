"""Error bodies in OpenAI's vocabulary (docs/errors.md): types and codes as OpenAI returns them
for the same case, engines' errors translated, `code` a string or null, and no library class
names in any message."""

from __future__ import annotations

import re

import httpx
import openai
import orjson
import pytest

from kvgate.errors import (
    AuthenticationFailed,
    GatewayBug,
    NotFound,
    Overloaded,
    RateLimited,
    UpstreamUnavailable,
    upstream_error_from_body,
)
from tests.sdk_clients import sdk_client

VLLM_TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, you requested "
        "2100 tokens (2000 in the messages, 100 in the completion). Please reduce the length "
        "of the messages or completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}
SGLANG_TOO_LONG = {
    "object": "error",
    "message": "The input (5000 tokens) is longer than the model's context length (4096 tokens).",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
# Library class names look like this: two or more capitalised words run together.
CLASS_NAME = re.compile(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b")


def _wire(error) -> dict:
    return error.to_dict()["error"]


@pytest.mark.parametrize("body", [VLLM_TOO_LONG, SGLANG_TOO_LONG])
def test_an_engine_too_long_prompt_is_context_length_exceeded(body):
    error = _wire(upstream_error_from_body(400, orjson.dumps(body)))
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


VLLM_MAX_TOKENS_TOO_LARGE = {
    "error": {
        "message": "'max_tokens' or 'max_completion_tokens' is too large: 40000. This model's "
        "maximum context length is 32768 tokens and your request has 12 input tokens "
        "(40000 > 32768 - 12).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


def test_a_context_length_error_names_the_field_at_fault():
    """The engine's own `param` if it gave one; else the completion limit the message names;
    else the route's prompt field."""
    too_long = orjson.dumps(VLLM_TOO_LONG)
    assert _wire(upstream_error_from_body(400, too_long, None, "prompt"))["param"] == "prompt"
    limit = orjson.dumps(VLLM_MAX_TOKENS_TOO_LARGE)
    assert _wire(upstream_error_from_body(400, limit))["param"] == "max_tokens"
    named = {"error": {**VLLM_TOO_LONG["error"], "param": "input"}}
    assert _wire(upstream_error_from_body(400, orjson.dumps(named)))["param"] == "input"


def _engine(message: str, kind: str, code: object, **extra: object) -> dict:
    return {"error": {"message": message, "type": kind, "code": code, **extra}}


@pytest.mark.parametrize(
    ("status", "body", "wire_type", "code"),
    [
        (400, _engine("bad", "BadRequestError", 400), "invalid_request_error", None),
        (
            404,
            {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404},
            "invalid_request_error",
            "model_not_found",
        ),
        (500, _engine("boom", "InternalServerError", 500), "server_error", None),
        (503, {"detail": "overloaded"}, "server_error", None),
        (
            429,
            _engine("slow", "requests", "rate_limit_exceeded"),
            "requests",
            "rate_limit_exceeded",
        ),
        (
            400,
            _engine("no", "invalid_request_error", "invalid_value", param="top_p"),
            "invalid_request_error",
            "invalid_value",
        ),
    ],
)
def test_engine_errors_in_openai_vocabulary(status, body, wire_type, code):
    error = _wire(upstream_error_from_body(status, orjson.dumps(body)))
    assert (error["type"], error["code"]) == (wire_type, code)


def test_a_validation_error_of_a_fastapi_server_keeps_its_reasons():
    """A FastAPI server's 422 (`detail`: a list of `{loc, msg}`) says what was wrong and where."""
    detail = [
        {"type": "missing", "loc": ["body", "messages", 0, "content"], "msg": "Field required"},
        {"type": "int_parsing", "loc": ["body", "n"], "msg": "Input should be an integer"},
    ]
    error = _wire(upstream_error_from_body(422, orjson.dumps({"detail": detail})))
    assert error["message"] == ("messages.0.content: Field required; n: Input should be an integer")
    assert (error["param"], error["type"]) == ("messages.0.content", "invalid_request_error")
    odd = _wire(upstream_error_from_body(422, orjson.dumps({"detail": [1, 2]})))
    assert odd["message"] == "upstream returned HTTP 422"


def test_a_non_json_engine_error_keeps_its_text_and_a_null_code():
    error = _wire(upstream_error_from_body(502, b"<html>Bad Gateway</html>"))
    assert "Bad Gateway" in error["message"]
    assert (error["type"], error["code"]) == ("server_error", None)


def test_kvgate_errors_in_openai_vocabulary():
    assert _wire(RateLimited("x", code="requests_per_minute_exceeded"))["type"] == "requests"
    tokens = RateLimited("x", code="tokens_per_minute_exceeded")
    assert (_wire(tokens)["type"], _wire(tokens)["code"]) == ("tokens", "rate_limit_exceeded")
    assert tokens.code == "tokens_per_minute_exceeded"  # kvgate's reason, for logs and metrics
    missing = AuthenticationFailed("x", code="missing_api_key")
    assert (_wire(missing)["type"], _wire(missing)["code"]) == ("invalid_request_error", None)
    assert _wire(AuthenticationFailed("x"))["code"] == "invalid_api_key"
    assert _wire(NotFound("x", code="model_not_found"))["type"] == "invalid_request_error"
    assert _wire(GatewayBug("x")) == {
        "message": "x",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert _wire(Overloaded("x", code="queue_full"))["type"] == "server_error"
    assert _wire(UpstreamUnavailable("x"))["type"] == "server_error"


def test_engine_context_length_error_through_the_gateway_with_the_sdk(upstream, gateway):
    engine, _ = upstream
    engine.script.status = 400
    engine.script.error_body = orjson.dumps(VLLM_TOO_LONG)
    _, server = gateway
    client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert info.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m1", prompt="hi")
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def test_an_engines_own_codes_reach_the_client_but_not_the_metric_labels(upstream, gateway):
    """The client sees whatever code the engine sent; `kvgate_requests_total` and
    `kvgate_endpoint_requests_total` label it `upstream_error` unless kvgate knows the code,
    so an engine's free-form codes cannot add series without bound."""
    engine, _ = upstream
    engine.script.status = 422
    _, server = gateway
    client = sdk_client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for i in range(20):
        engine.script.error_body = orjson.dumps({"error": {"message": "no", "code": f"c{i}"}})
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
        assert info.value.code == f"c{i}"
    engine.script.status = 400
    engine.script.error_body = orjson.dumps(VLLM_TOO_LONG)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
    text = httpx.get(server.url + "/metrics", timeout=5).text
    outcomes = set(re.findall(r'kvgate_(?:endpoint_)?requests_total\{[^}]*outcome="([^"]+)"', text))
    assert outcomes == {"upstream_error", "context_length_exceeded"}


def test_a_broken_engine_connection_is_described_without_library_names(upstream, gateway):
    engine, _ = upstream
    engine.script.close_after_chunks = 1
    _, server = gateway
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=10,
    )
    last = orjson.loads(response.content.strip().split(b"\n\n")[-1][6:])["error"]
    assert last["code"] == "upstream_connection_lost" and last["type"] == "server_error"
    assert not CLASS_NAME.search(last["message"]), last["message"]
    assert "httptools" not in last["message"] and "asyncio" not in last["message"]


@pytest.mark.parametrize(("wait", "header"), [(0.2, b"1"), (2.0, b"2"), (2.1, b"3"), (20.6, b"21")])
def test_retry_after_rounds_the_wait_up(wait, header):
    """A client that waits the whole seconds it is told finds the room there: 2.1 s is 3."""
    assert RateLimited("limited", retry_after=wait).headers() == [(b"retry-after", header)]
