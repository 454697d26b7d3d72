"""Circuit breaker and outlier ejection for one endpoint.

    closed ──(consecutive failures ≥ N, or failure rate ≥ R over the window)──▶ open
    open ──(ejection time elapsed, or the health check sees the endpoint recover)──▶ half-open
    half-open ──(a probe commits)──▶ closed
    half-open ──(a probe fails or outlives probe_timeout)──▶ open (longer)

- A failure is an engine-side problem: refused or broken connection, 5xx, first-token or stall
  timeout, malformed stream, mid-stream crash. Client errors (4xx), client disconnects and
  deadlines the client shortened are never failures; they only release a probe slot.
- A half-open probe succeeds at its first streamed event (the commit point) or a complete
  non-stream answer, never at the response headers alone. In the closed state only complete
  answers reset the failure counts: a stream that breaks after its first token is a failure.
- Ejection time is `base_ejection x n` for the n-th consecutive ejection, capped at
  `max_ejection`; n decays to 0 after `max_ejection` seconds closed.
- An `EjectionGroup` (one per pool) refuses an ejection that would leave more than
  `max_ejected_fraction` of the pool ejected: a small pool keeps serving.
- Half-open admits at most `half_open_probes` concurrent probes; a probe's first token must
  arrive within `probe_timeout` (the relay enforces it), and a probe that has not reported by
  then no longer holds its slot, so half-open can never get stuck.
- A `Retry-After` from the engine holds the endpoint out of rotation for that long (capped by
  `max_hold`) without counting as an ejection.

`admits()` is pure (the routing `BreakerView` protocol); transitions that are due by time are
applied on the next recorded event and on `refresh()`. Each transition is reported to the
observer (a Prometheus counter in the gateway).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable
from itertools import count

from kvgate.upstream.observer import NULL_OBSERVER, ResilienceObserver
from kvgate.upstream.settings import BreakerConfig
from kvgate.upstream.window import RollingCounts

log = logging.getLogger("kvgate.resilience")

_SUCCESS, _FAILURE = 0, 1


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class EjectionGroup:
    """The breakers of one pool, and the cap on how many of them may be ejected at once."""

    def __init__(self, max_ejected_fraction: float) -> None:
        self.max_ejected_fraction = max_ejected_fraction
        self.members: list[EndpointBreaker] = []

    def may_eject(self) -> bool:
        ejected = sum(1 for b in self.members if b.state is not BreakerState.CLOSED)
        return ejected + 1 <= math.floor(len(self.members) * self.max_ejected_fraction)


class EndpointBreaker:
    def __init__(
        self,
        name: str,
        config: BreakerConfig,
        group: EjectionGroup,
        observer: ResilienceObserver = NULL_OBSERVER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.config = config
        self.group = group
        self.observer = observer
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.ejections = 0
        self.open_until = 0.0
        self.held_until = 0.0
        self._closed_since = clock()
        self._probes: dict[int, float] = {}
        self._tokens = count(1)
        self._outcomes = RollingCounts(config.window, series=2)
        group.members.append(self)

    # --- the routing view -------------------------------------------------------------

    def admits(self) -> bool:
        now = self.clock()
        if now < self.held_until:
            return False
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and now < self.open_until:
            return False
        return self._live_probes(now) < self.config.half_open_probes

    def reopens_in(self) -> float:
        now = self.clock()
        opened = self.open_until - now if self.state is BreakerState.OPEN else 0.0
        return max(0.0, self.held_until - now, opened)

    # --- attempts ----------------------------------------------------------------------

    def begin(self) -> int:
        """An attempt is dispatched here; returns its token (report it exactly once)."""
        now = self._tick()
        token = next(self._tokens)
        if self.state is BreakerState.HALF_OPEN:
            self._probes[token] = now
        return token

    def is_probe(self, token: int) -> bool:
        return token in self._probes

    def committed(self, token: int) -> None:
        """The attempt's first token arrived: a half-open probe has succeeded."""
        now = self._tick()
        if self._probes.pop(token, None) is not None and self.state is BreakerState.HALF_OPEN:
            self._close(now)

    def success(self, token: int) -> None:
        """The attempt completed. A stream that commits and then breaks is a failure for the
        closed-state counts, so they are reset here and not at the commit."""
        self.committed(token)
        if self.state is BreakerState.CLOSED:
            self.consecutive_failures = 0
            self._outcomes.add(_SUCCESS, self.clock())

    def failure(self, token: int) -> None:
        now = self._tick()
        was_probe = self._probes.pop(token, None) is not None
        if self.state is BreakerState.CLOSED:
            self.consecutive_failures += 1
            self._outcomes.add(_FAILURE, now)
            if self._tripped(now):
                self._eject(now)
        elif self.state is BreakerState.HALF_OPEN and was_probe:
            self._eject(now)

    def release(self, token: int) -> None:
        """The attempt ended with neither success nor an engine failure."""
        self._probes.pop(token, None)
        self._tick()

    def hold(self, seconds: float) -> None:
        """The engine asked for a pause (Retry-After): send it nothing for that long."""
        self.held_until = max(self.held_until, self.clock() + min(seconds, self.config.max_hold))

    def health_recovered(self) -> None:
        """The active health check saw the endpoint come back: end its ejection now."""
        if self.state is BreakerState.OPEN:
            self._transition(BreakerState.HALF_OPEN)
            self._probes.clear()

    def refresh(self) -> BreakerState:
        """Apply transitions that are due by time; returns the current state."""
        self._tick()
        return self.state

    # --- internals ---------------------------------------------------------------------

    def _live_probes(self, now: float) -> int:
        horizon = now - self.config.probe_timeout
        return sum(1 for started in self._probes.values() if started > horizon)

    def _tick(self) -> float:
        now = self.clock()
        if self.state is BreakerState.OPEN and now >= self.open_until:
            self._probes.clear()
            self._transition(BreakerState.HALF_OPEN)
        if self.state is BreakerState.HALF_OPEN and self._live_probes(now) < len(self._probes):
            self._eject(now)  # a probe outlived its timeout without reporting
        return now

    def _tripped(self, now: float) -> bool:
        config = self.config
        if self.consecutive_failures >= config.consecutive_failures:
            return True
        failures = self._outcomes.total(_FAILURE, now)
        total = failures + self._outcomes.total(_SUCCESS, now)
        return total >= config.failure_rate_min_requests and failures / total >= config.failure_rate

    def _eject(self, now: float) -> None:
        if self.state is BreakerState.CLOSED:
            if not self.group.may_eject():
                self.consecutive_failures = 0
                self._outcomes.clear()
                self.observer.ejection_skipped(self.name)
                return
            if now - self._closed_since >= self.config.max_ejection:
                self.ejections = 0
        self.ejections += 1
        self.open_until = now + min(
            self.config.max_ejection, self.config.base_ejection * self.ejections
        )
        self._probes.clear()
        log.warning(
            "endpoint %s ejected by its breaker for %.0f s (ejection %d: %d consecutive failures)",
            self.name,
            self.open_until - now,
            self.ejections,
            self.consecutive_failures,
        )
        if self.state is not BreakerState.OPEN:
            self._transition(BreakerState.OPEN)

    def _close(self, now: float) -> None:
        if self.state is not BreakerState.CLOSED:
            log.info("endpoint %s back in rotation: its breaker closed", self.name)
        self.consecutive_failures = 0
        self._outcomes.clear()
        self._closed_since = now
        self._probes.clear()
        self._transition(BreakerState.CLOSED)

    def _transition(self, new: BreakerState) -> None:
        old, self.state = self.state, new
        self.observer.breaker_transition(self.name, old.value, new.value)
