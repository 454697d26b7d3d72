"""What the resilience layer reports: one method per event, implemented by the metrics.

Kept as a protocol so that breakers, budgets and the forwarder never import the metrics
package and unit tests can pass `NULL_OBSERVER`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class ResilienceObserver(Protocol):
    def breaker_transition(self, endpoint: str, old: str, new: str) -> None:
        """A breaker changed state (closed, open, half_open)."""

    def ejection_skipped(self, endpoint: str) -> None:
        """A breaker tripped but its pool already had the maximum share ejected."""

    def attempt_finished(self, endpoint: str, result: str) -> None:
        """One upstream attempt ended: ok, failure, client_error, overload or released."""

    def token_gap_recorder(self, route: str) -> Callable[[float], None]:
        """What to call with the seconds between two consecutive chunks relayed to a stream's
        client on `route` (asked once per stream: the call per chunk must stay cheap)."""

    def retry(self, pool: str, reason: str) -> None:
        """A retry was dispatched after an attempt failed with error code `reason`."""

    def retry_denied(self, pool: str, reason: str) -> None:
        """A retriable failure was not retried: budget, throttle, deadline, attempts,
        no_endpoint."""

    def throttled(self, pool: str) -> None:
        """An attempt was rejected locally by the client-side throttle."""

    def resumed(self, pool: str, outcome: str, overhead_tokens: int) -> None:
        """A broken stream was (or could not be) resumed; overhead = prompt tokens re-read."""


class NullObserver:
    """Ignores every event (unit tests subclass it to record the ones they check)."""

    def breaker_transition(self, endpoint: str, old: str, new: str) -> None:
        pass

    def ejection_skipped(self, endpoint: str) -> None:
        pass

    def attempt_finished(self, endpoint: str, result: str) -> None:
        pass

    def token_gap_recorder(self, route: str) -> Callable[[float], None]:
        return _ignore_gap

    def retry(self, pool: str, reason: str) -> None:
        pass

    def retry_denied(self, pool: str, reason: str) -> None:
        pass

    def throttled(self, pool: str) -> None:
        pass

    def resumed(self, pool: str, outcome: str, overhead_tokens: int) -> None:
        pass


def _ignore_gap(seconds: float) -> None:
    pass


NULL_OBSERVER: ResilienceObserver = NullObserver()
