"""What a reload keeps: the state of the endpoints and tenants that remain in the new config.

An endpoint remains when the new config has an endpoint with the same URL in a pool of the same
name (its default name, `{pool}-{index}`, may change when endpoints are added or removed before
it); a tenant remains when a tenant of the same name is configured. For those, the new app takes
over the prefix index's entries, session affinity, drift counters, routing decision counts,
circuit breakers, drained flags and the last telemetry, and (with in-memory state) the quota
buckets and concurrency counts, open reservations included. Tables and breakers move rather than
being copied, so requests begun before the reload, which finish on the old app, still report
into them. Everything of the endpoints and tenants that are gone stays with the old app and goes
when it is shut down.

With Redis state the quota buckets live in Redis and carry over by themselves; the new store
adds the old one's counters (deltas, resyncs, Redis calls and failures, quota fallbacks) to
its own, so those metrics never reset on a reload.
"""

from __future__ import annotations

import logging

from kvgate.app import GatewayApp
from kvgate.routing.endpoints import Fleet
from kvgate.state.quotas import InMemoryQuotaStore
from kvgate.state.redis_store import RedisStore

log = logging.getLogger("kvgate")


def remaining_endpoints(old: Fleet, new: Fleet) -> dict[str, str]:
    """Old endpoint name → new name, for the endpoints of `old` that `new` still has."""
    new_names = {(e.pool, e.url): e.name for e in new.endpoints}
    return {
        e.name: new_names[(e.pool, e.url)] for e in old.endpoints if (e.pool, e.url) in new_names
    }


def carry_over(old: GatewayApp, new: GatewayApp) -> None:
    """Hand `old`'s state of what remains to `new`, just before `new` takes its place (after
    its start, with no await in between: nothing `old` learns is lost)."""
    names = remaining_endpoints(old.fleet, new.fleet)
    for endpoint in old.fleet.endpoints:
        successor = new.fleet.endpoint(names.get(endpoint.name, ""))
        if successor is None:
            continue
        successor.drained = endpoint.drained
        if successor.telemetry is None:
            successor.telemetry = endpoint.telemetry
        drift = old.routing.feedback.drift.get(endpoint.name)
        if drift is not None:
            new.routing.feedback.drift[successor.name] = drift
    decisions = new.routing.decisions
    for (name, policy), count in old.routing.decisions.items():
        if name in names:
            key = (names[name], policy)
            decisions[key] = decisions.get(key, 0) + count
    new.routing.index.adopt(old.routing.index, names)
    new.routing.affinity.adopt(old.routing.affinity, names)
    new.resilience.adopt(old.resilience, names)
    tenants = {t.name: t.quota for t in (new.tenants.anonymous, *new.tenants.tenants.values())}
    old_quotas, new_quotas = old.store.quotas, new.store.quotas
    if isinstance(old_quotas, InMemoryQuotaStore) and isinstance(new_quotas, InMemoryQuotaStore):
        new_quotas.adopt(old_quotas, tenants)
    if isinstance(old.store, RedisStore) and isinstance(new.store, RedisStore):
        new.store.adopt_counts(old.store)
    # One count per tenant for both apps: the old app's requests still hold their places.
    active = old.admission.active
    for gone in [t for t, n in active.items() if not n and t not in tenants]:
        del active[gone]
    new.admission.active = active
    log.info(
        "reload kept the state of %d of %d endpoint(s); %d are new",
        len(names),
        len(old.fleet.endpoints),
        len(new.fleet.endpoints) - len(names),
    )
