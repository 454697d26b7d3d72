"""Each filter and scorer as a pure function over load snapshots and a context (table-driven)."""

from __future__ import annotations

import time

import pytest

from kvgate.routing import filters, scorers
from kvgate.routing.match import PrefixMatch
from tests.routing.helpers import ctx, endpoint, telemetry


def _names(loads):
    return [c.name for c in loads]


def _fields(loads):
    """Every field value of every load, in order (loads compare by identity)."""
    return [[getattr(load, name) for name in type(load).__slots__] for load in loads]


def _loads(endpoints):
    now = time.monotonic()
    return [e.load(now) for e in endpoints]


FILTER_CASES = [
    (
        "fresh_telemetry",
        filters.FreshTelemetry(),
        lambda: [
            endpoint("a", telemetry=telemetry(age=10)),
            endpoint("b", telemetry=telemetry()),
            endpoint("c"),
        ],
        {},
        ["b"],
    ),
    (
        "not_saturated: queue",
        filters.NotSaturated(),
        lambda: [
            endpoint("a", telemetry=telemetry(waiting=6)),
            endpoint("b", telemetry=telemetry(waiting=5)),
        ],
        {},
        ["b"],
    ),
    (
        "not_saturated: kv, when a threshold is set",
        filters.NotSaturated(filters.NotSaturatedParams(max_kv_usage=0.9)),
        lambda: [endpoint("a", telemetry=telemetry(kv_usage=0.95)), endpoint("b")],
        {},
        ["b"],
    ),
    (
        "not_saturated: a full KV cache alone is not saturation by default",
        filters.NotSaturated(),
        lambda: [endpoint("a", telemetry=telemetry(kv_usage=1.0, waiting=5)), endpoint("b")],
        {},
        ["a", "b"],
    ),
    (
        "not_saturated: stale telemetry ignored",
        filters.NotSaturated(),
        lambda: [endpoint("a", telemetry=telemetry(age=10, waiting=50))],
        {},
        ["a"],
    ),
    (
        "not_saturated: inflight cap",
        filters.NotSaturated(),
        lambda: [
            endpoint("a", max_inflight=2, inflight=2),
            endpoint("b", max_inflight=2, inflight=1),
        ],
        {},
        ["b"],
    ),
    (
        "not_saturated: own thresholds",
        filters.NotSaturated(filters.NotSaturated.Params(max_waiting=1)),
        lambda: [
            endpoint("a", telemetry=telemetry(waiting=2)),
            endpoint("b", telemetry=telemetry(waiting=1)),
        ],
        {},
        ["b"],
    ),
    (
        "jurisdiction: none asked",
        filters.Jurisdiction(),
        lambda: [endpoint("a", labels={"jurisdiction": "us"}), endpoint("b")],
        {},
        ["a", "b"],
    ),
    (
        "jurisdiction: residency",
        filters.Jurisdiction(),
        lambda: [
            endpoint("a", labels={"jurisdiction": "us"}),
            endpoint("b", labels={"jurisdiction": "eu"}),
            endpoint("c"),
        ],
        {"allowed_jurisdictions": frozenset({"eu"})},
        ["b"],
    ),
    (
        "labels",
        filters.Labels(filters.Labels.Params(match={"region": "west"})),
        lambda: [endpoint("a", labels={"region": "west", "site": "x"}), endpoint("b", labels={})],
        {},
        ["a"],
    ),
]


@pytest.mark.parametrize(
    ("case", "keep", "candidates", "fields", "expected"),
    FILTER_CASES,
    ids=[c[0] for c in FILTER_CASES],
)
def test_filter(case, keep, candidates, fields, expected):
    candidates = candidates()  # built now: telemetry ages from this moment
    request = ctx()
    for key, value in fields.items():
        setattr(request, key, value)
    loads = _loads(candidates)
    before = _fields(loads)
    assert _names(keep(request, loads)) == expected
    assert _fields(loads) == before  # pure: neither the list nor a load changed


def _prefix(matched, blocks=4, prompt_tokens=64, affinity=None):
    return PrefixMatch(
        hashes=list(range(blocks)),
        prompt_tokens=prompt_tokens,
        tokens_per_block=16,
        matched=matched,
        affinity=affinity,
    )


SCORER_CASES = [
    (
        "prefix_match",
        scorers.PrefixMatchScorer(),
        lambda: [endpoint("a"), endpoint("b")],
        _prefix({"a": 4, "b": 1}),
        [1.0, 0.25],
    ),
    ("prefix_match: no prefix", scorers.PrefixMatchScorer(), lambda: [endpoint("a")], None, [0.0]),
    (
        "queue_depth",
        scorers.QueueDepthScorer(),
        lambda: [
            endpoint("a", prefill_requests=4),
            endpoint("b", telemetry=telemetry(waiting=2)),
            endpoint("c"),
        ],
        None,
        [0.0, 0.5, 1.0],
    ),
    (
        "queue_depth: equal",
        scorers.QueueDepthScorer(),
        lambda: [endpoint("a"), endpoint("b")],
        None,
        [1.0, 1.0],
    ),
    (
        "kv_usage",
        scorers.KvUsageScorer(),
        lambda: [endpoint("a", telemetry=telemetry(kv_usage=0.75)), endpoint("b")],
        None,
        [0.25, 1.0],
    ),
    (
        "inflight",
        scorers.InflightScorer(),
        lambda: [endpoint("a", inflight=10), endpoint("b", inflight=0), endpoint("c", inflight=5)],
        None,
        [0.0, 1.0, 0.5],
    ),
    (
        "predicted_ttft: cached beats cold",
        scorers.PredictedTtftScorer(
            scorers.PredictedTtftScorer.Params(base_tokens=64, decode_token_weight=0, miss_weight=1)
        ),
        lambda: [endpoint("a"), endpoint("b")],
        _prefix({"a": 4, "b": 0}, prompt_tokens=64),
        [1.0, 0.5],
    ),
    (
        "predicted_ttft: a miss costs miss_weight (2) per token",
        scorers.PredictedTtftScorer(
            scorers.PredictedTtftScorer.Params(base_tokens=64, decode_token_weight=0)
        ),
        lambda: [endpoint("a"), endpoint("b")],
        _prefix({"a": 4, "b": 0}, prompt_tokens=64),
        [1.0, 1 / 3],
    ),
    (
        "predicted_ttft: queue outweighs cache",
        scorers.PredictedTtftScorer(
            scorers.PredictedTtftScorer.Params(
                base_tokens=100, decode_token_weight=2, miss_weight=1
            )
        ),
        lambda: [endpoint("a", prefill_tokens=200, decoding=14), endpoint("b")],
        _prefix({"a": 4, "b": 0}, prompt_tokens=64),
        [0.5, 1.0],
    ),
    (
        "predicted_ttft: a miss costs more per request queued where it would be computed",
        scorers.PredictedTtftScorer(
            scorers.PredictedTtftScorer.Params(base_tokens=64, decode_token_weight=0, miss_weight=1)
        ),
        lambda: [
            endpoint("a", prefill_tokens=200, prefill_requests=3),
            endpoint("b", prefill_requests=3),
        ],
        _prefix({"a": 4, "b": 0}, prompt_tokens=64),
        [1.0, 264 / 320],
    ),
    (
        "endpoint_cost",
        scorers.EndpointCostScorer(),
        lambda: [
            endpoint("a", labels={"cost": "4"}),
            endpoint("b", labels={"cost": "2"}),
            endpoint("c", labels={"cost": "bad"}),
        ],
        None,
        [0.25, 0.5, 1.0],
    ),
    (
        "session_affinity",
        scorers.SessionAffinityScorer(),
        lambda: [endpoint("a"), endpoint("b")],
        _prefix({}, affinity="b"),
        [0.0, 1.0],
    ),
]


@pytest.mark.parametrize(
    ("case", "scorer", "candidates", "prefix", "expected"),
    SCORER_CASES,
    ids=[c[0] for c in SCORER_CASES],
)
def test_scorer(case, scorer, candidates, prefix, expected):
    candidates = candidates()
    request = ctx()
    request.prefix = prefix
    values = scorer(request, _loads(candidates))
    assert values == pytest.approx(expected)
    assert all(0.0 <= v <= 1.0 for v in values)
