"""Health checks that cannot take down an endpoint that is serving: N failed probes in a row to
turn unhealthy, M good ones to come back, passive evidence over probes, and panic routing."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate.config import HealthConfig
from kvgate.routing.endpoints import Endpoint, Fleet, Pool
from kvgate.routing.health import HealthMonitor
from kvgate.sim import EngineOptions, SimFleet
from tests.resilience.helpers import chat, pool_config, wait_for


def _endpoint(name: str, pool: str = "p") -> Endpoint:
    return Endpoint(name, f"http://{name}", pool, "vllm", frozenset({"m"}))


def _monitor(fleet: Fleet, recovered: list[str] | None = None, **health: float) -> HealthMonitor:
    on_recovered = (lambda e: recovered.append(e.name)) if recovered is not None else None
    return HealthMonitor(
        fleet,
        httpx.AsyncClient(),  # never used: `judge` takes probe results as given
        HealthConfig.model_validate({"interval": 1.0, "timeout": 0.5, **health}),
        on_recovered=on_recovered,
    )


def test_unhealthy_after_n_failures_in_a_row_and_healthy_after_m_successes():
    endpoint = _endpoint("a")
    recovered: list[str] = []
    monitor = _monitor(Fleet([Pool("p", "vllm", "kvgate", [endpoint])]), recovered)
    assert monitor.judge(endpoint, True, now=100.0) is False  # first probe: healthy stays
    for ok in (False, False, True, False, False):  # a good probe resets the count
        assert monitor.judge(endpoint, ok, now=100.0) is False
    assert endpoint.healthy
    assert monitor.judge(endpoint, False, now=100.0) is True  # third failure in a row
    assert not endpoint.healthy
    assert monitor.judge(endpoint, True, now=100.0) is False  # one good probe is not enough
    assert monitor.judge(endpoint, False, now=100.0) is False
    assert monitor.judge(endpoint, True, now=100.0) is False
    assert monitor.judge(endpoint, True, now=100.0) is True
    assert endpoint.healthy and recovered == ["a"]


def test_thresholds_come_from_config_and_the_first_probe_decides_alone():
    endpoint = _endpoint("a")
    monitor = _monitor(
        Fleet([Pool("p", "vllm", "kvgate", [endpoint])]),
        unhealthy_threshold=1,
        healthy_threshold=3,
    )
    assert monitor.judge(endpoint, False, now=100.0) is True  # first probe: at once
    assert [monitor.judge(endpoint, True, now=100.0) for _ in range(3)] == [False, False, True]
    assert monitor.judge(endpoint, False, now=100.0) is True  # threshold 1
    fresh = _endpoint("b")
    assert _monitor(Fleet([Pool("p", "vllm", "kvgate", [fresh])])).judge(fresh, False, now=1.0)
    assert not fresh.healthy


def test_passive_evidence_wins_over_failed_probes():
    endpoint = _endpoint("a")
    monitor = _monitor(Fleet([Pool("p", "vllm", "kvgate", [endpoint])]))
    monitor.judge(endpoint, True, now=100.0)
    endpoint.last_success = 99.0  # an attempt succeeded within interval + timeout (1.5 s)
    for _ in range(5):
        assert monitor.judge(endpoint, False, now=100.0) is False
    assert endpoint.healthy
    endpoint.last_success = 98.0  # nothing succeeded since before the previous probe
    assert monitor.judge(endpoint, False, now=100.0) is True
    assert not endpoint.healthy


def test_passive_evidence_brings_an_unhealthy_endpoint_back_though_its_probes_fail():
    """Routed in panic, an endpoint whose /health hangs but whose answers succeed is serving:
    each failed probe with a success since the previous one counts as a good probe."""
    endpoint = _endpoint("a")
    monitor = _monitor(Fleet([Pool("p", "vllm", "kvgate", [endpoint])]))
    assert monitor.judge(endpoint, False, now=100.0) is True  # first probe: unhealthy
    assert monitor.judge(endpoint, False, now=101.0) is False  # no traffic: stays out
    endpoint.last_success = 101.5
    assert monitor.judge(endpoint, False, now=102.0) is False  # one good of two
    endpoint.last_success = 102.5
    assert monitor.judge(endpoint, False, now=103.0) is True
    assert endpoint.healthy


def test_a_success_since_the_previous_probe_counts_however_late_the_probes_come():
    """A gateway whose loop is starved probes seconds apart instead of every second: a success
    after the previous probe's result is passive evidence, though older than a probe
    interval (plus timeout) at the next one."""
    endpoint = _endpoint("a")
    monitor = _monitor(Fleet([Pool("p", "vllm", "kvgate", [endpoint])]))
    monitor.judge(endpoint, True, now=100.0)
    assert monitor.judge(endpoint, False, now=104.0) is False
    assert monitor.judge(endpoint, False, now=108.0) is False
    endpoint.last_success = 108.5  # served right after that probe
    assert monitor.judge(endpoint, False, now=112.0) is False  # third failure: still serving
    assert endpoint.healthy
    assert monitor.judge(endpoint, False, now=116.0) is True  # nothing served since
    assert not endpoint.healthy


def test_record_success_is_the_passive_evidence():
    endpoint = _endpoint("a")
    before = time.monotonic()
    endpoint.record_success()
    assert endpoint.last_success >= before


def test_panic_routes_across_the_whole_pool_below_the_threshold(caplog):
    caplog.set_level(logging.WARNING, logger="kvgate.health")
    endpoints = [_endpoint(f"e{i}") for i in range(4)]
    other = _endpoint("x", pool="q")
    pool = Pool("p", "vllm", "kvgate", endpoints)
    fleet = Fleet([pool, Pool("q", "vllm", "kvgate", [other])])
    for endpoint in endpoints[:2]:
        endpoint.healthy = False
    fleet.refresh()  # 2 of 4 healthy: not below half
    assert not pool.panic
    assert fleet.candidates("m") == [*endpoints[2:], other]
    endpoints[2].healthy = False
    fleet.refresh()  # 1 of 4: panic, every endpoint of p is a candidate again
    assert pool.panic and all(e.panic_routed and e.routable for e in endpoints)
    assert fleet.candidates("m") == [*endpoints, other]
    assert "pool p entered panic, routing across all: 1 of 4 endpoints healthy" in caplog.text
    for endpoint in endpoints:
        endpoint.healthy = True
    fleet.refresh()
    assert not pool.panic and not any(e.panic_routed for e in endpoints)
    assert "pool p left panic: 4 of 4 endpoints healthy" in caplog.text


def test_panic_threshold_zero_never_panics():
    endpoint = _endpoint("a")
    fleet = Fleet([Pool("p", "vllm", "kvgate", [endpoint])], panic_threshold=0.0)
    endpoint.healthy = False
    fleet.refresh()
    assert fleet.candidates("m") == [] and not endpoint.routable


@pytest.fixture(scope="module")
def sim() -> Iterator[SimFleet]:
    with SimFleet.in_thread(engines=2, options=EngineOptions(profile="fast")) as fleet:
        yield fleet


@pytest.fixture(autouse=True)
def _clear_faults(sim: SimFleet) -> Iterator[None]:
    yield
    for engine in sim.engines:
        engine.clear_fault()


FAST_PROBES = {"interval": 0.1, "timeout": 0.05, "discovery_interval": 30}


def test_hang_health_endpoints_that_serve_stay_in_rotation(sim, start_gateway):
    """Both engines' health routes hang while clients keep sending: until every endpoint has
    had 30 probes in a row time out (10x the unhealthy threshold), not one request fails and
    both stay healthy. Counted in probes, not seconds: on a loaded machine both the probes and
    the requests come later, and the claim is about how many probes failed."""
    app, server = start_gateway(pool_config(sim, health=FAST_PROBES))
    # The first probe decides alone, and on a loaded machine a good one can miss the 50 ms
    # timeout: the claim is about endpoints that were healthy when their probes began to hang.
    wait_for(lambda: all(e.healthy for e in app.fleet.endpoints), timeout=30)
    for engine in sim.engines:
        engine.set_fault({"mode": "hang_health"})
    streaks = app.health._streaks

    def probes_failed() -> int:
        return min(streaks[e.name].failures for e in app.fleet.endpoints)

    deadline = time.monotonic() + 40

    def lane() -> list[int]:
        statuses: list[int] = []
        with httpx.Client(base_url=server.url, timeout=10) as client:
            while probes_failed() < 30 and time.monotonic() < deadline:
                response = client.post("/v1/chat/completions", json=chat(max_tokens=2))
                statuses.append(response.status_code)
        return statuses

    # Two lanes per endpoint (round robin): one is always in flight on each while the other
    # reads its answer, so each probe finds a success since the one before.
    with concurrent.futures.ThreadPoolExecutor(4) as lanes:
        running = [lanes.submit(lane) for _ in range(4)]
        statuses = [s for done in running for s in done.result()]
    assert probes_failed() >= 30, "the probes did not fail 30 times in a row in 40 s"
    used = {e.name for e in app.fleet.endpoints if e.last_success > 0}
    assert set(statuses) == {200}
    assert all(e.healthy for e in app.fleet.endpoints)
    assert used == {e.name for e in app.fleet.endpoints}


def test_an_idle_endpoint_whose_probes_hang_goes_unhealthy_and_panic_keeps_serving(
    sim, start_gateway
):
    """No traffic, no passive evidence: after 3 timed-out probes both endpoints are unhealthy,
    the pool panics and requests are still served; with panic off they get 503."""
    configs = {
        0.5: pool_config(sim, health=FAST_PROBES),
        0.0: pool_config(sim, health={**FAST_PROBES, "panic_threshold": 0}),
    }
    apps = {threshold: start_gateway(config) for threshold, config in configs.items()}
    for engine in sim.engines:
        engine.set_fault({"mode": "hang_health"})
    for app, _ in apps.values():
        wait_for(lambda app=app: not any(e.healthy for e in app.fleet.endpoints))
    panicking, server = apps[0.5]
    assert panicking.fleet.pools[0].panic
    answered = httpx.post(server.url + "/v1/chat/completions", json=chat(max_tokens=2))
    assert answered.status_code == 200
    _, strict = apps[0.0]
    refused = httpx.post(strict.url + "/v1/chat/completions", json=chat(max_tokens=2))
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_healthy_endpoint"


def test_an_endpoint_back_from_an_outage_starts_with_an_empty_prefix_index(sim, start_gateway):
    """An engine that could not be reached may have restarted with an empty cache: when its
    endpoint passes its health check again, what the prefix index held there is forgotten,
    so requests with those prefixes are not all sent to a cold cache for a hit."""
    config = pool_config(sim, pool={"policy": "kvgate"}, health=FAST_PROBES)
    app, server = start_gateway(config)
    wait_for(lambda: all(e.healthy for e in app.fleet.endpoints), timeout=30)
    prompt = chat("a prompt worth remembering " * 40, max_tokens=2)
    name = httpx.post(server.url + "/v1/chat/completions", json=prompt).headers["x-kvgate-endpoint"]
    endpoint = next(e for e in app.fleet.endpoints if e.name == name)
    engine = sim.engines[app.fleet.endpoints.index(endpoint)]
    held = app.routing.index.entries(name)
    assert held > 0
    engine.set_fault({"mode": "refuse"})
    wait_for(lambda: not endpoint.healthy, timeout=10)
    assert app.routing.index.entries(name) == held  # an outage alone forgets nothing
    engine.clear_fault()
    wait_for(lambda: endpoint.healthy, timeout=10)
    assert app.routing.index.entries(name) == 0
