"""One engine dies during a burst: nothing is lost. The retry budget stops retry storms on a
sick pool; it must not drop requests that can simply move from one dead engine to live ones.
A failure on every engine still fails fast, without amplification."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvgate.sim import EngineOptions, SimFleet
from tests.resilience.helpers import chat, pool_config, received, stream_outcome, wait_for


async def _burst(url: str, count: int) -> list[tuple[int, str]]:
    """`count` streamed requests sent at once: (status, outcome) of each."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one(i: int) -> tuple[int, str]:
            body = chat(f"burst {i}", max_tokens=8, stream=True)
            response = await client.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                return response.status_code, "refused"
            return response.status_code, stream_outcome(response.content)[0]

        return list(await asyncio.gather(*(one(i) for i in range(count))))


@pytest.mark.parametrize(
    ("engines", "count", "fault"),
    [
        (3, 30, {"mode": "reset_before_first_byte"}),
        (3, 30, {"mode": "refuse"}),
        (3, 30, {"mode": "http_error", "status": 503}),
        (8, 200, {"mode": "reset_before_first_byte"}),
    ],
)
def test_one_engine_dying_in_a_burst_loses_nothing(
    start_gateway, engines: int, count: int, fault: dict[str, Any]
):
    options = EngineOptions(profile="realistic", speed=4.0)
    with SimFleet.in_thread(engines=engines, options=options) as fleet:
        app, server = start_gateway(pool_config(fleet))
        fleet.engines[0].set_fault(fault)
        results = asyncio.run(_burst(server.url, count))
        assert results == [(200, "complete")] * count
        budget = app.resilience.budgets["default"]
        # The last bytes can reach a client just before its request's bookkeeping ends.
        wait_for(
            lambda: (
                all(e.inflight == 0 for e in app.fleet.endpoints)
                and budget.retries_inflight == 0
                and budget.active == 0
            )
        )


def test_a_storm_on_every_engine_is_not_amplified_by_the_exception(start_gateway):
    with SimFleet.in_thread(engines=3, options=EngineOptions(profile="fast")) as fleet:
        _, server = start_gateway(pool_config(fleet))
        for engine in fleet.engines:
            engine.set_fault({"mode": "http_error", "status": 503})
        before = received(fleet)
        results = asyncio.run(_burst(server.url, 60))
        assert {status for status, _ in results} == {503}
        assert (received(fleet) - before) / 60 <= 1.1
