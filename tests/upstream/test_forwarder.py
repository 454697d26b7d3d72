"""The Forwarder's retry and commit logic over a scripted in-process transport.

The transport here is a fake on purpose: these are unit tests of the decisions (which endpoint
next, when to stop, what the client gets after the commit point) and of the bookkeeping on
every path; the socket behaviour is covered by test_transport.py and the end-to-end suites.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from kvgate.config import Config, parse_config
from kvgate.errors import KvgateError, UpstreamError
from kvgate.ingress import request_context
from kvgate.routing.endpoints import Endpoint, Fleet, build_pool
from kvgate.routing.router import routable_candidates
from kvgate.types import Headers, RequestContext
from kvgate.upstream.forwarder import Forwarder
from kvgate.upstream.observer import NullObserver
from kvgate.upstream.resilience import Resilience
from kvgate.upstream.transport import ConnectFailed, ConnectionLost, TransportError
from tests.conftest import gateway_config

URLS = ["http://engine-0", "http://engine-1", "http://engine-2"]
DONE = b"data: [DONE]\n\n"


def event(text: str) -> bytes:
    delta = {"content": text}
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"delta": delta}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


@dataclass
class FakeResponse:
    """An engine's answer: `chunks` are relayed in order; an exception among them is raised
    there, as the transport raises a broken connection."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "text/event-stream"})
    chunks: list[bytes | TransportError] = field(default_factory=list)
    closed: bool = False

    async def iter_raw(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if isinstance(chunk, TransportError):
                raise chunk
            yield chunk

    async def read(self, limit: int | None = None) -> bytes:
        body = b"".join(c for c in self.chunks if isinstance(c, bytes))
        return body if limit is None else body[:limit]

    def close(self) -> None:
        self.closed = True


def stream(*chunks: bytes | TransportError) -> FakeResponse:
    return FakeResponse(chunks=list(chunks))


def failed(status: int) -> FakeResponse:
    body = orjson.dumps({"error": {"message": "engine says no", "code": status}})
    return FakeResponse(status, {"content-type": "application/json"}, [body])


class ScriptedTransport:
    """`open` answers each endpoint URL with its next scripted response (or raises it)."""

    def __init__(self, script: dict[str, list[FakeResponse | TransportError]]) -> None:
        self.script = script
        self.opened: list[str] = []
        self.responses: list[FakeResponse] = []

    async def open(
        self,
        url: str,
        headers: Headers,
        body: bytes,
        connect_timeout: float | None = None,
        method: bytes = b"POST",
    ) -> FakeResponse:
        endpoint = url.removesuffix("/v1/chat/completions")
        self.opened.append(endpoint)
        answer = self.script[endpoint].pop(0)
        if isinstance(answer, TransportError):
            raise answer
        self.responses.append(answer)
        return answer


class FirstRoutable:
    """Picks the first routable endpoint not tried yet (the real candidate filter)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def choose(self, ctx: RequestContext, exclude: Collection[Endpoint] = ()) -> Endpoint:
        return routable_candidates(self.fleet, ctx.model, exclude)[0]

    def refused(self, ctx: RequestContext, endpoint: Endpoint) -> None:
        """Records nothing when choosing, so nothing to forget."""


class Denials(NullObserver):
    def __init__(self) -> None:
        self.denied: list[str] = []

    def retry_denied(self, pool: str, reason: str) -> None:
        self.denied.append(reason)


@dataclass
class Rig:
    forwarder: Forwarder
    transport: ScriptedTransport
    fleet: Fleet
    resilience: Resilience
    observer: Denials
    sent: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent)

    def assert_released(self) -> None:
        """Nothing held on any path: no attempt in flight, every response closed, the retry
        budget back to rest."""
        assert [e.inflight for e in self.fleet.endpoints] == [0, 0, 0]
        assert all(r.closed for r in self.transport.responses)
        budget = self.resilience.budgets["default"]
        assert (budget.active, budget.retries_inflight) == (0, 0)


def rig(script: dict[str, list[FakeResponse | TransportError]], **resilience: Any) -> Rig:
    config: Config = parse_config(
        gateway_config(
            URLS,
            pool={"models": ["m"]},
            resilience={"retries": {"backoff_base": 0, "backoff_cap": 0}, **resilience},
        )
    )
    fleet = Fleet(build_pool(p, config.routing) for p in config.pools)
    observer = Denials()
    resilience_state = Resilience(config, fleet, observer)
    transport = ScriptedTransport(script)
    forwarder = Forwarder(
        transport,  # type: ignore[arg-type]
        config.timeouts,
        4096,
        resilience_state,
        FirstRoutable(fleet),
    )
    return Rig(forwarder, transport, fleet, resilience_state, observer)


def request(rig: Rig, stream: bool = True) -> RequestContext:
    payload = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    ctx = request_context("chat", payload, body=orjson.dumps(payload))
    ctx.endpoint = rig.fleet.endpoints[0]
    return ctx


@pytest.mark.parametrize(
    "first",
    [
        ConnectFailed("refused"),
        failed(503),
        stream(ConnectionLost("reset")),  # broke before the first event: not committed
    ],
    ids=["connect-failed", "503", "broken-before-first-event"],
)
async def test_a_failure_before_the_commit_point_is_retried_on_another_endpoint(first):
    r = rig({URLS[0]: [first], URLS[1]: [stream(event("a"), event("b"), DONE)]})
    ctx = request(r)
    await r.forwarder(ctx, r.send)
    assert r.transport.opened == URLS[:2]
    assert ctx.endpoint is r.fleet.endpoints[1] and ctx.attempts == 2
    assert [m["status"] for m in r.sent if m["type"] == "http.response.start"] == [200]
    assert r.body == event("a") + event("b") + DONE
    assert r.sent[-1]["more_body"] is False
    r.assert_released()


async def test_a_unary_answer_is_retried_and_relayed_whole():
    answer = FakeResponse(200, {"content-type": "application/json"}, [b'{"usage": {"a": 1}}'])
    r = rig({URLS[0]: [failed(502)], URLS[1]: [answer]})
    ctx = request(r, stream=False)
    await r.forwarder(ctx, r.send)
    assert r.transport.opened == URLS[:2]
    assert r.sent[0]["status"] == 200 and r.body == b'{"usage": {"a": 1}}'
    assert ctx.usage == {"a": 1}
    r.assert_released()


async def test_a_failure_after_the_commit_point_is_not_retried_and_ends_with_an_error_event():
    r = rig({URLS[0]: [stream(event("a"), ConnectionLost("reset"))], URLS[1]: [stream(DONE)]})
    ctx = request(r)
    await r.forwarder(ctx, r.send)
    assert r.transport.opened == URLS[:1]
    assert [m["status"] for m in r.sent if m["type"] == "http.response.start"] == [200]
    first, error = r.body.split(b"\n\n", 1)
    assert first + b"\n\n" == event("a")
    assert orjson.loads(error.removeprefix(b"data: "))["error"]["code"] == (
        "upstream_connection_lost"
    )
    assert DONE not in r.body and r.sent[-1]["more_body"] is False
    assert ctx.outcome == "upstream_connection_lost"
    r.assert_released()


async def test_a_spent_retry_budget_refuses_the_retry_with_the_last_error():
    spent = {"percent_of_active": 0, "min_concurrency": 0}
    r = rig({URLS[0]: [failed(503)], URLS[1]: [stream(DONE)]}, retry_budget=spent)
    ctx = request(r)
    with pytest.raises(UpstreamError) as raised:
        await r.forwarder(ctx, r.send)
    assert raised.value.status == 503
    assert r.transport.opened == URLS[:1] and r.sent == []
    assert r.observer.denied == ["budget"]
    r.assert_released()


async def test_attempts_stop_at_max_attempts():
    r = rig(
        {url: [failed(503)] for url in URLS},
        retries={"max_attempts": 2, "backoff_base": 0, "backoff_cap": 0},
    )
    with pytest.raises(UpstreamError):
        await r.forwarder(request(r), r.send)
    assert r.transport.opened == URLS[:2]
    assert r.observer.denied == ["attempts"]
    r.assert_released()


@pytest.mark.parametrize("first", [ConnectFailed("refused"), failed(503)])
async def test_a_pinned_request_is_never_retried_elsewhere(first):
    """It continues a stored conversation that only its endpoint holds."""
    r = rig({URLS[0]: [first], URLS[1]: [stream(event("a"), DONE)]})
    ctx = request(r)
    ctx.pinned = ctx.endpoint
    with pytest.raises(KvgateError):
        await r.forwarder(ctx, r.send)
    assert r.transport.opened == URLS[:1] and r.sent == []
    assert r.observer.denied == []
    r.assert_released()


async def test_an_error_that_is_not_retriable_goes_to_the_client_at_once():
    r = rig({URLS[0]: [failed(400)], URLS[1]: [stream(DONE)]})
    with pytest.raises(UpstreamError) as raised:
        await r.forwarder(request(r), r.send)
    assert raised.value.status == 400 and r.transport.opened == URLS[:1]
    r.assert_released()


async def test_a_client_that_goes_away_mid_stream_releases_everything():
    r = rig({URLS[0]: [stream(event("a"), event("b"), DONE)]})

    async def gone(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body") == event("b"):
            raise OSError("client disconnected")
        await r.send(message)

    with pytest.raises(OSError):
        await r.forwarder(request(r), gone)
    assert r.transport.opened == URLS[:1]
    r.assert_released()


async def test_every_endpoint_failing_ends_with_the_last_error():
    r = rig({URLS[0]: [ConnectFailed("x")], URLS[1]: [failed(502)], URLS[2]: [failed(504)]})
    with pytest.raises(KvgateError) as raised:
        await r.forwarder(request(r), r.send)
    assert r.transport.opened == URLS and raised.value.status == 504
    assert r.observer.denied == ["attempts"]
    r.assert_released()
