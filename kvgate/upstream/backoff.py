"""Full-jitter exponential back-off between attempts (the AWS / Envoy scheme).

The n-th retry (n ≥ 1) waits a uniform random time in [0, min(cap, base x 2^(n-1))]: retries
of many requests spread out instead of arriving in synchronised waves.
"""

from __future__ import annotations

import random


def full_jitter_delay(
    retry: int, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """Seconds to wait before retry number `retry` (1 for the first retry)."""
    ceiling = min(cap, base * (2 ** max(0, retry - 1)))
    return (rng or random).uniform(0.0, ceiling)
