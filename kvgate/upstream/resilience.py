"""The resilience state of a gateway process, built once at app assembly from the config.

Per pool: a retry budget, a client-side throttle, an ejection group. Per endpoint: a circuit
breaker, installed as `Endpoint.breaker` so that routing skips endpoints it does not admit.
`AttemptRecord` is the bookkeeping of one upstream attempt against all of them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping

from kvgate.config import Config
from kvgate.routing.endpoints import Endpoint, Fleet
from kvgate.upstream.attempts import Verdict
from kvgate.upstream.breaker import BreakerState, EjectionGroup, EndpointBreaker
from kvgate.upstream.observer import NULL_OBSERVER, ResilienceObserver
from kvgate.upstream.retry_budget import RetryBudget
from kvgate.upstream.settings import ResilienceConfig
from kvgate.upstream.throttle import AdaptiveThrottle


class Resilience:
    def __init__(
        self, config: Config, fleet: Fleet, observer: ResilienceObserver = NULL_OBSERVER
    ) -> None:
        settings: ResilienceConfig = config.resilience
        self.settings = settings
        self.observer = observer
        self.resume_pools = frozenset(p.name for p in config.pools if p.resume)
        self.budgets = {p.name: RetryBudget(settings.retry_budget) for p in fleet.pools}
        self.throttles = {p.name: AdaptiveThrottle(settings.throttle) for p in fleet.pools}
        self.breakers: dict[Endpoint, EndpointBreaker] = {}
        self._pool_endpoints = {p.name: list(p.endpoints) for p in fleet.pools}
        for pool in fleet.pools:
            group = EjectionGroup(settings.breaker.max_ejected_fraction)
            for endpoint in pool.endpoints:
                breaker = EndpointBreaker(endpoint.name, settings.breaker, group, observer)
                self.breakers[endpoint] = breaker
                endpoint.breaker = breaker

    def adopt(self, old: Resilience, names: Mapping[str, str]) -> None:
        """Keep the breakers of the endpoints that remain after a reload (`names`: old
        endpoint name → new name): each carries on in its state (an open breaker stays open
        until its ejection time), under this config's breaker settings and pool group, and
        still hears the attempts begun before the reload."""
        by_name = {endpoint.name: endpoint for endpoint in self.breakers}
        for old_endpoint, breaker in old.breakers.items():
            endpoint = by_name.get(names.get(old_endpoint.name, ""))
            if endpoint is None:
                continue
            fresh = self.breakers[endpoint]
            members = fresh.group.members
            members[members.index(fresh)] = breaker
            breaker.name = endpoint.name
            breaker.config = self.settings.breaker
            breaker.group = fresh.group
            breaker.observer = self.observer
            self.breakers[endpoint] = breaker
            endpoint.breaker = breaker

    def failure_is_local(self, endpoint: Endpoint) -> bool:
        """Whether a failure of `endpoint` is its own and not its pool's: no other endpoint of
        the pool that routing may use is failing (consecutive failures, breaker not closed),
        and at least one of them is serving (requests in flight, or a success within the
        breaker's window). Retrying away from such an endpoint moves a request from a dead
        engine to live ones; it is not the extra load on a sick pool that budgets exist to
        stop."""
        now = time.monotonic()
        serving = False
        for other in self._pool_endpoints.get(endpoint.pool, ()):
            if other is endpoint or not other.routable:
                continue
            breaker = self.breakers[other]
            if breaker.consecutive_failures or breaker.state is not BreakerState.CLOSED:
                return False
            if other.inflight or now - other.last_success < self.settings.breaker.window:
                serving = True
        return serving

    def health_recovered(self, endpoint: Endpoint) -> None:
        """Hook for the health monitor: `endpoint` passed its check after failing it."""
        breaker = self.breakers.get(endpoint)
        if breaker is not None:
            breaker.health_recovered()

    def begin(self, endpoint: Endpoint) -> AttemptRecord | None:
        """Start the bookkeeping of an attempt, or None when the pool's throttle rejects it."""
        throttle = self.throttles[endpoint.pool]
        if not throttle.admit():
            self.observer.throttled(endpoint.pool)
            return None
        return AttemptRecord(
            endpoint.name,
            self.breakers[endpoint],
            throttle,
            self.observer,
            functools.partial(self.failure_is_local, endpoint),
        )


class AttemptRecord:
    """Reports one attempt to its breaker, throttle and observer, each exactly once:
    `first_token` at commit (a half-open probe's success), then one of `succeeded`, `failed` or
    `abandoned` (client gone, gateway-side refusal: neither success nor failure)."""

    __slots__ = (
        "_committed",
        "_counted",
        "_done",
        "breaker",
        "local",
        "name",
        "observer",
        "throttle",
        "token",
    )

    def __init__(
        self,
        name: str,
        breaker: EndpointBreaker,
        throttle: AdaptiveThrottle,
        observer: ResilienceObserver,
        local: Callable[[], bool] = lambda: False,
    ) -> None:
        self.name = name
        self.local = local  # whether a failure now is the endpoint's own (see Resilience)
        self.breaker = breaker
        self.throttle = throttle
        self.observer = observer
        self.token = breaker.begin()
        self._committed = False
        self._counted = False
        self._done = False

    @property
    def probe(self) -> bool:
        return self.breaker.is_probe(self.token)

    def first_token(self) -> None:
        if not self._committed:
            self._committed = True
            self.breaker.committed(self.token)
            self._count(accepted=True)

    def succeeded(self) -> None:
        if self._done:
            return
        self._done = True
        self._committed = True
        self.breaker.success(self.token)
        self._count(accepted=True)
        self.observer.attempt_finished(self.name, "ok")

    def failed(self, verdict: Verdict) -> None:
        if verdict.released:
            self.abandoned()
            return
        if self._done:
            return
        self._done = True
        if verdict.endpoint_failure:
            self.breaker.failure(self.token)
        else:
            self.breaker.release(self.token)
        if verdict.hold:
            self.breaker.hold(verdict.hold)
        if verdict.endpoint_failure and self.local():
            # One dead engine is not the pool refusing work: the pool's throttle (which sheds
            # load when the pool as a whole fails) does not count it.
            self._counted = True
        else:
            self._count(accepted=not verdict.overload)
        result = (
            "failure"
            if verdict.endpoint_failure
            else "overload"
            if verdict.overload
            else "client_error"
        )
        self.observer.attempt_finished(self.name, result)

    def _count(self, accepted: bool) -> None:
        """Report the attempt to the throttle once: at its first token, or at its end."""
        if not self._counted:
            self._counted = True
            self.throttle.record(accepted)

    def abandoned(self) -> None:
        if self._done:
            return
        self._done = True
        self.breaker.release(self.token)
        self.observer.attempt_finished(self.name, "released")
