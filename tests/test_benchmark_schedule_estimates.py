"""The routing benchmark's idealised schedules (benchmarks/schedule_estimates.py): global
shortest-remaining-work-first with preemption, and least-work dispatch to first-come engines."""

from __future__ import annotations

import pytest

from tests import benchmark_modules

schedule_estimates = benchmark_modules.load("schedule_estimates")


def test_the_shortest_goes_first_and_first_come_keeps_arrival_order():
    arrivals, work = [0.0, 0.0], [3.0, 1.0]
    assert schedule_estimates.shortest_remaining_first(arrivals, work, 1) == [4.0, 1.0]
    assert schedule_estimates.least_work_first_come(arrivals, work, 1) == [3.0, 4.0]


def test_a_short_request_preempts_a_long_one_only_under_shortest_remaining_first():
    arrivals, work = [0.0, 2.0], [10.0, 1.0]
    assert schedule_estimates.shortest_remaining_first(arrivals, work, 1) == [11.0, 1.0]
    assert schedule_estimates.least_work_first_come(arrivals, work, 1) == [10.0, 9.0]


@pytest.mark.parametrize("schedule", ["shortest_remaining_first", "least_work_first_come"])
def test_no_request_beats_its_own_work_and_idle_engines_take_requests_at_once(schedule):
    arrivals, work = [0.0, 0.5, 0.5, 100.0], [5.0, 2.0, 1.0, 1.0]
    ttfts = getattr(schedule_estimates, schedule)(arrivals, work, 3)
    assert ttfts == pytest.approx(work)  # one engine each: nobody waits, nobody is faster


def test_shortest_remaining_first_uses_every_engine():
    # Four requests of 1 s at once on two engines: two finish at 1 s, two at 2 s.
    ttfts = schedule_estimates.shortest_remaining_first([0.0] * 4, [1.0] * 4, 2)
    assert sorted(ttfts) == pytest.approx([1.0, 1.0, 2.0, 2.0])
    estimates = schedule_estimates.estimates([0.0] * 4, [1.0] * 4, 2)
    assert estimates.srpt(0.9) == pytest.approx(2.0)
    assert estimates.fcfs(0.5) == pytest.approx(2.0)
