"""Cross-origin requests from browsers (`server.cors`): off unless configured; preflights are
answered by the gateway alone; answers to allowed origins say so, to others they do not."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvgate.config import ConfigError, parse_config
from tests.conftest import gateway_config

pytestmark = pytest.mark.timeout(60)

PAGE = "https://chat.example.com"
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def _preflight(url: str, origin: str, method: str = "POST") -> httpx.Response:
    return httpx.options(
        url + "/v1/chat/completions",
        headers={
            "origin": origin,
            "access-control-request-method": method,
            "access-control-request-headers": "authorization, content-type, x-stainless-os",
        },
    )


def _sdk(url: str, origin: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, default_headers={"origin": origin}
    )


def test_without_cors_config_a_preflight_is_refused_and_answers_name_no_origin(upstream, gateway):
    engine, _ = upstream
    _, server = gateway
    preflight = _preflight(server.url, PAGE)
    assert preflight.status_code == 405
    assert preflight.json()["error"]["code"] == "method_not_allowed"
    assert "access-control-allow-origin" not in preflight.headers
    answer = _sdk(server.url, PAGE).chat.completions.with_raw_response.create(**CHAT)
    assert answer.http_response.status_code == 200
    assert "access-control-allow-origin" not in answer.headers
    assert len(engine.inference_requests) == 1


def test_a_configured_origin_is_answered_and_its_preflight_reaches_no_engine(
    upstream, start_gateway
):
    engine, upstream_server = upstream
    app, server = start_gateway(
        gateway_config(
            [upstream_server.url],
            server={"access_log": False, "cors": {"allow_origins": [PAGE], "max_age": 300}},
        )
    )
    preflight = _preflight(server.url, PAGE)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert preflight.headers["access-control-allow-methods"] == "GET, POST, DELETE"
    assert preflight.headers["access-control-allow-headers"] == (
        "authorization, content-type, x-stainless-os"
    )
    assert preflight.headers["access-control-max-age"] == "300"
    stranger = _preflight(server.url, "https://elsewhere.example.com")
    assert (stranger.status_code, stranger.text) == (400, "Disallowed CORS origin")
    assert "access-control-allow-origin" not in stranger.headers
    put = _preflight(server.url, PAGE, method="PUT")
    assert (put.status_code, put.text) == (400, "Disallowed CORS method")
    assert engine.received == [r for r in engine.received if r.path == "/v1/models"]
    assert app.fleet.endpoints[0].inflight == 0

    client = _sdk(server.url, PAGE)
    answer = client.chat.completions.with_raw_response.create(**CHAT)
    assert answer.headers["access-control-allow-origin"] == PAGE
    exposed = answer.headers["access-control-expose-headers"].split(", ")
    assert {"x-request-id", "x-kvgate-endpoint", "retry-after"} <= set(exposed)
    with client.chat.completions.with_streaming_response.create(**CHAT, stream=True) as stream:
        assert stream.headers["access-control-allow-origin"] == PAGE
        assert [c.choices[0].delta.content for c in stream.parse() if c.choices]
    models = httpx.get(server.url + "/v1/models", headers={"origin": PAGE})
    assert models.headers["access-control-allow-origin"] == PAGE

    other = _sdk(server.url, "https://elsewhere.example.com")
    answer = other.chat.completions.with_raw_response.create(**CHAT)
    assert answer.http_response.status_code == 200
    assert "access-control-allow-origin" not in answer.headers
    assert len(engine.inference_requests) == 3


def test_any_origin(upstream, start_gateway):
    _, upstream_server = upstream
    _, server = start_gateway(
        gateway_config([upstream_server.url], server={"cors": {"allow_origins": ["*"]}})
    )
    preflight = _preflight(server.url, "http://localhost:3000")
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    answer = _sdk(server.url, "http://localhost:3000").chat.completions.with_raw_response.create(
        **CHAT
    )
    assert answer.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize(
    ("origins", "problem"),
    [
        (["https://chat.example.com/"], "is not an origin"),
        (["chat.example.com"], "is not an origin"),
        (["https://*.example.com"], "is not an origin"),
        ([], "at least 1 item"),
    ],
)
def test_an_origin_the_browser_would_never_send_is_refused_at_load(origins, problem):
    with pytest.raises(ConfigError) as refused:
        parse_config(
            gateway_config(["http://127.0.0.1:9"], server={"cors": {"allow_origins": origins}})
        )
    assert any(problem in p and "server.cors.allow_origins" in p for p in refused.value.problems)
