"""The OpenAI-compatible wire format: request parsing, response bodies, error shapes.

Parsing turns a request body into a `GenerationRequest` (or raises `ApiError`), validating
what vLLM validates before a stream starts, notably the context length. Builders return
plain dicts ready for JSON encoding; `flavor` picks vLLM's or SGLang's error shape.
"""

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvgate.sim_chat_template import TemplateError, render_chat
from kvgate.sim_tokenizer import tokenize

from .options import EngineOptions
from .sequence import GenerationRequest, SamplingParams

CHAT = "chat"
COMPLETION = "completion"

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A request the engine answers with an HTTP error; `body(flavor)` is its JSON. The type
    is the one vLLM names after the status unless `error_type` is given (vLLM's Responses API
    store errors say `invalid_request_error`)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, error_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type

    def body(self, flavor: str) -> dict[str, Any]:
        """vLLM: `{"error": {message, type, param, code}}`; SGLang: the flat legacy shape."""
        default_type = "BadRequestError" if self.status < 500 else "InternalServerError"
        error_type = self.error_type or _ERROR_TYPES.get(self.status, default_type)
        if flavor == "sglang":
            return {
                "object": "error",
                "message": self.message,
                "type": error_type,
                "param": None,
                "code": self.status,
            }
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class Generation:
    """A parsed generation request and how to answer it."""

    kind: str
    model: str
    stream: bool
    include_usage: bool
    request: GenerationRequest


def resolve_model(body: dict[str, Any], options: EngineOptions) -> str:
    """Return the served model the body names (the first one if it names none)."""
    model = body.get("model")
    if model is None:
        return options.models[0]
    if model not in options.models:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    return model


def parse_generation(
    kind: str,
    body: Any,
    options: EngineOptions,
    arrival: float,
    header_request_id: str | None = None,
) -> Generation:
    """Validate a chat or completion body; raise ApiError with the engine's message if bad."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = resolve_model(body, options)
    if body.get("n", 1) != 1:
        raise ApiError(400, "the simulator only supports n=1", "n")
    _check_sampling(body)
    if kind == CHAT:
        try:
            prompt = render_chat(
                body.get("messages") or [],
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
            )
        except TemplateError as error:
            raise ApiError(400, str(error), "messages") from None
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prompt = _completion_prompt(body.get("prompt"))
        max_tokens = body.get("max_tokens", 16)
    prompt_tokens = tokenize(prompt)
    max_tokens = _checked_max_tokens(max_tokens, len(prompt_tokens), options)
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stop=_stop_strings(body.get("stop")),
        priority=_priority(body.get("priority", 0), options),
        cache_salt=_optional_string(body.get("cache_salt"), "cache_salt"),
    )
    stream_options = body.get("stream_options")
    # vLLM and SGLang: a `stream_options` object asks for usage unless it says otherwise.
    include_usage = isinstance(stream_options, dict) and bool(
        stream_options.get("include_usage", True)
    )
    # vLLM names a request by the X-Request-Id header, else by the body's `request_id`.
    request_id = header_request_id or body.get("request_id") or uuid.uuid4().hex
    prefix = "chatcmpl-" if kind == CHAT else "cmpl-"
    return Generation(
        kind=kind,
        model=model,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        request=GenerationRequest(f"{prefix}{request_id}", prompt, prompt_tokens, params, arrival),
    )


# vLLM's ranges for the sampling parameters the simulator accepts and ignores (its text does
# not depend on them): (lowest, highest, whether the lowest itself is allowed).
_SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, math.inf, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "presence_penalty": (-2.0, 2.0, True),
    "frequency_penalty": (-2.0, 2.0, True),
    "repetition_penalty": (0.0, math.inf, False),
}


def _check_sampling(body: dict[str, Any]) -> None:
    """Refuse what vLLM refuses (a 400 naming the parameter): a sampling parameter that is not
    a number or is out of its range, a `top_k` below -1 or not an integer, a `seed` that is
    not an integer."""
    for name, (low, high, low_allowed) in _SAMPLING_RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ApiError(400, f"{name} must be a number, got {value!r}.", name)
        if value < low or (value == low and not low_allowed) or value > high:
            opening = "[" if low_allowed else "("
            closing = "]" if high < math.inf else ")"
            raise ApiError(
                400, f"{name} must be in {opening}{low:g}, {high:g}{closing}, got {value}.", name
            )
    for name in ("top_k", "seed"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ApiError(400, f"{name} must be an integer, got {value!r}.", name)
    top_k = body.get("top_k")
    if top_k is not None and top_k < -1:
        message = f"top_k must be at least -1 (-1 and 0 disable it), got {top_k}."
        raise ApiError(400, message, "top_k")


def _completion_prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "the simulator needs `prompt` to be one string", "prompt")
    if not prompt:
        raise ApiError(400, "Prompt cannot be empty", "prompt")  # as vLLM answers
    return prompt


def _checked_max_tokens(max_tokens: Any, prompt_len: int, options: EngineOptions) -> int:
    limit = options.context_length
    if prompt_len >= limit:
        if options.flavor == "sglang":
            message = (
                f"The input ({prompt_len} tokens) is longer than the model's context "
                f"length ({limit} tokens)."
            )
        else:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of "
                "the input messages."
            )
        raise ApiError(400, message, "messages")
    if max_tokens is None:
        return limit - prompt_len
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, "max_tokens must be a positive integer", "max_tokens")
    if prompt_len + max_tokens > limit:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {limit} tokens and your request has {prompt_len} "
            f"input tokens ({max_tokens} > {limit} - {prompt_len}).",
            "max_tokens",
        )
    return max_tokens


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(item, str) and item for item in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
    return tuple(stop)


def _priority(priority: Any, options: EngineOptions) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ApiError(400, "priority must be an integer", "priority")
    if priority != 0 and options.scheduling_policy != "priority":
        raise ApiError(400, "Priority scheduling is not enabled.", "priority")
    return priority


def _optional_string(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", name)
    return value


# --- responses -------------------------------------------------------------------------


def usage(request: GenerationRequest) -> dict[str, Any]:
    """The `usage` object, with the prompt's prefix-cache hits as `cached_tokens`."""
    prompt_tokens = len(request.prompt_tokens)
    completion_tokens = len(request.output_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": request.cached_tokens or 0},
    }


def output_text(request: GenerationRequest) -> str:
    """The finished request's visible text (cut before a matched stop string)."""
    text = "".join(request.output_tokens)
    return text if request.text_limit is None else text[: request.text_limit]


def full_response(generation: Generation, created: int) -> dict[str, Any]:
    """The non-streaming answer to a finished request."""
    request = generation.request
    text = output_text(request)
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": None,
        "finish_reason": request.finish_reason,
        "stop_reason": request.stop_reason,
    }
    if generation.kind == CHAT:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        object_name = "chat.completion"
    else:
        choice["text"] = text
        object_name = "text_completion"
    return {
        "id": request.request_id,
        "object": object_name,
        "created": created,
        "model": generation.model,
        "choices": [choice],
        "usage": usage(request),
    }


def stream_chunk(
    generation: Generation,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    *,
    role: bool = False,
    sglang: bool = False,
) -> dict[str, Any]:
    """One streamed chunk; `role=True` makes the chat opening chunk. SGLang's chunks name the
    matched stop `matched_stop` (on every choice) where vLLM's say `stop_reason` (when
    finishing)."""
    request = generation.request
    choice: dict[str, Any]
    if generation.kind == CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        object_name = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        object_name = "text_completion"
    if sglang:
        choice["matched_stop"] = request.stop_reason if finish_reason is not None else None
    elif finish_reason is not None:
        choice["stop_reason"] = request.stop_reason
    return {
        "id": request.request_id,
        "object": object_name,
        "created": created,
        "model": generation.model,
        "choices": [choice],
    }


def usage_chunk(generation: Generation, created: int) -> dict[str, Any]:
    """The extra chunk `stream_options.include_usage` asks for, sent before `[DONE]`."""
    object_name = "chat.completion.chunk" if generation.kind == CHAT else "text_completion"
    return {
        "id": generation.request.request_id,
        "object": object_name,
        "created": created,
        "model": generation.model,
        "choices": [],
        "usage": usage(generation.request),
    }


def now_seconds() -> int:
    """The `created` timestamp."""
    return int(time.time())
