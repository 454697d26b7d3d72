"""Counts over a sliding time window, in fixed buckets: the memory of budgets and breakers.

A window of `seconds` is split into `buckets` slots; each slot holds one count per series.
Adding or reading costs O(1) amortised (stale slots are cleared as time moves on), memory is
`buckets x series` integers, and the window forgets in steps of `seconds / buckets`.
"""

from __future__ import annotations

import math


class RollingCounts:
    """`series` counters summed over the last `seconds` (bucketed; see module docstring)."""

    __slots__ = ("_counts", "_head", "_slot_seconds", "_totals", "buckets")

    def __init__(self, seconds: float, series: int, buckets: int = 10) -> None:
        self.buckets = buckets
        self._slot_seconds = seconds / buckets
        self._counts = [[0] * series for _ in range(buckets)]
        self._totals = [0] * series
        self._head: int | None = None  # absolute index of the newest slot

    def _advance(self, now: float) -> int:
        slot = math.floor(now / self._slot_seconds)
        head = self._head
        if head is None:
            self._head = slot
            return slot % self.buckets
        if slot > head:
            for stale in range(head + 1, min(slot, head + self.buckets) + 1):
                row = self._counts[stale % self.buckets]
                for series, count in enumerate(row):
                    self._totals[series] -= count
                    row[series] = 0
            self._head = slot
            return slot % self.buckets
        return head % self.buckets

    def add(self, series: int, now: float, amount: int = 1) -> None:
        row = self._counts[self._advance(now)]
        row[series] += amount
        self._totals[series] += amount

    def total(self, series: int, now: float) -> int:
        self._advance(now)
        return self._totals[series]

    def clear(self) -> None:
        for row in self._counts:
            for series in range(len(row)):
                row[series] = 0
        self._totals = [0] * len(self._totals)
