"""Building blocks for routing unit tests: endpoints, contexts, telemetry, without network."""

from __future__ import annotations

import time
from typing import Any

from kvgate.ingress import request_context
from kvgate.routing.endpoints import Endpoint, Fleet, Pool, SaturationLimits
from kvgate.routing.telemetry import EngineTelemetry
from kvgate.types import RequestContext


def endpoint(
    name: str,
    *,
    model: str = "m",
    pool: str = "p",
    labels: dict[str, str] | None = None,
    limits: SaturationLimits | None = None,
    **state: Any,
) -> Endpoint:
    e = Endpoint(
        name=name,
        url=f"http://{name}",
        pool=pool,
        engine="vllm",
        configured_models=frozenset({model}),
        labels=labels or {},
        limits=limits or SaturationLimits(),
    )
    for key, value in state.items():
        setattr(e, key, value)
    return e


def telemetry(age: float = 0.0, **values: Any) -> EngineTelemetry:
    return EngineTelemetry(scraped_at=time.monotonic() - age, **values)


def fleet(*endpoints: Endpoint) -> Fleet:
    pools: dict[str, list[Endpoint]] = {}
    for e in endpoints:
        pools.setdefault(e.pool, []).append(e)
    return Fleet(Pool(name, "vllm", "kvgate", eps) for name, eps in pools.items())


def ctx(
    text: str = "hello",
    *,
    model: str = "m",
    headers: list[tuple[bytes, bytes]] | None = None,
    **payload: Any,
) -> RequestContext:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **payload}
    return request_context("chat", {**body, "stream": True}, headers=headers or [], body=b"{}")
