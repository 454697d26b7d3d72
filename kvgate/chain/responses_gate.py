"""The `responses` stage: `/v1/responses` only where the engines serve it, and a continued
conversation pinned to the engine that stores it.

vLLM serves OpenAI's Responses API; other engines may not (`pools[].responses`, by default
true for vLLM pools only). A request for a model whose pool (the first in config order that
serves it, where the picker routes it) does not serve the route is answered 404 naming the
reason, before admission and without reaching an engine.

Every create call gets its response-id rewriting (kvgate/routing/response_ids.py): the ids
of its answer reach the client naming the endpoint that stores the response. A create with
`previous_response_id` continues a conversation that only that endpoint holds: the id is
decoded here (404 for an id the gateway did not issue or no endpoint of the fleet stores for
this tenant, 400 for a model that endpoint does not serve, 503 when that endpoint is not
taking requests), the request is pinned there (no model fallback, no routing by prefix, no
retry elsewhere: `ctx.pinned`) and sent with the engine's own id in that field, the only
change to its body. All of this before admission, so
a refused request takes nothing.

A background create (`background: true`) is answered at once, and the engine generates after;
its usage is never seen, so it is charged its reservation. Under a token quota it must set
`max_output_tokens` (400 otherwise): the engine's own default is the rest of the context,
tens of thousands of tokens the reservation would not count.
"""

from __future__ import annotations

import orjson

from kvgate.errors import InvalidRequest, NotFound
from kvgate.routing.endpoints import Fleet
from kvgate.routing.response_ids import ResponseIds, check_available, stored_at
from kvgate.types import RequestContext


class ResponsesStage:
    def __init__(self, fleet: Fleet, key: bytes = b"") -> None:
        self.fleet = fleet
        self.key = key  # the response ids' signing key

    async def __call__(self, ctx: RequestContext) -> None:
        if ctx.route != "responses":
            return
        tenant = ctx.tenant
        assert tenant is not None, "the auth stage runs first"
        ids = ctx.response_ids = ResponseIds(tenant.name, key=self.key)
        if (
            ctx.payload.get("background") is True
            and tenant.quota.tokens_per_minute is not None
            and ctx.payload.get("max_output_tokens") is None
        ):
            raise InvalidRequest(
                "A background response must set max_output_tokens under a token quota: it is "
                "charged its reservation, as the gateway never sees what the engine generates "
                "after answering",
                param="max_output_tokens",
                code="missing_required_parameter",
            )
        previous = ctx.payload.get("previous_response_id")
        if previous is None:
            self._check_served(ctx, self.fleet.home_pool(ctx.model))
            return
        endpoint, engine_id = stored_at(
            self.fleet, tenant.name, previous, "previous_response_id", self.key
        )
        self._check_served(ctx, endpoint.pool)
        if endpoint.models and ctx.model not in endpoint.models:
            raise InvalidRequest(
                f"previous_response_id names a conversation stored on an engine that does not "
                f"serve the model '{ctx.model}'; continue it with a model that engine serves: "
                + ", ".join(f"'{m}'" for m in sorted(endpoint.models)),
                param="model",
                code="invalid_value",
            )
        check_available(endpoint, generates=True)
        ctx.pinned = endpoint
        ids.named[engine_id] = previous
        ctx.payload["previous_response_id"] = engine_id
        ctx.body = orjson.dumps(ctx.payload)

    def _check_served(self, ctx: RequestContext, name: str | None) -> None:
        pool = self.fleet.pool(name)
        if pool is not None and not pool.serves_responses:
            raise NotFound(
                f"/v1/responses is not served for the model '{ctx.model}': its pool "
                f"'{pool.name}' ({pool.engine} engines) does not serve the Responses API; "
                "use /v1/chat/completions, or set responses: true on the pool if its "
                "engines serve it",
                code="unsupported_route",
            )
