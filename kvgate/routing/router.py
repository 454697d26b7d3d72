"""Choosing the endpoint for a request: the `model` and `pick` stages of the chain.

PoolRouter ── model → home pool ──▶ PolicyPicker (one per pool, its RoutingPolicy)
    candidates (`Fleet.serving`: routable, serving the model, in the profile's pools)
    → prefix match computed once per request (producer; scorers only read it)
    → shortlist of a pool larger than `routing.max_candidates` (holders, session, window)
    → one load snapshot per candidate (EndpointLoad), read by everything after it
    → filters → saturation (→ fallback pool, or queue / reject)
    → scorers, clamped and weighted here → picker → record the decision in the index

A policy's `fallback.model` (a smaller model when the pool is saturated) is settled before
admission (`ModelFallbackStage`), so that quota is reserved and the intent classified under the
model the request will really use; picking never changes the model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Collection, Sequence
from typing import Protocol

import orjson

from kvgate.errors import NotFound, Overloaded
from kvgate.request_options import ROUTE_EXPLAIN
from kvgate.routing.endpoints import Endpoint, EndpointLoad, Fleet
from kvgate.routing.plugins import Filter, Scorer
from kvgate.routing.policy import RoutingPolicy, RoutingProfile
from kvgate.routing.response_ids import check_available, check_residency
from kvgate.routing.services import RoutingServices
from kvgate.types import RequestContext


class EndpointPicker(Protocol):
    def choose(self, ctx: RequestContext, exclude: Collection[Endpoint] = ()) -> Endpoint:
        """The endpoint for `ctx` among routable ones serving `ctx.model`, never one in
        `exclude` (endpoints already tried for this request). Raises NotFound for a model
        nobody serves and Overloaded when no endpoint can take it now."""
        ...

    def refused(self, ctx: RequestContext, endpoint: Endpoint) -> None:
        """`endpoint`'s engine answered `ctx` with an error instead of running it: what the
        decision to send it there recorded is forgotten."""
        ...


def routable_candidates(
    fleet: Fleet,
    model: str,
    exclude: Collection[Endpoint] = (),
    pools: Collection[str] | None = None,
) -> list[Endpoint]:
    """`Fleet.serving`, or NotFound / Overloaded when it is empty."""
    candidates = fleet.serving(model, exclude=exclude, pools=pools)
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
            retry_after=fleet.back_in(model, exclude, pools),
        )
    return candidates


def weighted_scores(
    ctx: RequestContext,
    candidates: Sequence[EndpointLoad],
    scorers: Sequence[tuple[Scorer, float]],
) -> tuple[list[float], list[list[float]]]:
    """Each scorer's values clamped to [0, 1], and their weighted mean per candidate."""
    total_weight = sum(w for _, w in scorers)
    columns: list[list[float]] = []
    totals: list[float] | None = None
    for scorer, weight in scorers:
        values = [0.0 if v < 0.0 else 1.0 if v > 1.0 else v for v in scorer(ctx, candidates)]
        columns.append(values)
        share = weight / total_weight
        totals = (
            [share * v for v in values]
            if totals is None
            else [t + share * v for t, v in zip(totals, values, strict=True)]
        )
    return totals or [0.0] * len(candidates), columns


def _filtered(
    ctx: RequestContext, filters: Sequence[Filter], candidates: list[EndpointLoad]
) -> list[EndpointLoad]:
    for keep in filters:
        candidates = keep(ctx, candidates)
    return candidates


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

    def refused(self, ctx: RequestContext, endpoint: Endpoint) -> None:
        if ctx.prefix is not None:
            self.services.forget_refused(ctx.prefix, endpoint.name)

    def uncached_tokens(self, ctx: RequestContext) -> int:
        """Prompt tokens the endpoint holding most of this prompt would prefill (the whole
        prompt when the policy does not route by prefix). Leaves `ctx.prefix` unset: the
        decision matches again when it is made, on the index as it is then."""
        profile, _ = self.policy.profile_for(ctx)
        endpoints = self.fleet.serving(ctx.model, pools=profile.pools or (self.pool,))
        if not profile.uses_prefix or not endpoints:
            return ctx.view.prompt_tokens
        match = self.services.prefix_match(ctx)
        return min(match.uncached_by_endpoint([e.name for e in endpoints]))

    def fallback_model(self, ctx: RequestContext) -> str | None:
        """The policy's smaller model when every endpoint this request could use is
        saturated (its pools, then its fallback pool), else None. Not when there is no such
        endpoint at all (drained, unhealthy, or kept out by residency and the other filters):
        saturation is what the fallback answers, and the request then gets the 503 that
        says why, for the model it asked for. Whether the smaller model can take the request
        is its own pool's question (`PoolRouter.fallback_model`)."""
        profile, _ = self.policy.profile_for(ctx)
        if profile.fallback_model is None:
            return None
        pools = [profile.pools or (self.pool,)]
        if profile.fallback_pool is not None:
            pools.append((profile.fallback_pool,))
        usable = False
        for names in pools:
            some, unsaturated = self.availability(ctx, ctx.model, profile, names)
            if unsaturated:
                return None
            usable = usable or some
        return profile.fallback_model if usable else None

    def has_unsaturated(self, ctx: RequestContext, model: str) -> bool:
        """Whether `model` has an endpoint in this pool's policy's candidate pools that
        passes the policy's filters for `ctx`, saturation included."""
        profile, _ = self.policy.profile_for(ctx)
        return self.availability(ctx, model, profile, profile.pools or (self.pool,))[1]

    def availability(
        self, ctx: RequestContext, model: str, profile: RoutingProfile, pools: Collection[str]
    ) -> tuple[bool, bool]:
        """Whether `model` has endpoints in `pools` that pass `profile`'s filters for `ctx`,
        and whether any of them also passes its saturation filters."""
        now = time.monotonic()
        endpoints = self.fleet.serving(model, pools=pools)
        loads = _filtered(ctx, profile.plain_filters, [EndpointLoad(e, now) for e in endpoints])
        return bool(loads), bool(loads) and bool(_filtered(ctx, profile.saturation_filters, loads))

    def _choose(
        self,
        ctx: RequestContext,
        exclude: Collection[Endpoint],
        profile: RoutingProfile,
        rule: str,
        pools: Collection[str],
        may_fall_back: bool,
        taken: str = "",
    ) -> Endpoint:
        """`taken`: why the decision is not the policy's first choice (explained)."""
        if ctx.route == "responses":  # only pools whose engines serve the Responses API
            pools = [name for name in pools if self.fleet.serves_responses(name)]
        endpoints = routable_candidates(self.fleet, ctx.model, exclude, pools)
        if profile.uses_prefix and ctx.prefix is None:
            ctx.prefix = self.services.prefix_match(ctx)
        endpoints = self.services.shortlist(ctx, endpoints)
        now = time.monotonic()
        candidates = _filtered(
            ctx, profile.plain_filters, [EndpointLoad(e, now) for e in endpoints]
        )  # one load snapshot per candidate
        if not candidates:
            raise Overloaded(
                f"No endpoint for '{ctx.model}' passes the routing policy's filters",
                code="no_eligible_endpoint",
                retry_after=1,
            )
        available = _filtered(ctx, profile.saturation_filters, candidates)
        if not available:
            if may_fall_back and profile.fallback_pool is not None:
                try:
                    return self._choose(
                        ctx,
                        exclude,
                        profile,
                        rule,
                        (profile.fallback_pool,),
                        False,
                        f"fallback_pool={profile.fallback_pool} (every endpoint of "
                        f"{','.join(sorted(pools))} saturated)",
                    )
                except (NotFound, Overloaded):
                    pass
            if profile.when_saturated == "reject":
                raise Overloaded(
                    f"Every endpoint serving '{ctx.model}' is saturated",
                    code="all_endpoints_saturated",
                    retry_after=1,
                )
            available = candidates
            taken = taken or "saturated (every candidate; when_saturated=queue)"
        scores, columns = (
            weighted_scores(ctx, available, profile.scorers) if profile.scorers else (None, [])
        )
        chosen = available[profile.picker(ctx, available, scores)].endpoint
        if self.services.explain_allowed(ctx):  # before the decision changes the index
            ctx.response_headers.append(
                (
                    ROUTE_EXPLAIN,
                    _explain(
                        ctx, self.policy.name, rule, profile, available, scores, columns, taken
                    ),
                )
            )
        self._record(ctx, chosen)
        decisions, key = self.services.decisions, (chosen.name, self.policy.name)
        decisions[key] = decisions.get(key, 0) + 1
        return chosen

    def _record(self, ctx: RequestContext, chosen: Endpoint) -> None:
        prefix = ctx.prefix
        if prefix is None:
            return
        index = self.services.index
        now = prefix.decided_at = time.monotonic()
        if prefix.matched.get(chosen.name):
            touched = index.deepest_touch(chosen.name, prefix.hashes, now)
            if touched is not None:
                prefix.touched[chosen.name] = touched
        index.record(chosen.name, prefix.hashes, now)
        self.services.record_precise(prefix, chosen.name)
        if prefix.session is not None:
            self.services.affinity.set(prefix.session, chosen.name)


def _explain(
    ctx: RequestContext,
    policy: str,
    rule: str,
    profile: RoutingProfile,
    candidates: Sequence[EndpointLoad],
    scores: Sequence[float] | None,
    columns: Sequence[Sequence[float]],
    taken: str,
) -> bytes:
    """Every term of the decision, per candidate: its score and each scorer's value, and the
    inputs of the predicted time to first token (in precise mode which index prices it, and
    the tokens the engine's events say it holds; held prompt blocks in the approximate index,
    uncached tokens, prefill
    tokens queued there, decoding sequences, the engine's waiting requests), how long ago the
    blocks the placement would evict were last used (`room`: none would be), the blocks it
    would leave free there, and the load the picker's imbalance gate compares."""
    names = [s.NAME for s, _ in profile.scorers]
    prefix = ctx.prefix
    now = time.monotonic()
    parts = [f"policy={policy}; rule={rule}; objective={profile.objective}"]
    if ctx.fallback_from is not None:
        parts[0] += (
            f"; fallback_model={ctx.model} (every endpoint of {ctx.fallback_from} saturated)"
        )
    if taken:
        parts[0] += f"; {taken}"
    exact = prefix.exact if prefix is not None else None
    if prefix is not None:
        parts[0] += f"; prompt_tokens={prefix.prompt_tokens}; blocks={prefix.blocks}"
        if exact is not None:  # the tokenizer's count, which precise candidates are priced on
            parts[0] += f"; exact_prompt_tokens={exact.prompt_tokens}"
    for i, candidate in enumerate(candidates):
        fields = [candidate.name]
        if scores is not None:
            fields.append(f"score={scores[i]:.3f}")
            fields += [
                f"{name}={column[i]:.3f}" for name, column in zip(names, columns, strict=True)
            ]
        if prefix is not None:
            if exact is not None and candidate.name in exact.held:
                fields.append(f"index=precise held_tokens={exact.held[candidate.name]}")
            elif exact is not None:
                fields.append("index=approximate")
            fields.append(f"held_blocks={prefix.matched.get(candidate.name, 0)}")
            fields.append(f"uncached={prefix.uncached_tokens(candidate.name)}")
            touched = prefix.eviction_touch(candidate.name)
            age = f"{now - touched:.1f}s" if touched > -math.inf else "room"
            fields.append(f"evicts_age={age}")
            fields.append(f"free_blocks={prefix.room(candidate.name)}")
        fields.append(f"queued_tokens={candidate.queued_tokens:.0f}")
        fields.append(f"decoding={candidate.active_sequences:.0f}")
        fields.append(f"waiting={candidate.waiting:.0f}")
        fields.append(f"inflight={candidate.inflight}")
        fields.append(f"load={candidate.requests:.0f}")
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

    def refused(self, ctx: RequestContext, endpoint: Endpoint) -> None:
        picker = self.pickers.get(endpoint.pool)
        if picker is not None:
            picker.refused(ctx, endpoint)

    def fallback_model(self, ctx: RequestContext) -> str | None:
        """The model `ctx` falls back to, or None. A fallback model is taken only when its
        own pool (the first serving it, whose policy routes it) has an endpoint that passes
        that policy's filters and is not saturated: one nobody serves, or whose endpoints
        are all down, drained, kept out or saturated too, would turn a request the requested
        model could still queue for into a refusal or a wait for a model it did not ask
        for."""
        pool = self.fleet.home_pool(ctx.model)
        model = self.pickers[pool].fallback_model(ctx) if pool is not None else None
        if model is None:
            return None
        home = self.fleet.home_pool(model)
        if home is None or not self.pickers[home].has_unsaturated(ctx, model):
            return None
        return model

    def uncached_tokens(self, ctx: RequestContext) -> int:
        pool = self.fleet.home_pool(ctx.model)
        if pool is None:
            return ctx.view.prompt_tokens
        return self.pickers[pool].uncached_tokens(ctx)

    def has_capacity(
        self, model: str, jurisdictions: frozenset[str] | None, pinned: str | None
    ) -> bool:
        """Admission's view of the fleet (`kvgate.chain.admission_ports.Capacity`)."""
        return self.fleet.has_capacity(model, jurisdictions, pinned)

    def rejects_when_saturated(self, ctx: RequestContext) -> bool:
        pool = self.fleet.home_pool(ctx.model)
        if pool is None:
            return False
        profile, _ = self.pickers[pool].policy.profile_for(ctx)
        return profile.when_saturated == "reject"


def build_router(
    fleet: Fleet, policies: dict[str, RoutingPolicy], services: RoutingServices
) -> PoolRouter:
    """One PolicyPicker per pool, with the pool's policy (`policies`, by pool name)."""
    return PoolRouter(
        fleet,
        {
            pool.name: PolicyPicker(fleet, pool.name, policies[pool.name], services)
            for pool in fleet.pools
        },
    )


class ModelFallbackStage:
    """Before admission: when every endpoint for the requested model is saturated and the
    policy names a smaller model this tenant may use, switch to it — the one place the body is
    re-serialised for routing — so that quota, intent and routing all see the model served."""

    def __init__(self, router: PoolRouter) -> None:
        self.router = router

    async def __call__(self, ctx: RequestContext) -> None:
        if ctx.pinned is not None:  # a stored conversation continues on its model, there
            return
        model = self.router.fallback_model(ctx)
        if model is None or model == ctx.model:
            return
        if ctx.tenant is not None and not ctx.tenant.may_use(model):
            return
        ctx.fallback_from, ctx.model = ctx.model, model
        ctx.payload["model"] = model
        ctx.body = orjson.dumps(ctx.payload)
        if ctx.intent is not None:
            ctx.intent = dataclasses.replace(ctx.intent, model=model)


class PickStage:
    """Assigns `ctx.endpoint`. The in-flight count is the forwarder's: it is taken per attempt,
    at dispatch, so that a request that is refused later never counts against an engine.

    A request pinned to the endpoint storing the conversation it continues (`ctx.pinned`) goes
    there and nowhere else, without routing by prefix (the engine prepends the stored
    conversation, which the gateway never saw): if that endpoint left rotation while the
    request waited, 503; if the request may not be served in its jurisdiction, 403."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def __call__(self, ctx: RequestContext) -> None:
        pinned = ctx.pinned
        if pinned is None:
            ctx.endpoint = self.picker.choose(ctx)
            return
        check_available(pinned, generates=True)
        check_residency(pinned, ctx.allowed_jurisdictions)
        ctx.endpoint = pinned
