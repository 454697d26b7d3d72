"""Prometheus view of routing state, collected at scrape time (nothing on the hot path)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.routing.endpoints import Fleet
from kvgate.routing.services import RoutingServices


class RoutingCollector(Collector):
    def __init__(self, fleet: Fleet, services: RoutingServices) -> None:
        self.fleet = fleet
        self.services = services

    def collect(self) -> Iterator[Metric]:
        index = self.services.index
        entries = GaugeMetricFamily(
            "kvgate_prefix_index_entries",
            "Block hashes the prefix index holds per endpoint.",
            labels=["endpoint"],
        )
        capacity = GaugeMetricFamily(
            "kvgate_prefix_index_capacity",
            "Most block hashes the prefix index keeps per endpoint.",
            labels=["endpoint"],
        )
        evictions = CounterMetricFamily(
            "kvgate_prefix_index_evictions",
            "Block hashes dropped for capacity or age.",
            labels=["endpoint"],
        )
        prefill = GaugeMetricFamily(
            "kvgate_endpoint_prefill_tokens",
            "Prompt tokens sent and waiting for their first token.",
            labels=["endpoint"],
        )
        decoding = GaugeMetricFamily(
            "kvgate_endpoint_decoding_requests",
            "Requests past their first token, still generating.",
            labels=["endpoint"],
        )
        stale = GaugeMetricFamily(
            "kvgate_endpoint_telemetry_stale",
            "1 when the endpoint's scraped metrics are too old to use.",
            labels=["endpoint"],
        )
        saturated = GaugeMetricFamily(
            "kvgate_endpoint_saturated",
            "1 when the endpoint's queue or KV use is above limits.",
            labels=["endpoint"],
        )
        inflight = GaugeMetricFamily(
            "kvgate_endpoint_inflight_requests",
            "Requests this process has in flight to each endpoint.",
            labels=["endpoint"],
        )
        healthy = GaugeMetricFamily(
            "kvgate_endpoint_healthy",
            "1 when the endpoint passes its health check.",
            labels=["endpoint"],
        )
        drained = GaugeMetricFamily(
            "kvgate_endpoint_drained",
            "1 while an operator has drained the endpoint (no new requests).",
            labels=["endpoint"],
        )
        for endpoint in self.fleet.endpoints:
            name = endpoint.name
            entries.add_metric([name], index.entries(name))
            capacity.add_metric([name], index.capacity(name))
            evictions.add_metric([name], index.evictions(name))
            prefill.add_metric([name], endpoint.prefill_tokens)
            decoding.add_metric([name], endpoint.decoding)
            stale.add_metric([name], 1 if endpoint.stale else 0)
            saturated.add_metric([name], 1 if endpoint.saturated else 0)
            inflight.add_metric([name], endpoint.inflight + self.fleet.earlier_inflight(endpoint))
            healthy.add_metric([name], 1 if endpoint.healthy else 0)
            drained.add_metric([name], 1 if endpoint.drained else 0)
        yield from (entries, capacity, evictions, prefill, decoding, stale, saturated)
        yield from (inflight, healthy, drained)
        yield from self._engine_telemetry()
        predicted = CounterMetricFamily(
            "kvgate_prefix_predicted_tokens",
            "Prompt tokens the prefix index predicted the chosen endpoint held, over answers "
            "that reported cached tokens.",
            labels=["endpoint"],
        )
        cached = CounterMetricFamily(
            "kvgate_prefix_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details).",
            labels=["endpoint"],
        )
        corrections = CounterMetricFamily(
            "kvgate_prefix_corrections",
            "Answers whose cached tokens were below (over) or above (under) the prediction "
            "beyond the tolerance, each correcting the index; in_flight: below it on blocks "
            "that may still have been in prefill (no correction).",
            labels=["endpoint", "direction"],
        )
        for name, drift in self.services.feedback.drift.items():
            predicted.add_metric([name], drift.predicted_tokens)
            cached.add_metric([name], drift.cached_tokens)
            corrections.add_metric([name, "over"], drift.over)
            corrections.add_metric([name, "under"], drift.under)
            corrections.add_metric([name, "in_flight"], drift.in_flight)
        yield from (predicted, cached, corrections)
        decisions = CounterMetricFamily(
            "kvgate_routing_decisions",
            "Endpoints chosen by routing (retries' choices included), by policy.",
            labels=["endpoint", "policy"],
        )
        for (name, policy), count in self.services.decisions.items():
            decisions.add_metric([name, policy], count)
        yield decisions
        yield GaugeMetricFamily(
            "kvgate_prefix_index_memory_bytes",
            "Estimated memory held by the prefix index.",
            value=index.memory_bytes,
        )
        yield GaugeMetricFamily(
            "kvgate_affinity_sessions",
            "Sessions with a remembered endpoint.",
            value=len(self.services.affinity),
        )

    def _engine_telemetry(self) -> Iterator[Metric]:
        """What each engine last reported, while fresh (stale telemetry has no sample)."""
        mirrors = (
            ("kvgate_engine_running_requests", "Requests the engine reports running.", "running"),
            ("kvgate_engine_waiting_requests", "Requests the engine reports queued.", "waiting"),
            (
                "kvgate_engine_kv_cache_usage_ratio",
                "Share of the engine's KV cache in use (0 to 1), as it reports it.",
                "kv_usage",
            ),
        )
        families = [GaugeMetricFamily(name, text, labels=["endpoint"]) for name, text, _ in mirrors]
        for endpoint in self.fleet.endpoints:
            telemetry = endpoint.fresh_telemetry
            if telemetry is None:
                continue
            for family, (_, _, signal) in zip(families, mirrors, strict=True):
                family.add_metric([endpoint.name], getattr(telemetry, signal))
        yield from families
