"""What two idealised schedules would give a workload's time to first token, computed offline.

Both take each request's arrival and its work: its TTFT floor (cache_ideals.py), the prefill of
what even an infinite cache misses, alone on an engine. Both leave out what only slows real
engines (decoding sequences sharing each step, cache misses beyond the infinite cache's), so
they are optimistic about everything but the order of work.

- `shortest_remaining_first`: every engine takes, at every moment, one of the requests with
  the least prefill work left, across the whole fleet, preempting and moving requests at no
  cost; a request runs on one engine at a time, so none finishes before its floor. Shortest
  remaining work first minimises mean response time on one server. It is not a bound on a
  percentile (a schedule could give up a few long requests to finish more by a deadline),
  but it is the schedule that a gateway holding requests and releasing the shortest first
  could at best approach, and a router's p90 far above it shows room left by placement or
  order; a target below it is out of reach of any such gateway.
- `least_work_first_come`: each request, in arrival order, goes to the engine whose queue
  empties first and waits behind everything there (first come, first served, one prefill at
  a time): a router that knows every engine's queued work exactly, on engines that keep
  their arrival order, as vLLM's default scheduler does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScheduleEstimates:
    shortest_remaining_first: tuple[float, ...]  # each request's TTFT, in arrival order
    least_work_first_come: tuple[float, ...]

    def srpt(self, q: float) -> float:
        return quantile(self.shortest_remaining_first, q)

    def fcfs(self, q: float) -> float:
        return quantile(self.least_work_first_come, q)


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest rank, as routing.py's percentiles."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def estimates(arrivals: Sequence[float], work: Sequence[float], engines: int) -> ScheduleEstimates:
    return ScheduleEstimates(
        tuple(shortest_remaining_first(arrivals, work, engines)),
        tuple(least_work_first_come(arrivals, work, engines)),
    )


def shortest_remaining_first(
    arrivals: Sequence[float], work: Sequence[float], engines: int
) -> list[float]:
    """Each request's time from arrival to the end of its work (same order as given) when
    `engines` engines always run the requests with the least work left."""
    order = sorted(range(len(arrivals)), key=lambda k: arrivals[k])
    finished = [0.0] * len(arrivals)
    left: dict[int, float] = {}  # work left of each request not finished
    now = 0.0
    nxt = 0
    while nxt < len(order) or left:
        if not left:
            now = max(now, arrivals[order[nxt]])
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            left[order[nxt]] = work[order[nxt]]
            nxt += 1
        running = heapq.nsmallest(engines, left, key=left.__getitem__)
        step = min(left[k] for k in running)
        if nxt < len(order):
            step = min(step, arrivals[order[nxt]] - now)
        now += step
        for k in running:
            left[k] -= step
            if left[k] <= 1e-12:
                finished[k] = now - arrivals[k]
                del left[k]
    return finished


def least_work_first_come(
    arrivals: Sequence[float], work: Sequence[float], engines: int
) -> list[float]:
    """Each request's time from arrival to the end of its work (same order as given) when it
    joins, in arrival order, the engine that frees first, behind all work already there."""
    free_at = [0.0] * engines
    finished = [0.0] * len(arrivals)
    for k in sorted(range(len(arrivals)), key=lambda k: arrivals[k]):
        engine = min(range(engines), key=free_at.__getitem__)
        free_at[engine] = max(arrivals[k], free_at[engine]) + work[k]
        finished[k] = free_at[engine] - arrivals[k]
    return finished
