"""The routing benchmark's breakdown of the slowest tenth's time to first token
(benchmarks/ttft_breakdown.py): the client's TTFTs joined with the engines' records by answer id."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tests import benchmark_modules

ttft_breakdown = benchmark_modules.load("ttft_breakdown")


@dataclass
class Result:
    ttft: float | None
    response_id: str
    error: str = ""


def record(ttft: float, waiting: float, own: float) -> dict[str, float]:
    return {
        "ttft": ttft,
        "waiting": waiting,
        "step_base": 0.015,
        "own_prefill": own,
        "shared_prefill": 0.0,
        "decodes": 0.0,
        "overrun": ttft - waiting - 0.015 - own,
    }


def test_the_slowest_tenth_is_joined_by_answer_id_and_split_by_part():
    # Twenty requests: the two slowest (tenth) are r18 (1.0 s) and r19 (2.0 s).
    results = [Result(0.1 + 0.01 * k, f"r{k}") for k in range(18)]
    results += [Result(1.0, "r18"), Result(2.0, "r19")]
    engines = {f"r{k}": record(0.09, 0.0, 0.05) for k in range(18)}
    engines["r18"] = record(0.9, 0.5, 0.3)
    engines["r19"] = record(1.9, 1.0, 0.8)
    floors = [0.05] * 18 + [0.2, 0.4]
    out = ttft_breakdown.slowest_tenth(results, floors, engines)
    assert out["n"] == 2
    assert out["ttft"] == pytest.approx(1.5)
    assert out["floor"] == pytest.approx(0.3)
    assert out["outside"] == pytest.approx(0.1)  # client TTFT minus the engine's
    assert out["waiting"] == pytest.approx(0.75)
    assert out["own_prefill"] == pytest.approx(0.55)


def test_failed_and_unmatched_requests_are_left_out():
    results = [Result(None, "", "http 503"), Result(3.0, "gone"), Result(0.5, "r1")]
    results += [Result(0.1, f"q{k}") for k in range(7)]
    engines = {"r1": record(0.4, 0.1, 0.2)}
    out = ttft_breakdown.slowest_tenth(results, None, engines)
    # The p90 of the 9 timed requests is 3.0 s ("gone"), which no engine recorded.
    assert out["n"] == 0 and math.isnan(out["ttft"])
    out = ttft_breakdown.slowest_tenth(results[2:], None, engines)
    assert out["n"] == 1 and out["outside"] == pytest.approx(0.1) and math.isnan(out["floor"])
