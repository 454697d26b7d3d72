"""The two-sample Kolmogorov-Smirnov test, for timing side-channel tests (no scipy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def ks_two_sample(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(D, p): the largest gap between the two empirical distribution functions, and the
    asymptotic p-value of seeing a gap that large if both samples came from one distribution
    (Kolmogorov's series with Stephens' small-sample correction, as Numerical Recipes' kstwo)."""
    xs, ys = sorted(a), sorted(b)
    n, m = len(xs), len(ys)
    i = j = 0
    gap = 0.0
    while i < n and j < m:
        value = min(xs[i], ys[j])
        while i < n and xs[i] == value:
            i += 1
        while j < m and ys[j] == value:
            j += 1
        gap = max(gap, abs(i / n - j / m))
    effective = math.sqrt(n * m / (n + m))
    lam = (effective + 0.12 + 0.11 / effective) * gap
    if lam < 0.2:
        return gap, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return gap, min(1.0, max(0.0, p))
