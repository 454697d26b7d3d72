"""Prometheus view of the serving process itself."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class ProcessCollector(Collector):
    """The asyncio tasks alive in this process's event loop, counted at scrape time (the loop
    is running: /metrics is answered from it). A count that only grows under steady load is a
    leak; `benchmarks/soak.py` watches it over an hour."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "kvgate_process_asyncio_tasks",
            "asyncio tasks alive in this process's event loop (the scrape's own included).",
            value=len(asyncio.all_tasks()),
        )
