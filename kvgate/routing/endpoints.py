"""Pools and endpoints: which engine serves which model, and which of them are usable now."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvgate.config import EngineKind, PoolConfig
from kvgate.routing.endpoint_load import EndpointLoad
from kvgate.routing.settings import RoutingConfig, StalePolicy

if TYPE_CHECKING:
    from kvgate.routing.telemetry import EngineTelemetry
    from kvgate.types import RequestContext

log = logging.getLogger("kvgate.health")


class BreakerView(Protocol):
    """What routing may ask an endpoint's circuit breaker (owned by the resilience layer)."""

    def admits(self) -> bool:
        """True when a new request may be sent now (closed, or half-open with a free probe).
        Pure: asking has no side effect."""
        ...

    def reopens_in(self) -> float:
        """Seconds until an ejection or an engine's pause (`Retry-After`) ends; 0 when
        neither keeps the endpoint out."""
        ...


class _NoBreaker:
    def admits(self) -> bool:
        return True

    def reopens_in(self) -> float:
        return 0.0


NO_BREAKER: BreakerView = _NoBreaker()

# Prompt tokens assumed for requests the engine reports but the gateway did not send.
_DEFAULT_PROMPT_TOKENS = 512.0
_PROMPT_EMA = 0.05


@dataclass(slots=True, frozen=True)
class SaturationLimits:
    """When an endpoint counts as saturated, and how old telemetry may be before it is stale
    (see kvgate/routing/telemetry.py for the stale policy)."""

    max_waiting: float = 5
    max_kv_usage: float = 1.0
    stale_after: float = 3.0
    stale_policy: StalePolicy = "local"

    @classmethod
    def from_config(cls, routing: RoutingConfig) -> SaturationLimits:
        return cls(
            routing.saturation.max_waiting,
            routing.saturation.max_kv_usage,
            routing.stale_after,
            routing.stale_policy,
        )


@dataclass(slots=True, eq=False)
class Endpoint:
    """One engine's HTTP address and the gateway's live view of it.

    Load accounting is owned by the gateway: `begin_attempt` at dispatch, `first_token` when
    the first event arrives, `end_attempt` exactly once when the attempt ends on any path.
    Per attempt it tracks requests in flight, prompt tokens still to prefill (requests waiting
    for their first token, counted with the prompt tokens not already cached there) and active
    decode sequences. Scraped telemetry (`telemetry`, when fresh) corrects the view upwards for
    work the gateway did not send. Health checks change `healthy` and never touch any of it;
    `last_success` (monotonic seconds) is when an attempt here last succeeded or streamed its
    first event, the passive evidence health checks weigh; `panic_routed` is set by
    `Fleet.refresh` while the pool is in panic (too few healthy endpoints), and then routes
    here even when unhealthy. `drained` is the operator's (`POST /admin/endpoints/{name}/drain`):
    a drained endpoint gets no new request, its requests in flight finish.
    """

    name: str
    url: str
    pool: str
    engine: EngineKind
    configured_models: frozenset[str]
    auth_header: bytes | None = None
    labels: dict[str, str] = field(default_factory=dict)
    max_inflight: int | None = None
    discovered_models: frozenset[str] = frozenset()
    # What the engine's `/v1/models` says of each model beyond its id that clients read
    # (`MODEL_CARD_FIELDS`), by model.
    model_cards: dict[str, dict[str, object]] = field(default_factory=dict)
    healthy: bool = True
    last_success: float = float("-inf")
    panic_routed: bool = False
    inflight: int = 0
    breaker: BreakerView = NO_BREAKER
    limits: SaturationLimits = SaturationLimits()
    telemetry: EngineTelemetry | None = None
    prefill_requests: int = 0
    prefill_tokens: int = 0
    decoding: int = 0
    # What the other gateway replicas have in flight here (shared state, docs/redis.md).
    peer_inflight: int = 0
    peer_queued_tokens: int = 0
    mean_prompt_tokens: float = _DEFAULT_PROMPT_TOKENS
    # Streamed attempts that joined the engine's queue and that left it (first token, or ended
    # before one), and both counts when the telemetry was taken: the engine's waiting count is
    # carried forward between scrapes by what the gateway itself saw since (`EndpointLoad`).
    streams_queued: int = 0
    streams_unqueued: int = 0
    queued_at_scrape: int = 0
    unqueued_at_scrape: int = 0
    drained: bool = False
    # id(ctx) → prompt tokens still to prefill, or -1 once the attempt decodes.
    _attempts: dict[int, int] = field(default_factory=dict)

    @property
    def models(self) -> frozenset[str]:
        return self.configured_models | self.discovered_models

    def begin_attempt(self, ctx: RequestContext) -> None:
        """Called by the forwarder when an attempt is dispatched here."""
        if id(ctx) in self._attempts:
            return
        prefix = ctx.prefix
        tokens = prefix.uncached_tokens(self.name) if prefix is not None else 0
        if prefix is not None:
            self.mean_prompt_tokens += _PROMPT_EMA * (
                prefix.prompt_tokens - self.mean_prompt_tokens
            )
        self._attempts[id(ctx)] = tokens
        self.inflight += 1
        self.prefill_requests += 1
        self.prefill_tokens += tokens
        if ctx.stream:
            self.streams_queued += 1

    def first_token(self, ctx: RequestContext) -> None:
        """The attempt's first event arrived: its prefill is done, it now decodes (and the
        engine is evidently serving: passive health evidence, as a whole answer is)."""
        tokens = self._attempts.get(id(ctx))
        if tokens is None or tokens < 0:
            return
        self.last_success = time.monotonic()
        self._attempts[id(ctx)] = -1
        self.prefill_requests -= 1
        self.prefill_tokens -= tokens
        self.decoding += 1
        if ctx.stream:
            self.streams_unqueued += 1

    def end_attempt(self, ctx: RequestContext) -> None:
        """Called exactly once per `begin_attempt`, on every terminal path of the attempt."""
        tokens = self._attempts.pop(id(ctx), None)
        if tokens is None:
            return
        self.inflight -= 1
        if tokens < 0:
            self.decoding -= 1
        else:
            self.prefill_requests -= 1
            self.prefill_tokens -= tokens
            if ctx.stream:
                self.streams_unqueued += 1

    def record_success(self) -> None:
        """Called by the forwarder when an attempt here succeeded."""
        self.last_success = time.monotonic()

    @property
    def in_rotation(self) -> bool:
        """Healthy, or routed to anyway because its pool is in panic."""
        return self.healthy or self.panic_routed

    def observe_telemetry(self, telemetry: EngineTelemetry) -> None:
        """A scrape succeeded: route on it, and count queue changes from now on."""
        self.telemetry = telemetry
        self.queued_at_scrape = self.streams_queued
        self.unqueued_at_scrape = self.streams_unqueued

    @property
    def scraped(self) -> bool:
        """Whether this endpoint's engine kind exposes telemetry the gateway scrapes."""
        return self.engine != "openai"

    def fresh_telemetry_at(self, now: float) -> EngineTelemetry | None:
        """The last scrape if it is recent enough to route on at `now`, else None."""
        telemetry = self.telemetry
        if telemetry is None or now - telemetry.scraped_at > self.limits.stale_after:
            return None
        return telemetry

    @property
    def fresh_telemetry(self) -> EngineTelemetry | None:
        return self.fresh_telemetry_at(time.monotonic())

    @property
    def stale(self) -> bool:
        return self.scraped and self.fresh_telemetry is None

    @property
    def total_inflight(self) -> int:
        """Requests in flight here from this gateway process and its peer replicas."""
        return self.inflight + self.peer_inflight

    def load(self, now: float | None = None) -> EndpointLoad:
        """A snapshot of this endpoint's load at `now` (routing takes one per endpoint per
        decision and hands it to every filter, scorer and picker)."""
        return EndpointLoad(self, time.monotonic() if now is None else now)

    @property
    def saturated(self) -> bool:
        """True when sending more work here would only queue it on the engine: the in-flight
        cap is reached, or fresh telemetry shows a queue or KV use above the limits."""
        return self.load().saturated_by(self.limits.max_waiting, self.limits.max_kv_usage)

    @property
    def routable(self) -> bool:
        if self.limits.stale_policy == "exclude" and self.stale:
            return False
        return (self.healthy or self.panic_routed) and not self.drained and self.breaker.admits()

    @property
    def health_path(self) -> str:
        return "/v1/models" if self.engine == "openai" else "/health"


@dataclass(slots=True, eq=False)
class Pool:
    name: str
    engine: EngineKind
    policy: str
    endpoints: list[Endpoint]
    # Whether the engines serve /v1/responses (`pools[].responses`).
    serves_responses: bool = False
    # True while fewer than the panic threshold of its endpoints are healthy (Fleet.refresh).
    panic: bool = False

    @property
    def ready(self) -> bool:
        """Some endpoint can take new requests: healthy and not drained by an operator."""
        return any(e.healthy and not e.drained for e in self.endpoints)


def build_pool(config: PoolConfig, routing: RoutingConfig | None = None) -> Pool:
    limits = SaturationLimits.from_config(routing or RoutingConfig())
    endpoints = [
        Endpoint(
            name=config.endpoint_name(i),
            url=ep.url,
            pool=config.name,
            engine=config.engine,
            configured_models=frozenset(config.models),
            auth_header=f"Bearer {ep.api_key}".encode() if ep.api_key else None,
            labels=dict(ep.labels),
            max_inflight=ep.max_inflight,
            limits=limits,
        )
        for i, ep in enumerate(config.endpoints)
    ]
    responses = config.engine == "vllm" if config.responses is None else config.responses
    return Pool(config.name, config.engine, config.policy, endpoints, responses)


def _serves(endpoint: Endpoint, model: str) -> bool:
    """Whether `endpoint` (serving `model` by its config or its list) really serves it."""
    if endpoint.engine != "vllm" or not endpoint.discovered_models:
        return True
    return model in endpoint.discovered_models


class Fleet:
    """Every pool and endpoint, with a model → candidates map rebuilt when health or the
    discovered model lists change (never per request).

    Panic (as Envoy's): when fewer than `panic_threshold` of a pool's endpoints are healthy,
    health is ignored in that pool and all of its endpoints are candidates, so a probing
    failure can never empty a pool that works (breakers still eject endpoints that fail
    requests). 0 turns panic off."""

    def __init__(self, pools: Iterable[Pool], panic_threshold: float = 0.5) -> None:
        self.pools = list(pools)
        self._pools_by_name = {pool.name: pool for pool in self.pools}
        self.panic_threshold = panic_threshold
        self.endpoints = [e for p in self.pools for e in p.endpoints]
        # Requests still running on an endpoint (the same pool and URL) in the fleets of apps
        # a reload replaced: they count in its in-flight figures until they finish
        # (`ReloadableGateway` sets this).
        self.earlier_inflight: Callable[[Endpoint], int] = _none_earlier
        self._by_model: dict[str, list[Endpoint]] = {}
        self._healthy_by_model: dict[str, list[Endpoint]] = {}
        self._home_pool: dict[str, str] = {}
        self.refresh()

    def refresh(self) -> None:
        for pool in self.pools:
            self._update_panic(pool)
        by_model: dict[str, list[Endpoint]] = {}
        home_pool: dict[str, str] = {}
        for endpoint in self.endpoints:
            for model in endpoint.models:
                by_model.setdefault(model, []).append(endpoint)
                home_pool.setdefault(model, endpoint.pool)  # endpoints are in pool order
        self._by_model = by_model
        self._home_pool = home_pool
        self._healthy_by_model = {
            m: [e for e in eps if e.in_rotation] for m, eps in by_model.items()
        }

    def _update_panic(self, pool: Pool) -> None:
        healthy, n = sum(e.healthy for e in pool.endpoints), len(pool.endpoints)
        panic = healthy < self.panic_threshold * n
        if panic != pool.panic:
            state = "entered panic, routing across all" if panic else "left panic"
            log.warning("pool %s %s: %d of %d endpoints healthy", pool.name, state, healthy, n)
            pool.panic = panic
        for endpoint in pool.endpoints:
            endpoint.panic_routed = panic

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def home_pool(self, model: str) -> str | None:
        """The first pool (in config order) with an endpoint serving `model`."""
        return self._home_pool.get(model)

    def pool(self, name: str | None) -> Pool | None:
        """The pool called `name`, if any."""
        return self._pools_by_name.get(name) if name is not None else None

    def serves_responses(self, pool: str) -> bool:
        """Whether pool `pool`'s engines serve `POST /v1/responses` (`pools[].responses`)."""
        found = self.pool(pool)
        return found is not None and found.serves_responses

    def home_engine(self, model: str) -> EngineKind | None:
        """The engine kind of `model`'s home pool (None: no pool serves it)."""
        found = self.pool(self._home_pool.get(model))
        return None if found is None else found.engine

    def candidates(self, model: str) -> list[Endpoint]:
        """Endpoints in rotation serving `model`: healthy ones, and every endpoint of a pool in
        panic (possibly empty)."""
        return self._healthy_by_model.get(model, [])

    def serving(
        self,
        model: str,
        *,
        exclude: Collection[Endpoint] = (),
        pools: Collection[str] | None = None,
        jurisdictions: frozenset[str] | None = None,
    ) -> list[Endpoint]:
        """The one answer to "which endpoints can take this now": endpoints in rotation
        (healthy, or in a pool in panic), not drained, serving `model` whose breaker admits
        traffic (and,
        with the `exclude` stale policy, whose telemetry is fresh), in `pools` and
        `jurisdictions` if given, minus `exclude`."""
        return [
            e
            for e in self._healthy_by_model.get(model, ())
            if e.routable
            and e not in exclude
            and (pools is None or e.pool in pools)
            and (jurisdictions is None or e.labels.get("jurisdiction") in jurisdictions)
        ]

    def back_in(
        self, model: str, exclude: Collection[Endpoint] = (), pools: Collection[str] | None = None
    ) -> float:
        """Seconds until an endpoint serving `model` (in `pools`, not in `exclude`) may take
        requests again, when only ejections and engines' pauses keep them all out (the
        soonest ends first); 1 when something else does (health checks, telemetry, half-open
        probes), which may change at any moment."""
        waits = [
            e.breaker.reopens_in()
            for e in self._healthy_by_model.get(model, ())
            if e not in exclude and (pools is None or e.pool in pools) and not e.drained
        ]
        return 1.0 if not waits or min(waits) <= 0 else max(1.0, min(waits))

    def has_capacity(
        self, model: str, jurisdictions: frozenset[str] | None, pinned: str | None = None
    ) -> bool:
        """False only when every endpoint that could serve `model` is saturated; for a
        request `pinned` to one endpoint (a Responses continuation), when that endpoint is.
        With no candidate at all the request goes on, and picking answers 404 or 503."""
        if pinned is not None:
            endpoint = self.endpoint(pinned)
            return endpoint is None or not endpoint.saturated
        candidates = self.serving(model, jurisdictions=jurisdictions)
        return not candidates or any(not e.saturated for e in candidates)

    def endpoint(self, name: str) -> Endpoint | None:
        """The endpoint called `name` (its configured name or `{pool}-{index}`), if any."""
        return next((e for e in self.endpoints if e.name == name), None)

    def served_models(self) -> list[str]:
        """Models with at least one endpoint in rotation that serves them. A vLLM engine
        answers 404 for a model it does not serve, so there a configured model counts only
        while the engine lists it too, or has listed nothing yet; other engines (SGLang,
        most OpenAI-compatible servers) serve whatever name they are sent, so a configured
        name is theirs as well."""
        return sorted(
            model
            for model, endpoints in self._healthy_by_model.items()
            if any(_serves(endpoint, model) for endpoint in endpoints)
        )

    def model_card(self, model: str) -> dict[str, object]:
        """What the endpoints in rotation serving `model` say of it (`MODEL_CARD_FIELDS`):
        the smallest `max_model_len` (a request must fit wherever it is sent), and `root`
        and `parent` (the base of a LoRA adapter) as the first of them says."""
        card: dict[str, object] = {}
        for endpoint in self._healthy_by_model.get(model, ()):
            said = endpoint.model_cards.get(model, {})
            for key, value in said.items():
                if key == "max_model_len" and isinstance(value, int):
                    known = card.get(key)
                    card[key] = value if not isinstance(known, int) else min(known, value)
                else:
                    card.setdefault(key, value)
        return card

    def unready_pools(self) -> list[str]:
        return [p.name for p in self.pools if not p.ready]


def _none_earlier(endpoint: Endpoint) -> int:
    return 0


# The fields of an engine's model object that `GET /v1/models` passes on: vLLM's and SGLang's
# context length, and the model a LoRA adapter (`parent`) or a served name (`root`) stands for.
MODEL_CARD_FIELDS = ("max_model_len", "root", "parent")
