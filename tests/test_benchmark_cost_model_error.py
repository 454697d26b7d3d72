"""The routing benchmark's reading of `x-kvgate-route-explain` (benchmarks/cost_model_error.py):
which requests were placed away from the candidate holding most of their prompt, and what
share of the prompt tokens that gave up."""

from __future__ import annotations

import pytest

from tests import benchmark_modules

cost_model_error = benchmark_modules.load("cost_model_error")


def _explain(prompt: int, uncached: dict[str, int], queued: dict[str, int] | None = None) -> str:
    """An explain header as kvgate's router writes it (kvgate/routing/router.py)."""
    parts = [f"policy=kvgate; rule=default; objective=latency; prompt_tokens={prompt}; blocks=9"]
    for name, tokens in uncached.items():
        parts.append(
            f"{name} score=0.900 predicted_ttft=0.900 held_blocks=3 uncached={tokens} "
            f"evicts_age=room queued_tokens={(queued or {}).get(name, 0)} decoding=2 waiting=0 "
            "inflight=1 load=1"
        )
    return "; ".join(parts)


def test_a_request_placed_on_its_largest_holder_gives_up_nothing() -> None:
    record = cost_model_error.Explained(_explain(1000, {"a": 100, "b": 1000}), "a", 0.1, 1000)
    assert cost_model_error.placed_away([record]) == (0, 1, 0.0)


def test_a_request_placed_away_gives_up_the_tokens_its_holder_had() -> None:
    # The engine counted 2000 prompt tokens where the gateway estimated 1000: the tokens
    # given up are rescaled to the engine's count, as the hit rate is.
    away = cost_model_error.Explained(_explain(1000, {"a": 100, "b": 700}), "b", 0.1, 2000)
    home = cost_model_error.Explained(_explain(1000, {"a": 0, "b": 0}), "a", 0.1, 2000)
    moved, counted, given_up = cost_model_error.placed_away([away, home])
    assert (moved, counted) == (1, 2)
    assert given_up == pytest.approx(600 * 2 / 4000)


def test_records_without_a_prefix_or_the_chosen_candidate_are_not_counted() -> None:
    no_prefix = "policy=kvgate; rule=default; objective=latency; a score=1.000 load=0"
    records = [
        cost_model_error.Explained(no_prefix, "a", 0.1, 500),
        cost_model_error.Explained(_explain(1000, {"a": 10}), "gone", 0.1, 1000),
    ]
    assert cost_model_error.placed_away(records) == (0, 0, 0.0)


def test_a_request_kept_behind_a_queue_counts_the_hit_it_kept() -> None:
    # "a" holds 800 tokens more than the idle "b" but has 500 queued; "c" is queued too.
    kept = cost_model_error.Explained(
        _explain(1000, {"a": 100, "b": 900, "c": 50}, {"a": 500, "c": 2000}), "a", 0.3, 2000
    )
    idle = cost_model_error.Explained(
        _explain(1000, {"a": 100, "b": 900}, {"a": 500}), "b", 0.1, 1000
    )
    everywhere = cost_model_error.Explained(_explain(1000, {"a": 0}, {"a": 10}), "a", 0.1, 1000)
    queued, counted, median = cost_model_error.kept_behind_queue([kept, idle, everywhere])
    assert (queued, counted) == (1, 3)
    assert median == pytest.approx(800 * 2)  # rescaled to the engine's count, as above
