"""Choosing the endpoint for a request: the `pick` stage of the chain."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from gateway.errors import NotFound, Overloaded
from gateway.routing.endpoints import Endpoint, Fleet
from gateway.types import RequestContext


class EndpointPicker(Protocol):
    def choose(self, ctx: RequestContext, exclude: Collection[Endpoint] = ()) -> Endpoint:
        """The endpoint for `ctx` among routable ones serving `ctx.model`, never one in
        `exclude` (endpoints already tried for this request). Raises NotFound for a model
        nobody serves and Overloaded when no endpoint can take it now."""
        ...


def routable_candidates(fleet: Fleet, model: str,
                        exclude: Collection[Endpoint] = ()) -> list[Endpoint]:
    """Healthy endpoints serving `model` whose breaker admits traffic, minus `exclude`."""
    candidates = [e for e in fleet.candidates(model) if e.breaker.admits() and e not in exclude]
    if not candidates:
        if not fleet.serves(model):
            raise NotFound(f"The model '{model}' does not exist or is not served here",
                           param="model", code="model_not_found")
        raise Overloaded(f"No healthy endpoint serves the model '{model}' right now",
                         code="no_healthy_endpoint", retry_after=1)
    return candidates


class RoundRobinPicker:
    """Cycles through the routable endpoints that serve the requested model."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._turn: dict[str, int] = {}

    def choose(self, ctx: RequestContext, exclude: Collection[Endpoint] = ()) -> Endpoint:
        candidates = routable_candidates(self.fleet, ctx.model, exclude)
        turn = self._turn.get(ctx.model, 0)
        self._turn[ctx.model] = turn + 1
        return candidates[turn % len(candidates)]


class PickStage:
    """Assigns `ctx.endpoint`. The in-flight count is the forwarder's: it is taken per attempt,
    at dispatch, so that a request that is refused later never counts against an engine."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def __call__(self, ctx: RequestContext) -> None:
        ctx.endpoint = self.picker.choose(ctx)
