"""Prometheus view of shared state: replicas seen, deltas, resyncs, Redis link health."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvgate.routing.endpoints import Fleet
from kvgate.state.memory import MemoryStore
from kvgate.state.redis_link import DURATION_BOUNDS
from kvgate.state.redis_store import RedisStore


class StateCollector(Collector):
    """Read at scrape time from the store and the endpoints; nothing on the request path."""

    def __init__(self, store: MemoryStore | RedisStore, fleet: Fleet) -> None:
        self.store = store
        self.fleet = fleet

    def collect(
        self,
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        yield GaugeMetricFamily(
            "kvgate_state_replicas",
            "Live gateway replicas sharing state, this one included.",
            value=self.store.replicas,
        )
        peers = GaugeMetricFamily(
            "kvgate_endpoint_peer_inflight_requests",
            "Requests other replicas have in flight to each endpoint.",
            labels=["endpoint"],
        )
        for endpoint in self.fleet.endpoints:
            peers.add_metric([endpoint.name], endpoint.peer_inflight)
        yield peers
        if not isinstance(self.store, RedisStore):
            return
        stats, link = self.store.stats, self.store.link.stats
        yield GaugeMetricFamily(
            "kvgate_state_redis_connected",
            "1 while the Redis link's breakers are closed.",
            value=1 if self.store.connected else 0,
        )
        yield GaugeMetricFamily(
            "kvgate_state_redis_connections",
            "Connections the Redis link's pool holds, idle or in use (the stream reader's "
            "one not included).",
            value=self.store.link.pool.open_connections,
        )
        cumulative, buckets = 0, []
        for bound, count in zip((*DURATION_BOUNDS, float("inf")), link.durations, strict=True):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        yield HistogramMetricFamily(
            "kvgate_state_redis_call_seconds",
            "Duration of Redis calls on the link (quota calls and background writes; failed "
            "ones included), as the gateway's event loop saw it.",
            buckets=buckets,
            sum_value=link.duration_sum,
        )
        for name, value, help_text in (
            ("kvgate_state_deltas_published", stats.published, "Deltas sent to Redis."),
            ("kvgate_state_deltas_applied", stats.applied, "Peers' deltas applied locally."),
            (
                "kvgate_state_deltas_dropped",
                stats.dropped,
                "Deltas dropped because the local queue was full while Redis was unreachable.",
            ),
            (
                "kvgate_state_resyncs",
                stats.resyncs,
                "Resyncs from snapshot and stream (at start and after Redis came back).",
            ),
            ("kvgate_state_snapshots_written", stats.snapshots_written, "Snapshots written."),
            ("kvgate_state_redis_failures", link.failures, "Redis calls that failed."),
            (
                "kvgate_state_redis_breaker_opened",
                link.breaker_opened,
                "Times the Redis breaker opened.",
            ),
            (
                "kvgate_quota_local_fallbacks",
                self.store.quotas.stats.local_fallbacks,
                "Quota reservations enforced locally (a share of the limit) while Redis was lost.",
            ),
        ):
            yield CounterMetricFamily(name, help_text, value=value)
