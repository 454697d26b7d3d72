"""An engine's store of Responses API answers, as vLLM keeps one with
`VLLM_ENABLE_RESPONSES_API_STORE=1` (here `EngineOptions.responses_store`, `kvgate sim
--responses-store`): in this engine process's memory only, so a response can be retrieved
(`GET /v1/responses/{id}`), cancelled (`POST /v1/responses/{id}/cancel`) or continued
(`previous_response_id`) on the engine that made it and nowhere else. With the store off
nothing is kept and every id is unknown, as in vLLM.

vLLM's store grows without bound; this one keeps the newest `capacity` responses and forgets
the oldest, whose id then answers 404 like an unknown one. A stored response is read as it
stands: a background one `queued` while it generates and complete once done, `cancelled`
once cancelled. Errors have vLLM's words: 404 "Response with id '…' not found.", 400 "Cannot
cancel a synchronous response." for one that is not running in the background.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from .engine_core import EngineCore
from .openai_api import ApiError, output_text
from .responses_api import ResponseGeneration, response_object

STORE_CAPACITY = 10_000
PREFIX = "/v1/responses/"
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})  # FastAPI's true, as vLLM parses it


@dataclass
class StoredResponse:
    generation: ResponseGeneration
    created: int
    cancelled: bool = False

    @property
    def running(self) -> bool:
        """A background response still generating."""
        return self.generation.background and not self.generation.request.finished

    def current(self) -> dict[str, Any]:
        """The response object as it stands."""
        if self.cancelled:
            return response_object(self.generation, self.created, final=False, status="cancelled")
        if self.running:
            return response_object(self.generation, self.created, final=False, status="queued")
        return response_object(self.generation, self.created)

    def conversation(self) -> list[dict[str, str]]:
        """What a response continuing this one starts from: this one's messages, then its
        output as the assistant's (none while it runs, none once cancelled)."""
        text = "" if self.cancelled or self.running else output_text(self.generation.request)
        reply = [{"role": "assistant", "content": text}] if text else []
        return [*self.generation.messages, *reply]


class ResponseStore:
    """The responses an engine keeps, by id, the newest `capacity` of them."""

    def __init__(self, enabled: bool, capacity: int = STORE_CAPACITY) -> None:
        self.enabled = enabled
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._responses

    def keep(self, generation: ResponseGeneration, created: int) -> None:
        """Store `generation`'s response if it asked to be (and the store is on)."""
        if not generation.store:
            return
        self._responses[generation.request.request_id] = StoredResponse(generation, created)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._responses.get(response_id)
        if stored is None:
            raise ApiError(
                404,
                f"Response with id '{response_id}' not found.",
                "response_id",
                "invalid_request_error",
            )
        return stored

    def answer(self, core: EngineCore, method: str, path: str, query: bytes) -> dict[str, Any]:
        """Serve `method` on `path` under /v1/responses/: retrieve or cancel; ApiError
        otherwise."""
        response_id, _, action = path.removeprefix(PREFIX).partition("/")
        if method == "GET" and not action:
            stream = parse_qs(query.decode("latin-1")).get("stream", ["false"])[-1]
            if stream.lower() in _TRUE:
                raise ApiError(400, "the simulator does not replay response streams", "stream")
            return self.get(response_id).current()
        if method == "POST" and action == "cancel":
            return self._cancel(core, response_id)
        raise ApiError(404, f"{method} {path} not found")

    def _cancel(self, core: EngineCore, response_id: str) -> dict[str, Any]:
        stored = self.get(response_id)
        if stored.cancelled or not stored.running:
            raise ApiError(
                400, "Cannot cancel a synchronous response.", error_type="invalid_request_error"
            )
        stored.cancelled = True
        core.abort(stored.generation.request, by_client=False)
        return stored.current()
