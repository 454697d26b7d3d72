"""Choosing the endpoint for a request: the `pick` stage of the chain.

PoolRouter ── model → home pool ──▶ PolicyPicker (one per pool, its RoutingPolicy)
    candidates (routable, serving the model, in the profile's pools, not excluded)
    → prefix match computed once per request (producer; scorers only read it)
    → shortlist of a pool larger than `routing.max_candidates` (holders, session, window)
    → one load snapshot per candidate (EndpointLoad), read by everything after it
    → filters → saturation (→ fallback pool / model, or queue / reject)
    → scorers, clamped and weighted here → picker → record the decision in the index
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from kvgate.config import Config
from kvgate.errors import NotFound, Overloaded
from kvgate.routing.affinity import SessionAffinity, session_key
from kvgate.routing.endpoints import Endpoint, EndpointLoad, Fleet
from kvgate.routing.match import PrefixMatch
from kvgate.routing.policy import RoutingPolicy, RoutingProfile, builtin_policy
from kvgate.routing.prefix_hasher import PrefixHasher
from kvgate.routing.prefix_index import PrefixIndex
from kvgate.routing.prompt_text import prompt_text
from kvgate.routing.settings import ExplainMode, RoutingConfig
from kvgate.routing.telemetry import EngineTelemetry
from kvgate.types import RequestContext

EXPLAIN_REQUEST_HEADER = b"x-kvgate-explain"
EXPLAIN_RESPONSE_HEADER = b"x-kvgate-route-explain"


class EndpointPicker(Protocol):
    def choose(self, ctx: RequestContext, exclude: Collection[Endpoint] = ()) -> Endpoint:
        """The endpoint for `ctx` among routable ones serving `ctx.model`, never one in
        `exclude` (endpoints already tried for this request). Raises NotFound for a model
        nobody serves and Overloaded when no endpoint can take it now."""
        ...


def routable_candidates(
    fleet: Fleet,
    model: str,
    exclude: Collection[Endpoint] = (),
    pools: Collection[str] | None = None,
) -> list[Endpoint]:
    """Healthy endpoints serving `model` whose breaker admits traffic (and, with the `exclude`
    stale policy, whose telemetry is fresh), in `pools` if given, minus `exclude`."""
    candidates = [
        e
        for e in fleet.candidates(model)
        if e.routable and e not in exclude and (pools is None or e.pool in pools)
    ]
    if not candidates:
        if not fleet.serves(model):
            raise NotFound(
                f"The model '{model}' does not exist or is not served here",
                param="model",
                code="model_not_found",
            )
        raise Overloaded(
            f"No healthy endpoint serves the model '{model}' right now",
            code="no_healthy_endpoint",
            retry_after=1,
        )
    return candidates


@dataclass(slots=True)
class RoutingServices:
    """State shared by every pool's picker in one process: the prefix index, the hasher, the
    session table, and the explain setting."""

    index: PrefixIndex
    hasher: PrefixHasher
    affinity: SessionAffinity
    explain: ExplainMode
    chars_per_token: float
    max_candidates: int = 0
    rng: random.Random = field(default_factory=random.Random)

    @classmethod
    def from_config(
        cls,
        routing: RoutingConfig,
        make_index: Callable[[int, float, int], PrefixIndex] = PrefixIndex,
    ) -> RoutingServices:
        """`make_index(default_capacity, ttl, max_capacity)` builds the prefix index (a
        shared one when replicas sync through a store)."""
        prefix = routing.prefix
        return cls(
            index=make_index(prefix.default_capacity, prefix.ttl, prefix.max_capacity),
            hasher=PrefixHasher(prefix.block_chars, prefix.max_blocks),
            affinity=SessionAffinity(routing.affinity_ttl, routing.affinity_max_sessions),
            explain=routing.explain,
            chars_per_token=prefix.chars_per_token,
            max_candidates=routing.max_candidates,
        )

    def shortlist(self, ctx: RequestContext, endpoints: list[Endpoint]) -> list[Endpoint]:
        """At most `max_candidates` of a larger pool, so that a decision's cost does not grow
        with the pool: the endpoints holding the deepest part of the prompt (up to three
        quarters of the places, ties from a random starting point), the session's endpoint, then
        the rest from a window of the pool at a random offset, so every endpoint is as likely
        to be considered (the power of d choices: the best of a random 16 is nearly always as
        lightly loaded as the best of all)."""
        limit = self.max_candidates
        if not limit or len(endpoints) <= limit:
            return endpoints
        rng = self.rng
        prefix = ctx.prefix
        keep: list[Endpoint] = []
        if prefix is not None:
            depth = prefix.matched.get
            if prefix.matched:
                keep = [e for e in endpoints if depth(e.name, 0)]
            places = limit - limit // 4
            if len(keep) > places:
                turn = rng.randrange(len(keep))
                keep = keep[turn:] + keep[:turn]
                keep.sort(key=lambda e: depth(e.name, 0), reverse=True)  # stable: ties rotate
                del keep[places:]
            if prefix.affinity is not None and all(e.name != prefix.affinity for e in keep):
                keep += [e for e in endpoints if e.name == prefix.affinity][:1]
        start = rng.randrange(len(endpoints))
        wrapped = max(0, start + limit - len(endpoints))
        window = endpoints[start : start + limit] + endpoints[:wrapped]
        if not keep:
            return window
        # A window as large as the places left plus the kept ones has enough others in it.
        kept = set(keep)
        others = [e for e in window if e not in kept]
        return keep + others[: limit - len(keep)]

    def size_index(self, endpoint: Endpoint, telemetry: EngineTelemetry) -> None:
        """Bound an endpoint's index entries by its engine's KV cache, in blocks of text."""
        if telemetry.kv_tokens is not None:
            blocks = telemetry.kv_tokens * self.chars_per_token / self.hasher.block_chars
            self.index.set_capacity(endpoint.name, max(1, int(blocks)))

    def prefix_match(self, ctx: RequestContext) -> PrefixMatch:
        """Hash the request's prompt once, match it against every endpoint and look up its
        session (the producer step; retries and fallback pools reuse it)."""
        text = prompt_text(ctx.payload)
        session = session_key(ctx)
        hashes = self.hasher.chain(text, ctx.model, ctx.cache_salt)
        return PrefixMatch(
            hashes=hashes,
            prompt_tokens=math.ceil(len(text) / self.chars_per_token),
            tokens_per_block=self.hasher.block_chars / self.chars_per_token,
            matched=self.index.match(hashes),
            session=session,
            affinity=self.affinity.get(session) if session is not None else None,
        )

    def explain_allowed(self, ctx: RequestContext) -> bool:
        """`never`; `always` (anyone who sends `x-kvgate-explain: 1`); or `admin`: the auth
        stage found `x-kvgate-explain: 1` with a valid admin key in `x-kvgate-admin-key`
        (or the gateway is open) and set `ctx.explain`."""
        if self.explain == "never":
            return False
        if self.explain == "admin":
            return ctx.explain
        return any(k == EXPLAIN_REQUEST_HEADER and v.strip() == b"1" for k, v in ctx.client_headers)


def weighted_scores(
    ctx: RequestContext, candidates: Sequence[EndpointLoad], scorers: Sequence[tuple[object, float]]
) -> tuple[list[float], list[list[float]]]:
    """Each scorer's values clamped to [0, 1], and their weighted mean per candidate."""
    total_weight = sum(w for _, w in scorers)
    columns: list[list[float]] = []
    totals: list[float] | None = None
    for scorer, weight in scorers:
        values = [0.0 if v < 0.0 else 1.0 if v > 1.0 else v for v in scorer(ctx, candidates)]  # type: ignore[operator]
        columns.append(values)
        share = weight / total_weight
        totals = (
            [share * v for v in values]
            if totals is None
            else [t + share * v for t, v in zip(totals, values, strict=True)]
        )
    return totals or [0.0] * len(candidates), columns


class PolicyPicker:
    """Routes requests whose home is `pool` by its `RoutingPolicy`."""

    def __init__(
        self, fleet: Fleet, pool: str, policy: RoutingPolicy, services: RoutingServices
    ) -> None:
        self.fleet = fleet
        self.pool = pool
        self.policy = policy
        self.services = services

    def choose(self, ctx: RequestContext, exclude: Collection[Endpoint] = ()) -> Endpoint:
        profile, rule = self.policy.profile_for(ctx)
        return self._choose(ctx, exclude, profile, rule, profile.pools or (self.pool,), True)

    def _choose(
        self,
        ctx: RequestContext,
        exclude: Collection[Endpoint],
        profile: RoutingProfile,
        rule: str,
        pools: Collection[str] | None,
        may_fall_back: bool,
    ) -> Endpoint:
        endpoints = routable_candidates(self.fleet, ctx.model, exclude, pools)
        if profile.uses_prefix and ctx.prefix is None:
            ctx.prefix = self.services.prefix_match(ctx)
        endpoints = self.services.shortlist(ctx, endpoints)
        now = time.monotonic()
        candidates = [EndpointLoad(e, now) for e in endpoints]  # one load snapshot each
        for keep in profile.plain_filters:
            candidates = keep(ctx, candidates)
        if not candidates:
            raise Overloaded(
                f"No endpoint for '{ctx.model}' passes the routing policy's filters",
                code="no_eligible_endpoint",
                retry_after=1,
            )
        available = candidates
        for keep in profile.saturation_filters:
            available = keep(ctx, available)
        if not available:
            if may_fall_back and profile.fallback_pool is not None:
                try:
                    return self._choose(
                        ctx, exclude, profile, rule, (profile.fallback_pool,), False
                    )
                except (NotFound, Overloaded):
                    pass
            if may_fall_back and profile.fallback_model is not None:
                _switch_model(ctx, profile.fallback_model)
                return self._choose(ctx, exclude, profile, rule, None, False)
            if profile.when_saturated == "reject":
                raise Overloaded(
                    f"Every endpoint serving '{ctx.model}' is saturated",
                    code="all_endpoints_saturated",
                    retry_after=1,
                )
            available = candidates
        scores, columns = (
            weighted_scores(ctx, available, profile.scorers) if profile.scorers else (None, [])
        )
        chosen = available[profile.picker(ctx, available, scores)].endpoint
        self._record(ctx, chosen)
        if self.services.explain_allowed(ctx):
            ctx.response_headers.append(
                (
                    EXPLAIN_RESPONSE_HEADER,
                    _explain(self.policy.name, rule, profile, available, scores, columns),
                )
            )
        return chosen

    def _record(self, ctx: RequestContext, chosen: Endpoint) -> None:
        prefix = ctx.prefix
        if prefix is None:
            return
        self.services.index.record(chosen.name, prefix.hashes)
        if prefix.session is not None:
            self.services.affinity.set(prefix.session, chosen.name)


def _switch_model(ctx: RequestContext, model: str) -> None:
    """Fallback to a smaller model: the one place routing re-serialises the body."""
    ctx.model = model
    ctx.payload["model"] = model
    ctx.body = orjson.dumps(ctx.payload)
    ctx.prefix = None  # hashes are seeded by the model


def _explain(
    policy: str,
    rule: str,
    profile: RoutingProfile,
    candidates: Sequence[EndpointLoad],
    scores: Sequence[float] | None,
    columns: Sequence[Sequence[float]],
) -> bytes:
    names = [s.NAME for s, _ in profile.scorers]
    parts = [f"policy={policy}; rule={rule}; objective={profile.objective}"]
    for i, candidate in enumerate(candidates):
        fields = [candidate.name]
        if scores is not None:
            fields.append(f"score={scores[i]:.3f}")
            fields += [
                f"{name}={column[i]:.3f}" for name, column in zip(names, columns, strict=True)
            ]
        fields.append(f"inflight={candidate.inflight}")
        parts.append(" ".join(fields))
    return "; ".join(parts).encode("ascii", "replace")


class PoolRouter:
    """The process's `EndpointPicker`: a request goes to the picker of the first pool (in
    config order) that serves its model; that pool's policy may name other pools."""

    def __init__(self, fleet: Fleet, pickers: dict[str, PolicyPicker]) -> None:
        self.fleet = fleet
        self.pickers = pickers

    def choose(self, ctx: RequestContext, exclude: Collection[Endpoint] = ()) -> Endpoint:
        pool = self.fleet.home_pool(ctx.model)
        if pool is not None:
            return self.pickers[pool].choose(ctx, exclude)
        return routable_candidates(self.fleet, ctx.model, exclude)[0]  # raises NotFound


def build_router(config: Config, fleet: Fleet, services: RoutingServices) -> PoolRouter:
    """One PolicyPicker per pool, with the pool's built-in or file policy."""
    return PoolRouter(
        fleet,
        {
            pool.name: PolicyPicker(
                fleet,
                pool.name,
                config.routing_policy(pool.name) or builtin_policy(pool.policy),
                services,
            )
            for pool in config.pools
        },
    )


class PickStage:
    """Assigns `ctx.endpoint`. The in-flight count is the forwarder's: it is taken per attempt,
    at dispatch, so that a request that is refused later never counts against an engine."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def __call__(self, ctx: RequestContext) -> None:
        ctx.endpoint = self.picker.choose(ctx)
