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
    """Assigns `ctx.endpoint` and owns its in-flight count from dispatch to the end."""

    def __init__(self, picker: RoundRobinPicker) -> None:
        self.picker = picker

    async def __call__(self, ctx: RequestContext) -> None:
        endpoint = self.picker.choose(ctx.model)
        endpoint.inflight += 1
        ctx.endpoint = endpoint
        ctx.on_finish(_release_inflight)


def _release_inflight(ctx: RequestContext) -> None:
    assert ctx.endpoint is not None
    ctx.endpoint.inflight -= 1
