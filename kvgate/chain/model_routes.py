"""`GET /v1/models` and `GET /v1/models/{id}`, answered as OpenAI answers them.

A model object is `{"id", "object": "model", "created", "owned_by"}`; `created` is 0 (kvgate
does not know when an engine's model was made), and with what the engines serving it said of
it in their own lists (`Fleet.model_card`: vLLM's `max_model_len`, `root`, `parent`). An
unknown id is 404 `model_not_found`, as OpenAI answers it. With `server.models_require_key:
true` both routes need a valid key (401 without, as inference does), and a tenant sees only
the models its key may use (others are 404, as OpenAI answers a model a key has no access to).
"""

from __future__ import annotations

import orjson

from kvgate.asgi import JSON, Scope, Send, send_bytes, send_error
from kvgate.chain.auth import Authenticator
from kvgate.chain.tenants import TenantDirectory
from kvgate.errors import KvgateError, MethodNotAllowed, NotFound
from kvgate.routing.endpoints import Fleet

MODELS_PATH = "/v1/models"
_MODEL_PREFIX = MODELS_PATH + "/"


def is_model_route(path: str) -> bool:
    return path == MODELS_PATH or (
        path.startswith(_MODEL_PREFIX) and len(path) > len(_MODEL_PREFIX)
    )


def _model(model_id: str, fleet: Fleet) -> dict[str, object]:
    card = {"id": model_id, "object": "model", "created": 0, "owned_by": "kvgate"}
    return card | fleet.model_card(model_id)


class ModelRoutes:
    """Lists the models an endpoint in rotation serves (`Fleet.served_models`)."""

    def __init__(self, fleet: Fleet, directory: TenantDirectory, require_key: bool) -> None:
        self.fleet = fleet
        self.directory = directory
        self.authenticator = Authenticator(directory)
        self.require_key = require_key and not directory.open

    async def __call__(self, scope: Scope, send: Send) -> None:
        try:
            await self._answer(scope, send)
        except KvgateError as error:
            extra = [(b"allow", b"GET")] if isinstance(error, MethodNotAllowed) else []
            await send_error(send, error, extra)

    async def _answer(self, scope: Scope, send: Send) -> None:
        path = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{scope['method']} is not allowed on {path}; use GET")
        models = self.fleet.served_models()
        if self.require_key:
            tenant = self.authenticator.verify(scope["headers"]).tenant
            if tenant is not None:  # admin keys see every model
                models = [m for m in models if tenant.may_use(m)]
        if path == MODELS_PATH:
            body = {"object": "list", "data": [_model(m, self.fleet) for m in models]}
            await send_bytes(send, 200, orjson.dumps(body), JSON)
            return
        model_id = path[len(_MODEL_PREFIX) :]
        if model_id not in models:
            raise NotFound(
                f"The model '{model_id}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        await send_bytes(send, 200, orjson.dumps(_model(model_id, self.fleet)), JSON)
