"""A request's objects are freed by reference counting when it ends, never left to the cyclic
garbage collector: with the collector disabled, the RequestContext of every request is gone once
the request is over, on every way a request can end."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvgate.app import GatewayApp
from kvgate.config import parse_config
from kvgate.sim import EngineOptions, SimFleet
from kvgate.types import RequestContext
from tests.resilience.helpers import chat, pool_config, wait_for
from tests.sdk_clients import sdk_client
from tests.servers import ServerThread


@pytest.fixture
def fleet() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as sim:
        yield sim


def _unary(url: str) -> None:
    answer = sdk_client(base_url=url + "/v1", api_key="none").chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content


def _stream(url: str) -> None:
    chunks = sdk_client(base_url=url + "/v1", api_key="none").chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert any(chunk.choices and chunk.choices[0].delta.content for chunk in chunks)


def _post(url: str, body: dict[str, Any], status: int) -> bytes:
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=20)
    assert response.status_code == status, response.text
    return response.content


def _leave_mid_stream(url: str) -> None:
    body = chat(max_tokens=2000, ignore_eos=True, stream=True)
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as response:
        next(response.iter_raw())


def _leave_before_first_token(url: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=chat(stream=True), timeout=0.3)


@dataclass(frozen=True)
class Scenario:
    client: Callable[[str], object]
    pool: dict[str, Any] = field(default_factory=dict)
    fault_all: dict[str, Any] | None = None  # on both engines
    fault_first: dict[str, Any] | None = None  # on the first engine only
    traced: bool = False


def _broken_streams(url: str, count: int) -> None:
    for _ in range(count):
        _post(url, chat(max_tokens=20, ignore_eos=True, stream=True), 200)


def _answered(url: str, count: int) -> None:
    for _ in range(count):
        _post(url, chat(), 200)


CRASH = {"mode": "crash_after_tokens", "tokens": 3}
SCENARIOS = {
    "unary": Scenario(_unary),
    "stream": Scenario(_stream),
    "stream, traced": Scenario(_stream, traced=True),
    "refused by the chain": Scenario(lambda url: _post(url, chat(model="nope"), 404)),
    "engine error answered": Scenario(
        lambda url: _post(url, chat(), 400), fault_all={"mode": "http_error", "status": 400}
    ),
    "retried, then answered": Scenario(
        lambda url: _answered(url, 2), fault_first={"mode": "reset_before_first_byte"}
    ),
    "retried, then answered, traced": Scenario(
        lambda url: _answered(url, 2),
        fault_first={"mode": "reset_before_first_byte"},
        traced=True,
    ),
    "retries exhausted": Scenario(
        lambda url: _post(url, chat(), 503), fault_all={"mode": "http_error", "status": 503}
    ),
    "stream broken after the commit point": Scenario(
        lambda url: _broken_streams(url, 1), fault_all=CRASH
    ),
    "stream resumed": Scenario(
        lambda url: _broken_streams(url, 2), pool={"resume": True}, fault_first=CRASH
    ),
    "resume refused by the other engine": Scenario(
        lambda url: _broken_streams(url, 2),
        pool={"resume": True},
        fault_all={"mode": "http_error", "status": 503},
        fault_first=CRASH,
    ),
    "client gone mid-stream": Scenario(_leave_mid_stream),
    "client gone before the first token": Scenario(
        _leave_before_first_token, fault_all={"mode": "slow_first_token", "delay_ms": 5000}
    ),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_request_context_is_freed_without_the_cyclic_collector(
    fleet: SimFleet, scenario: str
) -> None:
    case = SCENARIOS[scenario]
    tracing = {"observability": {"tracing": {"exporter": "console"}}} if case.traced else {}
    app = GatewayApp(
        parse_config(pool_config(fleet, pool=case.pool, **tracing)),
        span_exporter=InMemorySpanExporter(),
    )
    with ServerThread(app) as server:
        _assert_freed_by_refcount(app, server.url, fleet, case)


def _assert_freed_by_refcount(app: GatewayApp, url: str, fleet: SimFleet, case: Scenario) -> None:
    contexts: list[weakref.ref[RequestContext]] = []
    settle = app.chain.settle

    def settle_and_watch(ctx: RequestContext) -> None:
        contexts.append(weakref.ref(ctx))
        settle(ctx)

    app.chain.settle = settle_and_watch
    for engine in fleet.engines:
        if case.fault_all is not None:
            engine.set_fault(case.fault_all)
    if case.fault_first is not None:
        fleet.engines[0].set_fault(case.fault_first)
    gc.collect()
    gc.disable()
    try:
        case.client(url)
        wait_for(lambda: bool(contexts) and all(e.inflight == 0 for e in app.fleet.endpoints))
        # The request's task returns just after settling; give it a moment.
        deadline = time.monotonic() + 2.0
        while any(ref() is not None for ref in contexts) and time.monotonic() < deadline:
            time.sleep(0.02)
        alive = [ref() for ref in contexts if ref() is not None]
        holders = {
            type(holder).__name__
            for ctx in alive
            for holder in gc.get_referrers(ctx)
            if holder is not alive
        }
        del alive
        assert not holders, f"contexts outlived their requests, held by {sorted(holders)}"
    finally:
        gc.enable()


@pytest.mark.parametrize("resume", [False, True])
def test_a_committed_stream_lets_go_of_its_prompt_unless_it_may_resume(
    fleet: SimFleet,
    start_gateway: Callable[[dict[str, Any]], tuple[GatewayApp, ServerThread]],
    resume: bool,
) -> None:
    app, server = start_gateway(pool_config(fleet, pool={"resume": resume, "policy": "kvgate"}))
    forwarded: list[RequestContext] = []
    forward = app.chain.forward

    async def keep_and_forward(ctx: RequestContext, send: Any) -> None:
        forwarded.append(ctx)
        await forward(ctx, send)

    app.chain.forward = keep_and_forward
    body = chat("a prompt long enough to be hashed " * 40, max_tokens=400, stream=True)
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, timeout=20
    ) as response:
        next(response.iter_raw())
        ctx = forwarded[0]
        assert ctx.prefix is not None and ctx.prefix.blocks > 1
        held = (
            bool(ctx.body),
            bool(ctx.payload),
            bool(ctx.view.canonical),
            bool(ctx.prefix.hashes),
        )
        assert held == (resume, resume, resume, resume)
        assert ctx.view.prompt_tokens == ctx.prefix.prompt_tokens > 100
