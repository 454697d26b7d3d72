"""The precise-mode decision benchmark (benchmarks/precise_cost.py, part of `routing.py
--micro`) builds a config the gateway accepts: each of its 64 endpoints has a KV-event stream
of its own, as the config check requires of every fleet."""

from __future__ import annotations

from kvgate.config import parse_config
from tests import benchmark_modules

for _sibling in ("workloads", "services", "decision_cost"):  # what precise_cost imports
    benchmark_modules.load(_sibling)
precise_cost = benchmark_modules.load("precise_cost")


def test_the_benchmarks_fleet_is_a_config_the_gateway_accepts():
    urls = precise_cost.silent_event_urls(precise_cost.ENDPOINTS)
    assert len(set(urls)) == precise_cost.ENDPOINTS == 64
    config = parse_config(precise_cost.gateway_config("tcp://127.0.0.1:5999", urls))
    endpoints = config.pools[0].endpoints
    assert len({e.kv_events.url for e in endpoints if e.kv_events is not None}) == 64
