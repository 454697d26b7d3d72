"""The `stored_response` stage of the `/v1/responses/{response_id}` routes (retrieve, cancel and
whatever else the engines serve under an id): the endpoint that stores the response.

The id names it (kvgate/routing/response_ids.py): 404 for an id the gateway did not issue or
that no endpoint of the fleet stores for this tenant, 503 when that endpoint is not taking
requests (a drained one still is: reading or cancelling what it holds is part of letting its
work finish), 503 `draining` once this process drains, as admission answers. The request then
goes to that endpoint and nowhere else, with the engine's own id in its path; the answer's
ids are relayed in the client's form.

These routes pass auth (the tenant is part of the id) and skip the rest of the inference
chain: they name no model to classify, fall back from or allow, run no generation to admit,
queue or charge (the engine reads or cancels what it stores; the create that made the
response was admitted and charged, and its usage is not counted again), and the id leaves one
endpoint to pick. Metrics, the access log and traces see them under their own route names
(kvgate/response_routes.py).
"""

from __future__ import annotations

from kvgate.chain.admission import AdmissionController
from kvgate.response_routes import with_response_id
from kvgate.routing.endpoints import Fleet
from kvgate.routing.response_ids import ResponseIds, check_available, stored_at
from kvgate.types import RequestContext


class StoredResponseStage:
    def __init__(self, fleet: Fleet, admission: AdmissionController, key: bytes = b"") -> None:
        self.fleet = fleet
        self.admission = admission
        self.key = key  # the response ids' signing key

    async def __call__(self, ctx: RequestContext) -> None:
        tenant, named = ctx.tenant, ctx.response_id
        assert tenant is not None and named is not None, "auth runs first, on an id's route"
        self.admission.check_open()
        endpoint, engine_id = stored_at(self.fleet, tenant.name, named, "response_id", self.key)
        check_available(endpoint, generates=False)
        ctx.pinned = ctx.endpoint = endpoint
        ctx.tier = tenant.tier  # the tier's timeouts apply
        ctx.upstream_path = with_response_id(ctx.upstream_path, named, engine_id)
        ctx.response_ids = ResponseIds(tenant.name, {engine_id: named}, self.key)
