"""Filters: which candidate endpoints may take a request at all.

A filter is a plugin: a `NAME`, a `Params` model with defaults, a plain
constructor, and registration in `kvgate/routing/plugins.py`. Calling it is pure over the
candidates' load snapshots (`EndpointLoad`, taken once per decision by the picker): it returns
the candidates that pass, in their order, and changes nothing. Which endpoints serve the model,
are healthy and are admitted by their breaker is decided before any filter runs
(`Fleet.serving`); policies choose the filters below.
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


class Filter(Protocol):
    NAME: ClassVar[str]

    def __call__(
        self, ctx: RequestContext, candidates: Sequence[EndpointLoad]
    ) -> list[EndpointLoad]:
        """The candidates that pass, in order. Pure."""
        ...


class FreshTelemetry:
    """Only endpoints whose telemetry is fresh (or that expose none, kind `openai`)."""

    NAME = "fresh_telemetry"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(
        self, ctx: RequestContext, candidates: Sequence[EndpointLoad]
    ) -> list[EndpointLoad]:
        return [c for c in candidates if not c.stale]


class NotSaturatedParams(NoParams):
    """Thresholds; unset means the endpoint's own limits (`routing.saturation`, where KV use
    saturates nothing by default: see `SaturationConfig`)."""

    max_waiting: float | None = Field(None, ge=0)
    max_kv_usage: float | None = Field(None, gt=0, le=1)


class NotSaturated:
    """Drops endpoints whose queue or KV use is above the thresholds or whose in-flight cap is
    reached. The picker applies it last, so that when it would drop every candidate the policy's
    `when_saturated` / `fallback` decide instead."""

    NAME = "not_saturated"
    Params = NotSaturatedParams

    def __init__(self, params: NotSaturatedParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(
        self, ctx: RequestContext, candidates: Sequence[EndpointLoad]
    ) -> list[EndpointLoad]:
        p = self.params
        return [
            c
            for c in candidates
            if not c.saturated_by(
                c.endpoint.limits.max_waiting if p.max_waiting is None else p.max_waiting,
                c.endpoint.limits.max_kv_usage if p.max_kv_usage is None else p.max_kv_usage,
            )
        ]


class JurisdictionParams(NoParams):
    label: str = "jurisdiction"


class Jurisdiction:
    """When the request carries allowed jurisdictions (tenant data residency), only endpoints
    whose `jurisdiction` label is one of them."""

    NAME = "jurisdiction"
    Params = JurisdictionParams

    def __init__(self, params: JurisdictionParams | None = None) -> None:
        self.params = params or self.Params()

    def __call__(
        self, ctx: RequestContext, candidates: Sequence[EndpointLoad]
    ) -> list[EndpointLoad]:
        allowed = ctx.allowed_jurisdictions
        if allowed is None:
            return list(candidates)
        label = self.params.label
        return [c for c in candidates if c.endpoint.labels.get(label) in allowed]


class LabelsParams(NoParams):
    # Required and non-empty: a labels filter that names no label would keep every endpoint.
    match: dict[str, str] = Field(min_length=1)


class Labels:
    """Only endpoints whose labels include every `match` pair (e.g. `{region: eu-west}`)."""

    NAME = "labels"
    Params = LabelsParams

    def __init__(self, params: LabelsParams) -> None:
        self.params = params

    def __call__(
        self, ctx: RequestContext, candidates: Sequence[EndpointLoad]
    ) -> list[EndpointLoad]:
        match = self.params.match.items()
        return [c for c in candidates if all(c.endpoint.labels.get(k) == v for k, v in match)]
