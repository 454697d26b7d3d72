"""Waiting for capacity: class order, fair shares, bounds, deadlines, disconnects, and that every
slot, reservation and queue entry comes back to zero."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import yaml

from kvgate.chain.queues import AdmissionQueue, Waiter
from kvgate.chain.settings import DEFAULT_TIERS, TenantConfig
from kvgate.chain.tenants import build_tenant
from kvgate.ingress import request_context
from tests.chain.helpers import IDLE, admission_state, make_key, tenant
from tests.conftest import gateway_config
from tests.metrics_text import sample_value

LANES = {
    "rules": [
        {"name": "batch", "when": {"headers": {"x-lane": "batch"}}, "then": {"class": "batch"}},
        {"name": "fast", "when": {"headers": {"x-lane": "fast"}}, "then": {"class": "interactive"}},
    ]
}


def _saturating_config(url: str, **overrides: Any) -> dict[str, Any]:
    """One endpoint that takes one request at a time: everything else waits in the gateway."""
    config = gateway_config(
        [url],
        pool={"models": ["m1"], "endpoints": [{"url": url, "max_inflight": 1}]},
        auth="none",
        classification=LANES,
    )
    config.update(overrides)
    return config


def _body(tag: str, stream: bool = True) -> dict[str, Any]:
    return {"model": "m1", "stream": stream, "messages": [{"role": "user", "content": tag}]}


async def _until(predicate, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _tags(engine) -> list[str]:
    return [r.body["messages"][0]["content"] for r in engine.inference_requests]


def test_waiting_requests_run_in_class_order(upstream, start_gateway):
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 4, 0.15
    app, server = start_gateway(_saturating_config(up.url))
    url = server.url + "/v1/chat/completions"

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:

            def post(tag: str, lane: str) -> asyncio.Task[httpx.Response]:
                return asyncio.ensure_future(
                    client.post(url, json=_body(tag), headers={"x-lane": lane})
                )

            hold = post("hold", "batch")
            await _until(lambda: len(engine.inference_requests) == 1)
            batch = post("batch", "batch")
            await _until(lambda: len(app.admission.queue) == 1)
            standard = post("standard", "none")
            await _until(lambda: len(app.admission.queue) == 2)
            fast = post("fast", "fast")
            await _until(lambda: len(app.admission.queue) == 3)
            return list(await asyncio.gather(hold, batch, standard, fast))

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 4
    assert _tags(engine) == ["hold", "fast", "standard", "batch"]
    assert admission_state(app, server) == IDLE


def test_disconnect_while_queued_removes_the_entry_at_once(upstream, start_gateway):
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 4, 0.3
    app, server = start_gateway(_saturating_config(up.url))
    url = server.url + "/v1/chat/completions"

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=20) as client:
            hold = asyncio.ensure_future(client.post(url, json=_body("hold")))
            await _until(lambda: len(engine.inference_requests) == 1)
            async with httpx.AsyncClient(timeout=20) as leaver:
                gone = asyncio.ensure_future(leaver.post(url, json=_body("gone")))
                await _until(lambda: len(app.admission.queue) == 1)
                gone.cancel()
            await _until(lambda: len(app.admission.queue) == 0, within=1.0)
            assert app.admission.quotas.outstanding()[0] <= 1  # only the running one
            assert (await hold).status_code == 200

    asyncio.run(scenario())
    assert _tags(engine) == ["hold"]
    assert admission_state(app, server) == IDLE


def test_full_queue_sheds_the_lowest_class_first(upstream, start_gateway):
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 4, 0.15
    app, server = start_gateway(_saturating_config(up.url, admission={"max_queued": 1}))
    url = server.url + "/v1/chat/completions"

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:

            def post(tag: str, lane: str) -> asyncio.Task[httpx.Response]:
                return asyncio.ensure_future(
                    client.post(url, json=_body(tag), headers={"x-lane": lane})
                )

            hold = post("hold", "fast")
            await _until(lambda: len(engine.inference_requests) == 1)
            batch = post("batch", "batch")
            await _until(lambda: len(app.admission.queue) == 1)
            fast = post("fast", "fast")
            displaced = await batch
            late_batch = await post("late-batch", "batch")
            return [await hold, displaced, await fast, late_batch]

    hold, displaced, fast, late_batch = asyncio.run(scenario())
    assert hold.status_code == fast.status_code == 200
    assert displaced.status_code == 503
    assert displaced.json()["error"]["code"] == "displaced"
    assert displaced.json()["error"]["type"] == "server_error"
    assert int(displaced.headers["retry-after"]) >= 1
    assert late_batch.status_code == 503
    assert late_batch.json()["error"]["code"] in ("queue_full", "displaced")
    assert _tags(engine) == ["hold", "fast"]
    assert admission_state(app, server) == IDLE
    metrics = httpx.get(server.url + "/metrics").text
    assert 'kvgate_admission_shed_total{class="batch",reason="displaced"} 1.0' in metrics


def test_queue_wait_limit_and_unmeetable_deadline_are_503(upstream, start_gateway):
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 4, 0.3
    classification = {**LANES, "classes": {"batch": {"deadline": 60, "max_queue_wait": 0.2}}}
    app, server = start_gateway(
        _saturating_config(up.url, classification=classification, admission={"initial_ttft": 5})
    )
    url = server.url + "/v1/chat/completions"

    # Meetable when it arrives, and no longer 0.3 s later, while the hold still runs: its
    # deadline ends the wait, not the class's 60 s.
    expiring = app.admission.predicted_duration("m1", 512) + 0.3

    async def scenario() -> tuple[httpx.Response, ...]:
        async with httpx.AsyncClient(timeout=20) as client:
            hold = asyncio.ensure_future(client.post(url, json=_body("hold")))
            await _until(lambda: len(engine.inference_requests) == 1)
            timed_out = await client.post(url, json=_body("slow"), headers={"x-lane": "batch"})
            unmeetable = await client.post(
                url, json=_body("tight"), headers={"x-kvgate-deadline": "3"}
            )
            expired = await client.post(
                url, json=_body("expiring"), headers={"x-kvgate-deadline": f"{expiring:.3f}"}
            )
            await hold
            return timed_out, unmeetable, expired

    timed_out, unmeetable, expired = asyncio.run(scenario())
    assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "queue_timeout"
    assert unmeetable.status_code == 503
    assert unmeetable.json()["error"]["code"] == "deadline_unmeetable"
    assert expired.status_code == 503
    assert expired.json()["error"]["code"] == "deadline_unmeetable", expired.json()
    assert _tags(engine) == ["hold"]
    assert admission_state(app, server) == IDLE


def test_a_policy_that_rejects_when_saturated_refuses_at_once(upstream, start_gateway, tmp_path):
    """`when_saturated: reject`: a request that finds every endpoint saturated gets 503
    `all_endpoints_saturated` at once instead of waiting in the gateway, reaches no engine and
    leaves nothing behind; once there is room it is served."""
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 4, 0.3
    policy = tmp_path / "reject.yaml"
    policy.write_text(yaml.safe_dump({"name": "reject", "when_saturated": "reject"}))
    config = _saturating_config(up.url)
    config["pools"][0]["policy"] = str(policy)
    app, server = start_gateway(config)
    url = server.url + "/v1/chat/completions"

    async def scenario() -> tuple[httpx.Response, bool]:
        async with httpx.AsyncClient(timeout=20) as client:
            hold = asyncio.ensure_future(client.post(url, json=_body("hold")))
            await _until(lambda: len(engine.inference_requests) == 1)
            refused = await client.post(url, json=_body("refused"))
            held_still = not hold.done()
            await hold
            return refused, held_still

    refused, held_still = asyncio.run(scenario())
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "all_endpoints_saturated"
    assert int(refused.headers["retry-after"]) >= 1
    assert held_still  # refused while the hold ran, not after waiting for its room
    assert _tags(engine) == ["hold"]
    assert admission_state(app, server) == IDLE
    assert httpx.post(url, json=_body("later"), timeout=20).status_code == 200


A_KEY, A_ENTRY = make_key("a-1")
B_KEY, B_ENTRY = make_key("b-1")


def test_tenant_concurrency_cap_waits_without_blocking_others(upstream, start_gateway):
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 4, 0.15
    app, server = start_gateway(
        gateway_config(
            [up.url],
            pool={"models": ["m1"]},
            auth={
                "tenants": [
                    tenant("a", "silver", [A_ENTRY], limits={"max_concurrent": 1}),
                    tenant("b", "silver", [B_ENTRY], limits={"max_concurrent": 1, "max_queued": 0}),
                ]
            },
        )
    )
    url = server.url + "/v1/chat/completions"

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:

            def post(key: str, tag: str) -> asyncio.Task[httpx.Response]:
                return asyncio.ensure_future(
                    client.post(url, json=_body(tag), headers={"authorization": f"Bearer {key}"})
                )

            first_a = post(A_KEY, "a1")
            await _until(lambda: len(engine.inference_requests) == 1)
            second_a = post(A_KEY, "a2")
            await _until(lambda: len(app.admission.queue) == 1)
            first_b = post(B_KEY, "b1")
            await _until(lambda: len(engine.inference_requests) == 2)
            second_b = await post(B_KEY, "b2")
            return [await first_a, await second_a, await first_b, second_b]

    a1, a2, b1, b2 = asyncio.run(scenario())
    assert a1.status_code == a2.status_code == b1.status_code == 200
    assert b2.status_code == 429 and b2.json()["error"]["code"] == "rate_limit_exceeded"
    assert "max_queued" in b2.json()["error"]["message"]
    assert _tags(engine) == ["a1", "b1", "a2"]
    assert admission_state(app, server) == IDLE


def test_a_wait_for_the_tenants_own_concurrency_that_times_out_is_a_429(upstream, start_gateway):
    """The fleet had room; the tenant's own max_concurrent held the request: the refusal is
    about its allowance (429, as every tenant limit), not the fleet's capacity (503)."""
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 4, 0.3
    app, server = start_gateway(
        gateway_config(
            [up.url],
            pool={"models": ["m1"]},
            auth={"tenants": [tenant("a", "silver", [A_ENTRY], limits={"max_concurrent": 1})]},
            classification={"classes": {"standard": {"deadline": 60, "max_queue_wait": 0.3}}},
        )
    )
    url = server.url + "/v1/chat/completions"
    headers = {"authorization": f"Bearer {A_KEY}"}

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:
            first = asyncio.ensure_future(client.post(url, json=_body("a1"), headers=headers))
            await _until(lambda: len(engine.inference_requests) == 1)
            second = await client.post(url, json=_body("a2"), headers=headers)
            return await first, second

    first, second = asyncio.run(scenario())
    assert first.status_code == 200
    assert second.status_code == 429 and "max_concurrent" in second.json()["error"]["message"]
    assert "retry-after" in second.headers
    assert _tags(engine) == ["a1"]
    assert admission_state(app, server) == IDLE


# --- the queue alone ------------------------------------------------------------------------


def _waiter(
    loop: asyncio.AbstractEventLoop,
    tier: str,
    name: str,
    rank: int = 2,
    deadline: float = 100.0,
    boost: float = 0.0,
    enqueued: float = 0.0,
    prefill: float = 0.0,
) -> Waiter:
    tenant_ = build_tenant(TenantConfig(name=name, tier=tier), DEFAULT_TIERS[tier], None)
    ctx = request_context("chat", {"model": "m1"})
    return Waiter(
        ctx=ctx,
        tenant=tenant_,
        key=("m1", None, None),
        rank=rank,
        deadline=deadline,
        boost=boost,
        enqueued=enqueued,
        future=loop.create_future(),
        prefill=prefill,
    )


async def test_weighted_fair_between_tenants_of_a_class():
    loop = asyncio.get_running_loop()
    queue = AdmissionQueue()
    for i in range(20):
        queue.push(_waiter(loop, "gold", "g", deadline=i))
        queue.push(_waiter(loop, "bronze", "b", deadline=i))
    served = [
        queue.pop_next(("m1", None, None), range(3), lambda t: True).tenant.name for _ in range(10)
    ]
    assert served.count("g") == 8 and served.count("b") == 2  # weights 4 : 1
    assert len(queue) == 30


async def test_edf_within_a_tenant_and_workflow_boost():
    loop = asyncio.get_running_loop()
    queue = AdmissionQueue()
    late = _waiter(loop, "silver", "t", deadline=50)
    early = _waiter(loop, "silver", "t", deadline=20)
    step_five = _waiter(loop, "silver", "t", deadline=30, boost=20)  # effective 10
    for waiter in (late, early, step_five):
        queue.push(waiter)
    order = [queue.pop_next(("m1", None, None), range(3), lambda t: True) for _ in range(3)]
    assert order == [step_five, early, late]


async def test_shortest_prefill_first_with_aging_and_deadlines():
    loop = asyncio.get_running_loop()
    queue = AdmissionQueue()
    long = _waiter(loop, "silver", "t", deadline=600, enqueued=0.0, prefill=2.0)  # start by 2.0
    short = _waiter(loop, "silver", "t", deadline=600, enqueued=0.5, prefill=0.1)  # by 0.6
    late_short = _waiter(loop, "silver", "t", deadline=600, enqueued=2.5, prefill=0.1)  # by 2.6
    urgent = _waiter(loop, "silver", "t", deadline=0.3, enqueued=1.0, prefill=1.0)  # by 0.3
    for waiter in (long, short, late_short, urgent):
        queue.push(waiter)
    order = [queue.pop_next(("m1", None, None), range(3), lambda t: True) for _ in range(4)]
    # The tight deadline first; then the short prefill ahead of the long one that came
    # earlier; the long one waited its own prefill time and goes before a later short one.
    assert order == [urgent, short, long, late_short]


def test_waiting_requests_start_shortest_prefill_first(upstream, start_gateway):
    engine, up = upstream
    engine.script.chunks, engine.script.gap = 4, 0.15
    app, server = start_gateway(
        _saturating_config(up.url, admission={"prefill_tokens_per_second": 1000})
    )
    url = server.url + "/v1/chat/completions"

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:

            def post(tag: str) -> asyncio.Task[httpx.Response]:
                return asyncio.ensure_future(client.post(url, json=_body(tag)))

            hold = post("hold")
            await _until(lambda: len(engine.inference_requests) == 1)
            long = post("long " + "x" * 8000)  # ≈ 2,000 tokens: 2 s of prefill at 1,000/s
            await _until(lambda: len(app.admission.queue) == 1)
            short = post("short")
            await _until(lambda: len(app.admission.queue) == 2)
            return list(await asyncio.gather(hold, long, short))

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 3
    assert [tag.split()[0] for tag in _tags(engine)] == ["hold", "short", "long"]
    assert admission_state(app, server) == IDLE


async def test_removed_waiters_are_skipped_and_shed_order():
    loop = asyncio.get_running_loop()
    queue = AdmissionQueue()
    gold_batch = _waiter(loop, "gold", "g", rank=2)
    bronze_batch = _waiter(loop, "bronze", "b", rank=2)
    bronze_fast = _waiter(loop, "bronze", "b", rank=0)
    for waiter in (gold_batch, bronze_batch, bronze_fast):
        queue.push(waiter)
    assert queue.shed_candidate() is bronze_batch
    assert queue.remove(bronze_batch) and not queue.remove(bronze_batch)
    assert queue.shed_candidate() is gold_batch
    assert queue.pop_next(("m1", None, None), range(3), lambda t: True) is bronze_fast
    assert queue.pop_next(("m1", None, None), range(3), lambda t: t.name != "g") is None
    assert len(queue) == 1


@pytest.mark.parametrize("lane", ["fast", "batch"])
def test_unsaturated_requests_do_not_wait(upstream, start_gateway, lane):
    _, up = upstream
    app, server = start_gateway(
        gateway_config([up.url], auth="none", classification=LANES, pool={"models": ["m1"]})
    )
    response = httpx.post(
        server.url + "/v1/chat/completions", json=_body("x", stream=False), headers={"x-lane": lane}
    )
    assert response.status_code == 200
    assert admission_state(app, server) == IDLE


def test_the_queue_length_has_a_sample_per_class_from_the_start(gateway):
    """Autoscalers read `kvgate_admission_queue_length`: a series absent until the first
    request waits would leave them without a metric after every restart."""
    _, server = gateway
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    for latency_class in ("interactive", "standard", "batch"):
        assert (
            sample_value(metrics, "kvgate_admission_queue_length", **{"class": latency_class}) == 0
        )


async def test_waiters_that_left_do_not_pile_up_behind_one_that_stays():
    """Requests that time out or disconnect while one long waiter heads the queue leave it:
    their contexts (and request bodies) are not kept until the head is served."""
    loop = asyncio.get_running_loop()
    queue = AdmissionQueue()
    head = _waiter(loop, "silver", "t", deadline=1.0)
    queue.push(head)
    for i in range(1_000):
        gone = _waiter(loop, "silver", "t", deadline=10.0 + i)
        queue.push(gone)
        queue.remove(gone)
    heap = queue._keys[("m1", None, None)][2].tenants["t"].heap
    assert len(queue) == 1 and len(heap) < 20
    assert queue.pop_next(("m1", None, None), range(3), lambda t: True) is head
