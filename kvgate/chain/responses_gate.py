"""The `responses` stage: `/v1/responses` only where the engines serve it.

vLLM serves OpenAI's Responses API; other engines may not (`pools[].responses`, by default
true for vLLM pools only). A request for a model whose pool (the first in config order that
serves it, where the picker routes it) does not serve the route is answered 404 naming the
reason, before admission and without reaching an engine.
"""

from __future__ import annotations

from kvgate.errors import NotFound
from kvgate.routing.endpoints import Fleet
from kvgate.types import RequestContext


class ResponsesStage:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def __call__(self, ctx: RequestContext) -> None:
        if ctx.route != "responses":
            return
        home = self.fleet.home_pool(ctx.model)
        pool = next((p for p in self.fleet.pools if p.name == home), None)
        if pool is not None and not pool.serves_responses:
            raise NotFound(
                f"/v1/responses is not served for the model '{ctx.model}': its pool "
                f"'{pool.name}' ({pool.engine} engines) does not serve the Responses API; "
                "use /v1/chat/completions, or set responses: true on the pool if its "
                "engines serve it",
                code="unsupported_route",
            )
