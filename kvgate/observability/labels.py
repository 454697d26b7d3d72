"""A cap on the distinct values one metric label takes in one process (tenant, model).

The names the config gives are taken first, in config order, so every worker and replica
serving the same config labels them alike; values seen only at run time (models the engines
report, tenants added by a reload) take the places left in the order they arrive.
"""

from __future__ import annotations

from collections.abc import Iterable

OVERFLOW = "other"


class LabelCap:
    """Maps a label value to itself while fewer than `limit` values are kept, else to
    `other`. A value once kept stays kept (lowering the limit on reload drops none)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept: set[str] = set()

    def configure(self, limit: int, config_values: Iterable[str]) -> None:
        self.limit = limit
        for value in config_values:
            self(value)

    def __call__(self, value: str) -> str:
        if value in self.kept:
            return value
        if len(self.kept) < self.limit:
            self.kept.add(value)
            return value
        return OVERFLOW
