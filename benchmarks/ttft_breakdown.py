"""Where the slowest requests' time to first token went, from the client and the engines.

The client knows each request's time to first token from its intended send time and the id of
its answer; each simulated engine knows, per answer id, how long the request took inside it and
how that time split (`GET /sim/first-tokens`, docs/simulator.md): waiting for a step, the fixed
cost of the steps it took part in, its own prefill, other requests' prefill sharing those
steps, sequences decoding in them, and steps running late on a busy host. What the engine did
not see is outside it: the router, the sockets and the client. Set beside each request's TTFT
floor (its own prefill of what even an infinite cache misses, alone on an engine), the means
over the slowest tenth say what a router's p90 is made of: a placement that gave up cache hits
shows as own prefill above the floor, one that queued behind other work as waiting and shared
prefill.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

# The engine's parts, in the order a request meets them, then what the engine did not see.
ENGINE_PARTS = ("waiting", "step_base", "own_prefill", "shared_prefill", "decodes", "overrun")
KEYS = ("n", "ttft", "floor", "outside", *ENGINE_PARTS)


class Answered(Protocol):
    ttft: float | None
    response_id: str
    error: str


def slowest_tenth(
    results: Sequence[Answered],
    floors: Sequence[float] | None,
    first_tokens: Mapping[str, Mapping[str, Any]],
) -> dict[str, float]:
    """Means (s) over the successful requests whose client TTFT is at or above the p90 (nearest
    rank) and whose answer id an engine recorded: `ttft`, `floor` (NaN without `floors`, given
    in the order of `results`), `outside` (client TTFT minus the engine's) and each engine part;
    `n` is how many requests the means cover. Every key is NaN (n 0) when none matched."""
    timed = [
        (k, r.ttft, r.response_id)
        for k, r in enumerate(results)
        if not r.error and r.ttft is not None
    ]
    ordered = sorted(ttft for _, ttft, _ in timed)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else math.inf
    slow = [
        (k, ttft, first_tokens[rid])
        for k, ttft, rid in timed
        if ttft >= p90 and rid in first_tokens
    ]
    if not slow:
        return {key: (0.0 if key == "n" else math.nan) for key in KEYS}
    out = {
        "n": float(len(slow)),
        "ttft": statistics.fmean(ttft for _, ttft, _ in slow),
        "floor": statistics.fmean(floors[k] for k, _, _ in slow) if floors else math.nan,
        "outside": statistics.fmean(ttft - engine["ttft"] for _, ttft, engine in slow),
    }
    for part in ENGINE_PARTS:
        out[part] = statistics.fmean(engine[part] for _, _, engine in slow)
    return out
