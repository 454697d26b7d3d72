"""Choosing the endpoint for a request: the `pick` stage of the chain."""

from __future__ import annotations

from gateway.errors import NotFound, Overloaded
from gateway.routing.endpoints import Endpoint, Fleet
from gateway.types import RequestContext


class RoundRobinPicker:
    """Cycles through the healthy endpoints that serve the requested model."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._turn: dict[str, int] = {}

    def choose(self, model: str) -> Endpoint:
        candidates = self.fleet.candidates(model)
        if not candidates:
            if not self.fleet.serves(model):
                raise NotFound(f"The model '{model}' does not exist or is not served here",
                               param="model", code="model_not_found")
            raise Overloaded(f"No healthy endpoint serves the model '{model}' right now",
                             code="no_healthy_endpoint", retry_after=1)
        turn = self._turn.get(model, 0)
        self._turn[model] = turn + 1
        return candidates[turn % len(candidates)]


class PickStage:
    """Assigns `ctx.endpoint`. The in-flight count is the forwarder's: it is taken per attempt,
    at dispatch, so that a request that is refused later never counts against an engine."""

    def __init__(self, picker: RoundRobinPicker) -> None:
        self.picker = picker

    async def __call__(self, ctx: RequestContext) -> None:
        ctx.endpoint = self.picker.choose(ctx.model)
