"""Scorers: how good each candidate endpoint is for a request, as a value in [0, 1].

A scorer is a plugin: `NAME`, a `Params` model with defaults, a plain
constructor, registration in `kvgate/routing/plugins.py`. Calling it is pure over precomputed
data: the prefix match (`ctx.prefix`, computed once per request by the picker) and each
candidate's load snapshot (`EndpointLoad`, taken once per decision by the picker). It returns
one value per candidate, higher is better, nominally in [0, 1]; the picker clamps and weights
them centrally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvgate.routing.endpoints import EndpointLoad
from kvgate.types import RequestContext


class NoParams(BaseModel):
    """Parameters of a plugin that takes none (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Scorer(Protocol):
    NAME: ClassVar[str]

    def __call__(self, ctx: RequestContext, candidates: Sequence[EndpointLoad]) -> list[float]:
        """One score per candidate, higher is better, in [0, 1]. Pure."""
        ...


def _inverse_min_max(values: Sequence[float]) -> list[float]:
    """1 for the smallest value, 0 for the largest, linear between; all 1 when equal."""
    low, high = min(values), max(values)
    if high <= low:
        return [1.0] * len(values)
    span = high - low
    return [(high - v) / span for v in values]


class PrefixMatchScorer:
    """Fraction of the prompt's hashed blocks the endpoint probably holds."""

    NAME = "prefix_match"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, ctx: RequestContext, candidates: Sequence[EndpointLoad]) -> list[float]:
        prefix = ctx.prefix
        if prefix is None:
            return [0.0] * len(candidates)
        return [prefix.match_ratio(c.name) for c in candidates]


class QueueDepthScorer:
    """Fewer requests waiting for their first token is better (min-max across candidates)."""

    NAME = "queue_depth"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, ctx: RequestContext, candidates: Sequence[EndpointLoad]) -> list[float]:
        return _inverse_min_max([c.queued_requests for c in candidates])


class KvUsageScorer:
    """More free KV cache is better: 1 - KV use (0 use when telemetry is stale)."""

    NAME = "kv_usage"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, ctx: RequestContext, candidates: Sequence[EndpointLoad]) -> list[float]:
        return [1.0 - c.kv_usage for c in candidates]


class InflightScorer:
    """Fewer requests in flight from this gateway is better (min-max across candidates)."""

    NAME = "inflight"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, ctx: RequestContext, candidates: Sequence[EndpointLoad]) -> list[float]:
        return _inverse_min_max([float(c.total_inflight) for c in candidates])


class PredictedTtftParams(NoParams):
    """`decode_token_weight`: prefill tokens one decoding sequence costs a new request's first
    step (step time per sequence ÷ prefill time per token, ≈ 2 on an 8B model);
    `base_tokens`: the fixed cost of one engine step in prefill tokens (≈ 15 ms ÷ 0.1 ms);
    `miss_weight`: what one prompt token the endpoint does not hold costs, in prefill tokens,
    before the delay it adds to others (below). Above 1 it prices what a cold prefill does to
    later requests: the engine spends the compute (1) and the new blocks push out cached
    prefixes that later requests would reuse (≈ 1 more). At 1 the cost is this request's own
    time to first token alone, and under load a group moves off its prefix holder as soon as
    the queue there outgrows one cold prefill elsewhere: every engine ends up prefilling every
    prefix (measured in benchmarks/RESULTS.md).

    Each uncached token also delays every request that queues behind it on that engine; the
    requests waiting there now stand for those (a steady queue refills as fast as it drains),
    so a miss costs `miss_weight` + `queue_miss_weight` times the endpoint's queued requests per
    token (1: each of them is delayed by the whole recompute; 0: the cost above alone). An
    idle engine takes a spilled prefix for the price of its compute; a busy one only when the
    holder's queue outweighs the delay the recompute would spread over the busy engine's
    queue."""

    decode_token_weight: float = Field(2.0, ge=0)
    base_tokens: float = Field(150.0, gt=0)
    miss_weight: float = Field(2.0, ge=1)
    queue_miss_weight: float = Field(1.0, ge=0)


def predicted_cost_tokens(
    ctx: RequestContext, candidates: Sequence[EndpointLoad], params: PredictedTtftParams
) -> list[float]:
    """Predicted cost per candidate in prefill-token units: the fixed step cost, the prompt
    tokens not cached there (times `miss_weight` plus `queue_miss_weight` per request queued
    there), the prefill work queued ahead and the decoding sequences."""
    prefix = ctx.prefix
    base, per_sequence = params.base_tokens, params.decode_token_weight
    if prefix is None:
        return [base + c.queued_tokens + per_sequence * c.active_sequences for c in candidates]
    uncached = prefix.uncached_by_endpoint([c.name for c in candidates])
    miss, per_queued = params.miss_weight, params.queue_miss_weight
    return [
        base
        + (miss + per_queued * c.queued_requests) * u
        + c.queued_tokens
        + per_sequence * c.active_sequences
        for c, u in zip(candidates, uncached, strict=True)
    ]


class PredictedTtftScorer:
    """kvgate's objective: the lowest predicted cost scores 1, others best ÷ theirs."""

    NAME = "predicted_ttft"
    Params = PredictedTtftParams

    def __init__(self, params: PredictedTtftParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, ctx: RequestContext, candidates: Sequence[EndpointLoad]) -> list[float]:
        costs = predicted_cost_tokens(ctx, candidates, self.params)
        best = min(costs)
        return [best / c for c in costs]


class EndpointCostParams(NoParams):
    label: str = "cost"
    default: float = Field(1.0, gt=0)


class EndpointCostScorer:
    """Cheaper endpoints (numeric `cost` label, e.g. $ per GPU-hour) score higher: min ÷ own."""

    NAME = "endpoint_cost"
    Params = EndpointCostParams

    def __init__(self, params: EndpointCostParams | None = None) -> None:
        self.params = params or self.Params()

    def _cost(self, candidate: EndpointLoad) -> float:
        try:
            value = float(candidate.endpoint.labels.get(self.params.label, self.params.default))
        except ValueError:
            return self.params.default
        return value if value > 0 else self.params.default

    def __call__(self, ctx: RequestContext, candidates: Sequence[EndpointLoad]) -> list[float]:
        costs = [self._cost(c) for c in candidates]
        cheapest = min(costs)
        return [cheapest / c for c in costs]


class SessionAffinityScorer:
    """1 for the endpoint that served the request's session (user / session / workflow id)
    most recently, 0 for the others."""

    NAME = "session_affinity"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, ctx: RequestContext, candidates: Sequence[EndpointLoad]) -> list[float]:
        target = ctx.prefix.affinity if ctx.prefix is not None else None
        return [1.0 if c.name == target else 0.0 for c in candidates]
