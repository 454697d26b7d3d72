"""Prometheus view of precise routing (KV events), per endpoint configured for it, collected at
scrape time: mode, what the subscriber applied and lost, event lag, the precise index's size,
and how often its answer equalled the engine's cached tokens."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.routing.kv_events import PRECISE
from kvgate.routing.services import RoutingServices


class PreciseCollector(Collector):
    def __init__(self, services: RoutingServices) -> None:
        self.services = services

    def collect(self) -> Iterator[Metric]:
        precise = self.services.precise
        if precise is None:
            return
        mode = GaugeMetricFamily(
            "kvgate_kv_events_precise",
            "1 while the endpoint is routed on its KV events (precise), 0 when approximately.",
            labels=["endpoint", "reason"],
        )
        events = CounterMetricFamily(
            "kvgate_kv_events_applied",
            "KV events applied to the precise index.",
            labels=["endpoint"],
        )
        gaps = CounterMetricFamily(
            "kvgate_kv_events_gaps",
            "Missing batches (sequence gaps), filled from the replay socket or not.",
            labels=["endpoint", "outcome"],
        )
        malformed = CounterMetricFamily(
            "kvgate_kv_events_malformed",
            "Event messages or replies that would not decode, dropped.",
            labels=["endpoint"],
        )
        losses = CounterMetricFamily(
            "kvgate_kv_events_interruptions",
            "Publisher restarts and stalled streams seen.",
            labels=["endpoint", "kind"],
        )
        changes = CounterMetricFamily(
            "kvgate_kv_events_mode_changes",
            "Changes between precise and approximate mode.",
            labels=["endpoint"],
        )
        lag = GaugeMetricFamily(
            "kvgate_kv_events_lag_seconds",
            "Wall clock at apply time minus the newest applied batch's timestamp.",
            labels=["endpoint"],
        )
        blocks = GaugeMetricFamily(
            "kvgate_precise_index_blocks",
            "Token blocks the precise index holds per endpoint.",
            labels=["endpoint"],
        )
        orphans = CounterMetricFamily(
            "kvgate_precise_orphan_runs",
            "Stored runs of blocks not indexed because their parent block was unknown (evicted, "
            "cleared, or never heard): steady growth means the index misses what the engine "
            "holds.",
            labels=["endpoint"],
        )
        answers = CounterMetricFamily(
            "kvgate_precise_answers",
            "Answers of precise endpoints whose cached tokens equalled (agree) or not "
            "(disagree) the precise index's confirmed prediction.",
            labels=["endpoint", "outcome"],
        )
        drift = self.services.feedback.drift
        for name in precise.endpoints:
            current = precise.mode(name)
            assert current is not None
            mode.add_metric([name, current[1]], 1 if current[0] == PRECISE else 0)
            blocks.add_metric([name], precise.index.blocks(name))
            orphans.add_metric([name], precise.index.orphans(name))
            counters = precise.counters(name)
            if counters is not None:
                events.add_metric([name], counters.events_applied)
                gaps.add_metric([name, "filled"], counters.gaps_filled)
                gaps.add_metric([name, "unfilled"], counters.gaps_unfilled)
                malformed.add_metric([name], counters.malformed_dropped)
                losses.add_metric([name, "restart"], counters.restarts)
                losses.add_metric([name, "stall"], counters.stalls)
                changes.add_metric([name], counters.mode_changes)
                if counters.last_event_lag_seconds is not None:
                    lag.add_metric([name], counters.last_event_lag_seconds)
            if name in drift:
                answers.add_metric([name, "agree"], drift[name].exact_agreed)
                answers.add_metric([name, "disagree"], drift[name].exact_disagreed)
        yield from (mode, events, gaps, malformed, losses, changes, lag, blocks, orphans, answers)
        yield GaugeMetricFamily(
            "kvgate_precise_index_memory_bytes",
            "Estimated memory held by the precise index.",
            value=precise.index.memory_bytes,
        )
        yield GaugeMetricFamily(
            "kvgate_precise_speculative_entries",
            "Routing decisions' blocks counted as held until the engine's events confirm them.",
            value=precise.index.speculative_entries(),
        )
