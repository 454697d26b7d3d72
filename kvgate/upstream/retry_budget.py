"""Retry budget of one pool: retries may add only a bounded fraction to the load.

Two forms, both enforced when configured (a retry needs both to agree):

- concurrency (Envoy): retries in flight ≤ max(min_concurrency, percent x active requests);
- rate (Finagle): retries over the last `window` seconds ≤ percent x requests over the same
  window + min_per_second x window (the reserve lets a quiet pool still retry).

When the budget is spent the request fails fast with the error of its last attempt: in an
outage every request is failing, and retrying them would only multiply the load.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvgate.upstream.settings import RetryBudgetConfig
from kvgate.upstream.window import RollingCounts

_REQUESTS, _RETRIES = 0, 1


class RetryBudget:
    """Per-pool accounting: `request_started/finished` bracket every request that reaches the
    forwarder; `try_acquire` (True: go) and `release` bracket every retry attempt."""

    def __init__(
        self, config: RetryBudgetConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.active = 0
        self.retries_inflight = 0
        self._window = RollingCounts(config.window, series=2)

    def request_started(self) -> None:
        self.active += 1
        self._window.add(_REQUESTS, self.clock())

    def request_finished(self) -> None:
        self.active -= 1

    def try_acquire(self) -> bool:
        """Take a retry from the budget; False (and nothing taken) when it is spent."""
        config = self.config
        if config.percent_of_active is not None:
            limit = max(config.min_concurrency, config.percent_of_active / 100 * self.active)
            if self.retries_inflight + 1 > limit:
                return False
        now = self.clock()
        if config.percent_of_requests is not None:
            requests = self._window.total(_REQUESTS, now)
            retries = self._window.total(_RETRIES, now)
            allowed = (
                config.percent_of_requests / 100 * requests + config.min_per_second * config.window
            )
            if retries + 1 > allowed:
                return False
        self.retries_inflight += 1
        self._window.add(_RETRIES, now)
        return True

    def release(self) -> None:
        """The retry attempt taken by `try_acquire` has ended."""
        self.retries_inflight -= 1
