"""The time-to-finish prediction admission sheds on: the mean plus a margin for how much
observed requests vary, so deferred work is dispatched only while it can still make its
deadline."""

from __future__ import annotations

import random

import pytest

from kvgate.chain.predict import DurationPredictor, Estimate
from kvgate.chain.settings import AdmissionConfig


def test_before_any_observation_the_initial_values_are_used():
    predictor = DurationPredictor(initial_ttft=0.5, initial_token_time=0.02, deviations=4)
    assert predictor.ttft("m") == 0.5
    assert predictor.duration("m", 100) == pytest.approx(0.5 + 100 * 0.02)


def test_steady_observations_converge_to_the_mean_without_margin():
    predictor = DurationPredictor(initial_ttft=0.5, initial_token_time=0.02, deviations=4)
    for _ in range(300):
        predictor.observe_ttft("m", 0.1)
        predictor.observe_token_time("m", 0.01)
    assert predictor.ttft("m") == pytest.approx(0.1, abs=1e-6)
    assert predictor.duration("m", 100) == pytest.approx(0.1 + 100 * 0.01, abs=1e-4)
    assert predictor.duration("other", 100) == pytest.approx(0.5 + 100 * 0.02)


def test_varying_observations_push_the_prediction_above_the_mean():
    rng = random.Random(3)
    token_times = [rng.uniform(0.015, 0.025) for _ in range(400)]
    careful = DurationPredictor(initial_ttft=0.05, initial_token_time=0.02, deviations=4)
    mean_only = DurationPredictor(initial_ttft=0.05, initial_token_time=0.02, deviations=0)
    for value in token_times:
        for predictor in (careful, mean_only):
            predictor.observe_ttft("m", 0.05)
            predictor.observe_token_time("m", value)
    tokens = 96
    assert mean_only.duration("m", tokens) == pytest.approx(0.05 + tokens * 0.02, rel=0.1)
    # Most observed requests would take longer than the mean prediction; few take longer
    # than the careful one.
    recent = [0.05 + tokens * value for value in token_times[-200:]]
    assert sum(d > mean_only.duration("m", tokens) for d in recent) > 50
    assert sum(d > careful.duration("m", tokens) for d in recent) < 10
    assert careful.ttft("m") == pytest.approx(mean_only.ttft("m"))


def test_estimate_tracks_a_shift():
    estimate = Estimate(1.0)
    for _ in range(100):
        estimate.observe(2.0)
    assert estimate.mean == pytest.approx(2.0, abs=0.01)
    assert estimate.deviation < 0.01
    assert estimate.upper(4) == pytest.approx(2.0, abs=0.05)


def test_prediction_margin_is_configurable():
    assert AdmissionConfig().prediction_deviations == 4.0
    assert AdmissionConfig.model_validate({"prediction_deviations": 0}).prediction_deviations == 0
    with pytest.raises(ValueError):
        AdmissionConfig.model_validate({"prediction_deviations": -1})
