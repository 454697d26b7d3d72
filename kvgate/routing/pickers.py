"""Pickers: the final choice among the candidates that passed the filters.

A picker is a plugin: `NAME`, `Params` with defaults, a plain constructor,
registration in `kvgate/routing/plugins.py`. It gets the candidates' load snapshots
(`EndpointLoad`) and, when the policy has scorers, their weighted scores in [0, 1]; it returns
the index of the chosen candidate. Load means `EndpointLoad.requests`: the gateway's in-flight
count, or the engine's own queued + running count when that is higher (work from elsewhere).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvgate.routing.endpoints import EndpointLoad
from kvgate.routing.match import PrefixMatch
from kvgate.types import RequestContext


class NoParams(BaseModel):
    """Parameters of a plugin that takes none (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Picker(Protocol):
    NAME: ClassVar[str]

    def __call__(
        self,
        ctx: RequestContext,
        candidates: Sequence[EndpointLoad],
        scores: Sequence[float] | None,
    ) -> int:
        """Index into `candidates` (never empty) of the endpoint to use."""
        ...


def least_loaded(rng: random.Random, loads: Sequence[float]) -> int:
    """Index of the lowest load; ties broken at random."""
    least = min(loads)
    return rng.choice([i for i, load in enumerate(loads) if load == least])


class RandomParams(NoParams):
    seed: int | None = None


class RandomPicker:
    NAME = "random"
    Params = RandomParams

    def __init__(self, params: RandomParams | None = None) -> None:
        self.params = params or self.Params()
        self._rng = random.Random(self.params.seed)

    def __call__(
        self,
        ctx: RequestContext,
        candidates: Sequence[EndpointLoad],
        scores: Sequence[float] | None,
    ) -> int:
        return self._rng.randrange(len(candidates))


class RoundRobinPicker:
    """Cycles through the candidates, one turn counter per model."""

    NAME = "round_robin"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or self.Params()
        self._turn: dict[str, int] = {}

    def __call__(
        self,
        ctx: RequestContext,
        candidates: Sequence[EndpointLoad],
        scores: Sequence[float] | None,
    ) -> int:
        turn = self._turn.get(ctx.model, 0)
        self._turn[ctx.model] = turn + 1
        return turn % len(candidates)


class LeastLoadedPicker:
    """Fewest requests (`EndpointLoad.requests`); ties broken at random."""

    NAME = "least_loaded"
    Params = RandomParams

    def __init__(self, params: RandomParams | None = None) -> None:
        self.params = params or self.Params()
        self._rng = random.Random(self.params.seed)

    def __call__(
        self,
        ctx: RequestContext,
        candidates: Sequence[EndpointLoad],
        scores: Sequence[float] | None,
    ) -> int:
        return least_loaded(self._rng, [c.requests for c in candidates])


class MaxScoreParams(NoParams):
    """`tie_margin`: scores within this of the best are near ties. `ties` decides them:
    `eviction` (default) takes the near ties where the request's uncached blocks would push
    out the least recently used blocks of the prefix index (where they push out nothing, the
    endpoint left with the most free blocks), then power of two choices on load among those
    still tied; `load` uses power of two choices on load alone. Near ties are endpoints the
    predicted cost cannot tell apart (no queue, the same held prefix), so the choice costs no
    time to first token; where the new blocks land decides what the fleet forgets. A single
    LRU cache as large as the fleet (what the prefix-hit ideal measures) evicts nothing while
    the fleet has room and then its globally oldest blocks; placing each new prefix on the
    emptiest cache, then where the oldest blocks are, is how a fleet of separate caches does
    the same. Filling the emptiest first also spreads new prefix groups over the engines:
    a group's later requests follow its first, so two groups started on one engine would
    share it for as long as they last.
    `hold_margin`: a prompt stays with the eligible endpoint holding the most of it while that
    endpoint scores within this of the best: leaving must be predicted to save more than the
    cost model can resolve. A move compares two predictions, the holder's cost and the other
    endpoint's, and each is off by the model's error: the move is sure to pay only if it still
    saves when the holder's cost is overestimated and the other's underestimated by the median
    relative error m of the model's time-to-first-token prediction, i.e. when the holder's
    predicted cost exceeds the other's (1 + m) / (1 - m) times. With m ≈ 19% (measured on
    the simulator by `benchmarks/routing.py --cost-model` on every workload not overloaded)
    that is 1.47 times, a score gap of 0.30 with the latency objective's weights
    (predicted_ttft carries 10 of 10.7): the default. A smaller saving is a coin toss on the
    request's wait and a sure loss of its cached tokens. 0 turns it off.
    Imbalance gate (after SGLang's cache-aware router): a candidate carrying
    more than `imbalance_abs` requests above the least loaded one and more than
    `imbalance_rel` times its load is overloaded and is not picked; the others are picked by
    score as usual.

    The gate is what stops a sticky placement (a session, a hot prefix) from overloading one
    engine: a loaded engine's queue grows faster than its queued prefill tokens show, because
    its requests wait for batch slots and KV, not only for prefill. It removes the overloaded
    holder rather than ignoring scores, so a prefix group that spills off its holder moves as
    a group: the first spilled request goes to the best other candidate, which then holds the
    prefix and outscores the rest for the group's next requests (SGLang's gate instead sends
    every request to the least loaded worker while it holds, scattering the group).
    The gate is a guard, not the balancer: the predicted cost already prices queued work and
    the delay a recompute spreads, so the defaults are SGLang's router's (64 requests and
    1.5x), a backlog of the order of one engine's whole batch. A tighter gate (16 and 1.25,
    this picker's earlier default) took holders out at ordinary load swings and cost prefix
    hits (benchmarks/RESULTS.md). Set `imbalance_abs` near your engines' `max_num_seqs`."""

    tie_margin: float = Field(0.02, ge=0, le=1)
    ties: Literal["eviction", "load"] = "eviction"
    hold_margin: float = Field(0.3, ge=0, le=1)
    imbalance_abs: float = Field(64, ge=0)
    imbalance_rel: float = Field(1.5, ge=1)
    seed: int | None = None


class MaxScorePicker:
    NAME = "max_score"
    Params = MaxScoreParams

    def __init__(self, params: MaxScoreParams | None = None) -> None:
        self.params = params or self.Params()
        self._rng = random.Random(self.params.seed)

    def not_overloaded(self, loads: Sequence[float]) -> list[int]:
        """Indices of the candidates the imbalance gate lets through (never empty: the least
        loaded always passes)."""
        low = min(loads)
        p = self.params
        return [
            i
            for i, load in enumerate(loads)
            if load - low <= p.imbalance_abs or load <= p.imbalance_rel * low
        ]

    def _holders_within_margin(
        self,
        prefix: PrefixMatch,
        candidates: Sequence[EndpointLoad],
        scores: Sequence[float],
        eligible: list[int],
    ) -> list[int]:
        """The eligible candidates holding the most of the prompt, when one of them scores
        within `hold_margin` of the best; else `eligible` unchanged."""
        held = [prefix.held_blocks(candidates[i].name) for i in eligible]
        most = max(held)
        if most <= 0:
            return eligible
        floor = max(scores[i] for i in eligible) - self.params.hold_margin
        keep = [i for i, h in zip(eligible, held, strict=True) if h == most and scores[i] >= floor]
        return keep or eligible

    @staticmethod
    def _evicting_least(
        prefix: PrefixMatch, candidates: Sequence[EndpointLoad], ties: list[int]
    ) -> list[int]:
        """The near ties where the prompt's uncached blocks push out the least recently used
        blocks; where they push out none, those left with the most room."""
        touched = [prefix.eviction_touch(candidates[i].name) for i in ties]
        oldest = min(touched)
        ties = [i for i, t in zip(ties, touched, strict=True) if t == oldest]
        if oldest == -math.inf and len(ties) > 1:
            rooms = [prefix.room(candidates[i].name) for i in ties]
            most = max(rooms)
            ties = [i for i, r in zip(ties, rooms, strict=True) if r == most]
        return ties

    def __call__(
        self,
        ctx: RequestContext,
        candidates: Sequence[EndpointLoad],
        scores: Sequence[float] | None,
    ) -> int:
        loads = [c.requests for c in candidates]
        if scores is None:
            return least_loaded(self._rng, loads)
        eligible = self.not_overloaded(loads)
        prefix = ctx.prefix
        if prefix is not None and self.params.hold_margin > 0:
            eligible = self._holders_within_margin(prefix, candidates, scores, eligible)
        best = max(scores[i] for i in eligible)
        ties = [i for i in eligible if scores[i] >= best - self.params.tie_margin]
        if len(ties) > 1 and self.params.ties == "eviction" and prefix is not None:
            ties = self._evicting_least(prefix, candidates, ties)
        if len(ties) == 1:
            return ties[0]
        first, second = self._rng.sample(ties, 2)
        if loads[second] < loads[first] or (
            loads[second] == loads[first] and scores[second] > scores[first]
        ):
            return second
        return first
