"""A minimal OpenAI Responses API (`POST /v1/responses`), as vLLM serves it, for text only.

Request: `input` (a string, or an array of message items `{"role", "content"}` whose content is
a string or `input_text` / `output_text` parts), optional `instructions` (a system message
first), `max_output_tokens`, `stream`, `cache_salt`, and, as vLLM serves them with its store
on (`EngineOptions.responses_store`, kvgate/sim/response_store.py), `store` (default true),
`background` (answer at once with a `queued` response, generate on) and
`previous_response_id`: the stored conversation it names (its messages, then its output as an
assistant message) comes before the new input, so the prompt grows turn by turn. It is
rendered like a chat request, so prefix caching and the context-length check behave as for
chat. No tools; a background response is not streamed.

Non-stream answer: a `response` object whose `output` is one assistant `message` holding one
`output_text` part, with `usage` (`input_tokens`, `output_tokens`, `total_tokens`, cached
tokens). `status` is `completed`, or `incomplete` with `incomplete_details.reason:
max_output_tokens` when the token limit cut it.

Stream: `event: <type>` + `data: <json>` events, each with its `sequence_number`:
`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, one `response.output_text.delta` per token,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`, and
`response.completed` (or `response.incomplete`) carrying the final response with its usage.
There is no `[DONE]`: the stream ends after that last event, as OpenAI's does.
"""

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from kvgate.sim_chat_template import TemplateError, message_text, responses_messages

from .asgi_types import Send
from .engine_core import ABORTED
from .openai_api import CHAT, ApiError, Generation, output_text, parse_generation, resolve_model
from .options import EngineOptions
from .sequence import GenerationRequest

if TYPE_CHECKING:
    from .response_store import ResponseStore

RESPONSE = "response"
_STORE_OFF = (
    "This vLLM engine does not support `store=True` and therefore does not support the "
    "background mode. To enable these features, set the environment variable "
    "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
)


@dataclass
class ResponseGeneration(Generation):
    """A Responses request: its generation, the messages it was rendered from (what a later
    `previous_response_id` continues), and whether it is stored and runs in the background."""

    messages: list[dict[str, str]] = field(default_factory=list)
    previous_response_id: str | None = None
    store: bool = False
    background: bool = False


def _messages(body: dict[str, Any], history: list[dict[str, str]]) -> list[dict[str, str]]:
    """The instructions (as vLLM puts them: first, before the conversation continued), the
    stored conversation `history`, then the new input, each message's content as its text."""
    try:
        given = responses_messages(body)
    except TemplateError as error:
        raise ApiError(400, str(error), error.param) from None
    system = 1 if body.get("instructions") else 0
    messages: list[dict[str, str]] = []
    for index, message in enumerate(given):
        where = "instructions" if index < system else "input"
        try:
            messages.append({"role": message["role"], "content": message_text(message["content"])})
        except TemplateError as error:
            raise ApiError(400, f"{where}: {error}", where) from None
    return [*messages[:system], *history, *messages[system:]]


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return value


def parse_response_request(
    body: Any, options: EngineOptions, arrival: float, store: "ResponseStore"
) -> ResponseGeneration:
    """Validate a Responses request; raise ApiError as vLLM would (its order: the model, the
    store and background switches, then the previous response, 404 when `store` has no such
    id)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    resolve_model(body, options)
    keep, background = _flag(body, "store", True), _flag(body, "background", False)
    if background and not keep:
        raise ApiError(400, "background can only be used when `store` is true", "background")
    if keep and not store.enabled:
        if background:
            raise ApiError(400, _STORE_OFF, error_type="invalid_request_error")
        keep = False  # as vLLM: `store` is ignored while its store is off
    if background and body.get("stream"):
        raise ApiError(400, "the simulator does not stream background responses", "stream")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise ApiError(400, "previous_response_id must be a string", "previous_response_id")
    history = [] if previous is None else store.get(previous).conversation()
    chat = {
        "model": body.get("model"),
        "messages": _messages(body, history),
        "max_tokens": body.get("max_output_tokens"),
        "stream": body.get("stream", False),
        "cache_salt": body.get("cache_salt"),
    }
    parsed = parse_generation(CHAT, chat, options, arrival)
    parsed.request.request_id = f"resp_{uuid.uuid4().hex}"
    return ResponseGeneration(
        kind=RESPONSE,
        model=parsed.model,
        stream=parsed.stream,
        include_usage=parsed.include_usage,
        request=parsed.request,
        messages=chat["messages"],
        previous_response_id=previous,
        store=keep,
        background=background,
    )


def _usage(request: GenerationRequest) -> dict[str, Any]:
    prompt, output = len(request.prompt_tokens), len(request.output_tokens)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": request.cached_tokens or 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _message_id(generation: Generation) -> str:
    return "msg_" + generation.request.request_id.removeprefix("resp_")


def _message(generation: Generation, text: str | None) -> dict[str, Any]:
    """The assistant message item: in progress and empty (None), or done with `text`:
    `incomplete` when `max_output_tokens` cut it, as the response is, else `completed`."""
    if text is None:
        status = "in_progress"
    else:
        status = "incomplete" if generation.request.finish_reason == "length" else "completed"
    return {
        "type": "message",
        "id": _message_id(generation),
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_part(text)],
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def response_object(
    generation: ResponseGeneration, created: int, final: bool = True, status: str | None = None
) -> dict[str, Any]:
    """The `response` object of a finished request, or (`final=False`) as it stands when
    a stream opens: in progress (or `status`: a background response `queued`, or
    `cancelled`), no output yet."""
    request = generation.request
    finished = final and request.finished
    cut = finished and request.finish_reason == "length"
    if status is None:
        status = ("incomplete" if cut else "completed") if finished else "in_progress"
    return {
        "id": request.request_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": generation.model,
        "output": [_message(generation, output_text(request))] if finished else [],
        "usage": _usage(request) if finished else None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "instructions": None,
        "max_output_tokens": request.params.max_tokens,
        "parallel_tool_calls": True,
        "previous_response_id": generation.previous_response_id,
        "store": generation.store,
        "background": generation.background,
        "tool_choice": "auto",
        "tools": [],
        "temperature": 1.0,
        "top_p": 1.0,
    }


class ResponseEvents:
    """Builds the stream's events in order, numbering them."""

    def __init__(self, generation: ResponseGeneration, created: int) -> None:
        self.generation = generation
        self.created = created
        self.sequence = 0
        self.item = {"item_id": _message_id(generation), "output_index": 0}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def opening(self) -> bytes:
        response = response_object(self.generation, self.created, final=False)
        part = _part("")
        return b"".join(
            [
                self._event("response.created", response=response),
                self._event("response.in_progress", response=response),
                self._event(
                    "response.output_item.added",
                    output_index=0,
                    item=_message(self.generation, None),
                ),
                self._event("response.content_part.added", **self.item, content_index=0, part=part),
            ]
        )

    def delta(self, text: str) -> bytes:
        return self._event("response.output_text.delta", **self.item, content_index=0, delta=text)

    def closing(self) -> bytes:
        text = output_text(self.generation.request)
        part = _part(text)
        response = response_object(self.generation, self.created)
        last = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return b"".join(
            [
                self._event("response.output_text.done", **self.item, content_index=0, text=text),
                self._event("response.content_part.done", **self.item, content_index=0, part=part),
                self._event(
                    "response.output_item.done",
                    output_index=0,
                    item=_message(self.generation, text),
                ),
                self._event(last, response=response),
            ]
        )


_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def deliver_response(
    generation: ResponseGeneration,
    send: Send,
    created: int,
    store: "ResponseStore",
    crash_after: int | None = None,
    crash: Callable[[], None] = lambda: None,
) -> None:
    """Answer a submitted Responses request, whole or streamed as it generates; a stored one
    is kept in `store` before its last bytes leave. A background request is answered at once,
    `queued`, and generates on. A request aborted mid-way (client gone, engine closing) ends
    the stream without its last event and is not kept; a stream with `crash_after` tokens
    relayed calls `crash` (the `crash_after_tokens` fault: the connection is cut)."""
    request = generation.request
    if generation.background:
        store.keep(generation, created)
        body = orjson.dumps(response_object(generation, created, final=False, status="queued"))
        await send({"type": "http.response.start", "status": 200, "headers": _JSON})
        await send({"type": "http.response.body", "body": body})
        return
    if not generation.stream:
        while not request.finished:
            await request.wait_for_progress()
        if request.finish_reason == ABORTED:
            return
        store.keep(generation, created)
        body = orjson.dumps(response_object(generation, created))
        await send({"type": "http.response.start", "status": 200, "headers": _JSON})
        await send({"type": "http.response.body", "body": body})
        return
    events = ResponseEvents(generation, created)
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    await send({"type": "http.response.body", "body": events.opening(), "more_body": True})
    sent = 0
    while True:
        new_tokens = request.output_tokens[sent:]
        if crash_after is not None:
            new_tokens = new_tokens[: max(0, crash_after - sent)]
        sent += len(new_tokens)
        chunk = b"".join(events.delta(token) for token in new_tokens)
        if crash_after is not None and sent >= crash_after:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            crash()
            return
        if request.finished:
            if request.finish_reason != ABORTED:
                store.keep(generation, created)
                chunk += events.closing()
            await send({"type": "http.response.body", "body": chunk})
            return
        if chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await request.wait_for_progress()
