"""kvgate's errors, each mapped to one OpenAI error shape and status in one place.

    KvgateError                      every error a client can receive from kvgate
    ├── ClientError                  the client was wrong (4xx); never counts against an engine
    │   ├── InvalidRequest           400 (param names the field)
    │   ├── AuthenticationFailed     401
    │   ├── PermissionDenied         403
    │   ├── NotFound                 404 (model_not_found, unknown route)
    │   ├── MethodNotAllowed         405
    │   ├── RequestTimeout           408 the body did not arrive within server.body_timeout
    │   └── PayloadTooLarge          413
    ├── GatewayRefused               kvgate chose not to run the request now
    │   ├── RateLimited              429 (quota), with Retry-After
    │   └── Overloaded               503 (no capacity), with Retry-After
    ├── UpstreamFailed               an engine failed or misbehaved
    │   ├── UpstreamError            the engine answered with an error: its status and message
    │   ├── UpstreamUnavailable      502 could not connect / connection broke before an answer
    │   ├── UpstreamTimeout          504 connect, first-token, stall or total deadline
    │   └── UpstreamProtocolError    502 the engine's answer could not be understood
    └── GatewayBug                   500 a defect in kvgate itself

`type` uses OpenAI's vocabulary (`invalid_request_error` for every 4xx but 429, `requests` or
`tokens` for 429, `server_error` for 5xx). `code` is kvgate's reason (access log, metrics,
retry policy); `wire_code()` is what the client sees: the same string, or OpenAI's code for the
same case where OpenAI has one (docs/errors.md lists both side by side). `to_body()` renders
`{"error": {"message", "type", "param", "code"}}`; `to_sse()` the same object as a terminal
stream event.
"""

from __future__ import annotations

import math
import re
from typing import Any

import orjson


class KvgateError(Exception):
    status: int = 500
    type: str = "server_error"
    default_code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after = retry_after

    def wire_code(self) -> str | None:
        """The `code` the client sees: always a string or null."""
        return self.code if isinstance(self.code, str) else None

    @property
    def outcome(self) -> str:
        """The request's outcome in metrics labels, the access log and spans: kvgate's code."""
        return str(self.code)

    def to_dict(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.wire_code(),
            }
        }

    def to_body(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def to_sse(self) -> bytes:
        return b"data: " + self.to_body() + b"\n\n"

    def to_stream_event(self, route: str, relayed_events: int) -> bytes:
        """The error as the last event of a stream of `route` that relayed `relayed_events`
        events: a Responses stream's `error` event in OpenAI's shape (its `sequence_number`
        the next one, as engines number a stream's events from 0), else `to_sse()`."""
        if route != "responses":
            return self.to_sse()
        event = {
            "type": "error",
            "code": self.wire_code(),
            "message": self.message,
            "param": self.param,
            "sequence_number": relayed_events,
        }
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return []
        return [(b"retry-after", str(retry_after_seconds(self.retry_after)).encode())]


def retry_after_seconds(wait: float) -> int:
    """`Retry-After`'s whole seconds for a wait of `wait` seconds: rounded up (a client that
    waits what it is told must find the room there), at least 1."""
    return max(1, math.ceil(wait))


class ClientError(KvgateError):
    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class InvalidRequest(ClientError):
    pass


class AuthenticationFailed(ClientError):
    status = 401
    default_code = "invalid_api_key"

    def wire_code(self) -> str | None:
        # OpenAI answers a request without a key with code null.
        return None if self.code == "missing_api_key" else super().wire_code()


class PermissionDenied(ClientError):
    status = 403
    default_code = "permission_denied"


class NotFound(ClientError):
    status = 404
    default_code = "not_found"


class MethodNotAllowed(ClientError):
    status = 405
    default_code = "method_not_allowed"


class RequestTimeout(ClientError):
    status = 408
    default_code = "request_timeout"

    def headers(self) -> list[tuple[bytes, bytes]]:
        # The rest of the body may still be trickling in, and uvicorn restarts a connection's
        # keep-alive timer on every read: without `close` the client keeps it open at will.
        return [*super().headers(), (b"connection", b"close")]


class PayloadTooLarge(ClientError):
    status = 413
    default_code = "payload_too_large"


class UnsupportedMediaType(ClientError):
    status = 415
    default_code = "unsupported_content_encoding"


class ClientStalled(KvgateError):
    """A stream's client stopped reading it until the request's total deadline: its answer
    cannot be delivered, so the connection is dropped (nothing more is sent)."""

    status = 408
    type = "invalid_request_error"
    default_code = "client_read_timeout"


class GatewayRefused(KvgateError):
    pass


class RateLimited(GatewayRefused):
    """A tenant's allowance is used up. OpenAI's shape: `type` names the limit (`tokens` for
    the token quota, `requests` otherwise), `code` is always `rate_limit_exceeded`; kvgate's
    reason (`requests_per_minute_exceeded`, `max_concurrent_exceeded`…) stays in `code`."""

    status = 429
    type = "requests"
    default_code = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, code=code, retry_after=retry_after)
        if self.code == "tokens_per_minute_exceeded":
            self.type = "tokens"

    def wire_code(self) -> str | None:
        return "rate_limit_exceeded"


class Overloaded(GatewayRefused):
    status = 503
    default_code = "overloaded"


class UpstreamFailed(KvgateError):
    status = 502
    default_code = "upstream_error"


class UpstreamError(UpstreamFailed):
    """The engine answered with an error; kvgate relays its status and message."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        error_type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code, retry_after=retry_after)
        self.status = status
        if error_type:
            self.type = error_type

    def wire_code(self) -> str | None:
        # The engine's own string code, or null: never kvgate's internal default.
        return None if self.code == self.default_code else super().wire_code()

    @property
    def outcome(self) -> str:
        # The client sees any code the engine sent; a metric label takes only the codes
        # kvgate knows, so an engine's free-form codes cannot grow the series without bound.
        return str(self.code) if self.code in _KNOWN_ENGINE_CODES else self.default_code


class UpstreamUnavailable(UpstreamFailed):
    default_code = "upstream_unavailable"


class UpstreamTimeout(UpstreamFailed):
    status = 504
    default_code = "upstream_timeout"


class UpstreamProtocolError(UpstreamFailed):
    default_code = "upstream_protocol_error"


class GatewayBug(KvgateError):
    status = 500
    default_code = "internal_error"

    def wire_code(self) -> str | None:
        return None  # as OpenAI's own 500s


def drop_tracebacks(error: BaseException) -> None:
    """Unlink `error`, and every error it was raised from or while handling, from its
    traceback. Call once the error is handled and only its fields are still needed: a traceback
    holds the frames it passed through, and a frame that names the error (a local, an argument,
    a closure) closes a reference cycle that keeps the whole request's state alive until the
    cyclic garbage collector runs."""
    pending: list[BaseException] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


# Engines' error types that are already OpenAI's; others (vLLM's `BadRequestError`…) are
# replaced by the type OpenAI uses for the status.
_OPENAI_TYPES = frozenset(
    {"invalid_request_error", "server_error", "requests", "tokens", "insufficient_quota"}
)
# vLLM: "This model's maximum context length is N tokens. However, you requested M tokens…",
# newer vLLM: "…is too long to fit into the model (context length N)"; SGLang: "The input (N
# tokens) is longer than the model's context length (M tokens)."
_CONTEXT_LENGTH = re.compile(
    r"maximum context length|longer than the model's context length|too long to fit into the model",
    re.IGNORECASE,
)


def _openai_type(status: int) -> str:
    if status == 429:
        return "requests"
    return "server_error" if status >= 500 else "invalid_request_error"


# The request's field that holds the prompt, by route.
PROMPT_PARAMS = {
    "chat": "messages",
    "completions": "prompt",
    "embeddings": "input",
    "responses": "input",
    "tokenize": "prompt",
    "detokenize": "tokens",
    "rerank": "documents",
    "score": "text_2",
    "classify": "input",
    "pooling": "input",
}
# A context-length error about the completion's limit (vLLM: "'max_tokens' or
# 'max_completion_tokens' is too large: …"), not the prompt: the first field it names.
_COMPLETION_LIMIT = re.compile(r"max_completion_tokens|max_tokens|max_output_tokens")


def _validation_detail(detail: list[Any]) -> tuple[str, str | None] | None:
    """A FastAPI validation error's `detail` (a list of `{loc, msg}`), as one message and the
    body field of its first problem (None when it is not that shape)."""
    problems: list[str] = []
    fields: list[str] = []
    for item in detail:
        if not isinstance(item, dict) or not isinstance(item.get("msg"), str):
            return None
        loc = item.get("loc")
        where = [str(part) for part in loc] if isinstance(loc, list) else []
        if where[:1] == ["body"]:
            where = where[1:]
        field = ".".join(where)
        fields.append(field)
        problems.append(f"{field}: {item['msg']}" if field else item["msg"])
    if not problems:
        return None
    return "; ".join(problems), fields[0] or None


UPSTREAM_AUTH_FAILED = "upstream_auth_failed"

# Engine error codes kept as a request's outcome: OpenAI's vocabulary that engines use or
# kvgate translates to (any other code counts as `upstream_error`).
_KNOWN_ENGINE_CODES = frozenset(
    {
        "context_length_exceeded",
        "model_not_found",
        "invalid_value",
        "rate_limit_exceeded",
        UPSTREAM_AUTH_FAILED,
    }
)


def upstream_error_from_body(
    status: int, body: bytes, retry_after: float | None = None, prompt_param: str = "messages"
) -> UpstreamError:
    """Translate an engine's error body (vLLM nested, SGLang/old-vLLM flat) into OpenAI's
    shape and vocabulary: the type OpenAI uses for the status, `code` a string or null (the
    HTTP status vLLM puts there is dropped), a request over the context length
    `context_length_exceeded` (`param`: the engine's if it named one, else the completion
    limit when the message names it, else `prompt_param`, the body's prompt field), an unknown
    model `model_not_found`."""
    if status in (401, 403):
        # The engine refused the gateway's own key (`endpoints[].api_key`), never the
        # client's (not forwarded): a gateway fault, not one the client's SDK should report as
        # its key being wrong.
        return UpstreamError(
            f"the engine refused the gateway's credentials (HTTP {status}); the gateway's "
            "operator must fix the endpoint's api_key",
            status=502,
            error_type="server_error",
            code=UPSTREAM_AUTH_FAILED,
        )
    message = f"upstream returned HTTP {status}"
    error_type: str | None = None
    param: str | None = None
    code: str | None = None
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        nested = parsed.get("error")
        obj: dict[str, Any] = nested if isinstance(nested, dict) else parsed
        if isinstance(obj.get("message"), str):
            message = obj["message"]
        elif isinstance(parsed.get("detail"), str):
            message = parsed["detail"]
        elif isinstance(parsed.get("detail"), list):
            message, param = _validation_detail(parsed["detail"]) or (message, None)
        kind = obj.get("type")
        if isinstance(kind, str) and kind in _OPENAI_TYPES:
            error_type = kind
        if isinstance(obj.get("param"), str):
            param = obj["param"]
        if isinstance(obj.get("code"), str):
            code = obj["code"]
    elif body:
        message = f"upstream returned HTTP {status}: {body[:200].decode(errors='replace')}"
    if status == 400 and code is None and _CONTEXT_LENGTH.search(message):
        code = "context_length_exceeded"
        if param is None:
            limit = _COMPLETION_LIMIT.search(message)
            param = limit.group(0) if limit else prompt_param
    elif status == 404 and code is None and "model" in message.lower():
        code = "model_not_found"
    return UpstreamError(
        message,
        status=status,
        error_type=error_type or _openai_type(status),
        param=param,
        code=code,
        retry_after=retry_after,
    )
