"""Client-side adaptive throttling toward one pool (Google SRE book, "Handling Overload").

Over the last `window` seconds the gateway counts the upstream requests it attempted and the
ones the pool accepted (answered with anything but a failure or an overload signal). A new
attempt is rejected locally with probability

    p = max(0, (requests - K x accepts) / (requests + 1))

While the pool is healthy p is 0; when it fails the gateway stops sending most of the traffic
instead of turning every request into an upstream failure. Rejected attempts count as
requests, which keeps p high while the outage lasts; as soon as a few pass and succeed, p
falls back towards 0 (no retry storm on recovery). An admitted attempt is counted when its
outcome is known (a stream at its first token, a unary answer when it arrives, a failure when
it fails; a client that leaves first is not counted), so long streams still in flight never
read as unanswered requests. Below `min_requests` in the window the
throttle stays open: one failure of a quiet pool says nothing about an outage.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvgate.upstream.settings import ThrottleConfig
from kvgate.upstream.window import RollingCounts

_REQUESTS, _ACCEPTS = 0, 1


class AdaptiveThrottle:
    def __init__(
        self,
        config: ThrottleConfig,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng or random.Random()
        self._window = RollingCounts(config.window, series=2)

    def rejection_probability(self) -> float:
        now = self.clock()
        requests = self._window.total(_REQUESTS, now)
        if requests < self.config.min_requests:
            return 0.0
        accepts = self._window.total(_ACCEPTS, now)
        return max(0.0, (requests - self.config.k * accepts) / (requests + 1))

    def admit(self) -> bool:
        """False when the attempt must be rejected locally (a rejection counts as a request
        not accepted); an admitted attempt reports its outcome through `record`."""
        if not self.config.enabled:
            return True
        if self.rng.random() < self.rejection_probability():
            self._window.add(_REQUESTS, self.clock())
            return False
        return True

    def record(self, accepted: bool) -> None:
        """The outcome of an admitted attempt: accepted by the pool, or failed/overloaded."""
        if self.config.enabled:
            now = self.clock()
            self._window.add(_REQUESTS, now)
            if accepted:
                self._window.add(_ACCEPTS, now)
