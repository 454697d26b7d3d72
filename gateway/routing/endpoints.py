"""Pools and endpoints: which engine serves which model, and which of them are usable now."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from gateway.config import EngineKind, PoolConfig

if TYPE_CHECKING:
    from gateway.types import RequestContext


class BreakerView(Protocol):
    """What routing may ask an endpoint's circuit breaker (owned by the resilience layer)."""

    def admits(self) -> bool:
        """True when a new request may be sent now (closed, or half-open with a free probe).
        Pure: asking has no side effect."""
        ...


class _NoBreaker:
    def admits(self) -> bool:
        return True


NO_BREAKER: BreakerView = _NoBreaker()


@dataclass(slots=True, eq=False)
class Endpoint:
    """One engine's HTTP address and the gateway's live view of it.

    `inflight` is owned by the gateway: it goes up at dispatch and down exactly once when the
    request ends. Health checks change `healthy` and never touch `inflight`.
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
    healthy: bool = True
    inflight: int = 0
    breaker: BreakerView = NO_BREAKER

    @property
    def models(self) -> frozenset[str]:
        return self.configured_models | self.discovered_models

    def begin_attempt(self, ctx: RequestContext) -> None:
        """Called by the forwarder when an attempt is dispatched here."""
        self.inflight += 1

    def end_attempt(self, ctx: RequestContext) -> None:
        """Called exactly once per `begin_attempt`, on every terminal path of the attempt."""
        self.inflight -= 1

    @property
    def saturated(self) -> bool:
        """True when sending more work here would only queue it on the engine."""
        return self.max_inflight is not None and self.inflight >= self.max_inflight

    @property
    def routable(self) -> bool:
        return self.healthy and self.breaker.admits()

    @property
    def health_path(self) -> str:
        return "/v1/models" if self.engine == "openai" else "/health"


@dataclass(slots=True, eq=False)
class Pool:
    name: str
    engine: EngineKind
    policy: str
    endpoints: list[Endpoint]

    @property
    def ready(self) -> bool:
        return any(e.healthy for e in self.endpoints)


def build_pool(config: PoolConfig) -> Pool:
    endpoints = [
        Endpoint(
            name=f"{config.name}-{i}",
            url=ep.url,
            pool=config.name,
            engine=config.engine,
            configured_models=frozenset(config.models),
            auth_header=f"Bearer {ep.api_key}".encode() if ep.api_key else None,
            labels=dict(ep.labels),
            max_inflight=ep.max_inflight,
        )
        for i, ep in enumerate(config.endpoints)
    ]
    return Pool(config.name, config.engine, config.policy, endpoints)


class Fleet:
    """Every pool and endpoint, with a model → candidates map rebuilt when health or the
    discovered model lists change (never per request)."""

    def __init__(self, pools: Iterable[Pool]) -> None:
        self.pools = list(pools)
        self.endpoints = [e for p in self.pools for e in p.endpoints]
        self._by_model: dict[str, list[Endpoint]] = {}
        self._healthy_by_model: dict[str, list[Endpoint]] = {}
        self.refresh()

    def refresh(self) -> None:
        by_model: dict[str, list[Endpoint]] = {}
        for endpoint in self.endpoints:
            for model in endpoint.models:
                by_model.setdefault(model, []).append(endpoint)
        self._by_model = by_model
        self._healthy_by_model = {
            m: [e for e in eps if e.healthy] for m, eps in by_model.items()
        }

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def candidates(self, model: str) -> list[Endpoint]:
        """Healthy endpoints serving `model` (possibly empty)."""
        return self._healthy_by_model.get(model, [])

    def served_models(self) -> list[str]:
        """Models with at least one healthy endpoint."""
        return sorted(m for m, eps in self._healthy_by_model.items() if eps)

    def unready_pools(self) -> list[str]:
        return [p.name for p in self.pools if not p.ready]
