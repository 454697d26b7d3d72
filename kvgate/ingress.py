"""Ingress: read the body within its limit, parse it once, check the fields kvgate relies on.

What the gateway itself relies on is validated here, before auth and admission do any work:
model, the prompt carrier (chat messages as OpenAI shapes them, kvgate/message_schema.py;
completion prompts; embedding inputs), stream flags, token counts. Every other field passes
through untouched for the engine to judge; on the engines' own APIs (`ENGINE_ROUTES`) that is
every field but `model`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from kvgate import response_routes
from kvgate.asgi import Receive, Scope
from kvgate.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from kvgate.message_schema import check_message
from kvgate.prompt_view import MEDIA_TOKENS, PromptView
from kvgate.request_options import RequestOptions, parse_request_options, sane_request_id
from kvgate.types import Headers, RequestContext

# Longer than any served model name (a Hugging Face id is at most 96 characters; vLLM's default
# name is the model's path): a request's model is echoed in errors, logs and traces.
MAX_MODEL_CHARS = 1024
INFERENCE_ROUTES: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
# The engines' other JSON APIs, served beside OpenAI's by vLLM (and most of them by SGLang):
# one JSON object in, one out, on the path the client used; routed by `model` like embeddings.
ENGINE_ROUTES: dict[str, str] = {
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/score": "score",
    "/score": "score",
    "/classify": "classify",
    "/pooling": "pooling",
}
INFERENCE_ROUTES |= ENGINE_ROUTES
# The routes that generate tokens, and may stream them. The others answer with one JSON object
# whatever the body says: vLLM ignores a `stream` field on embeddings, so the gateway passes it
# through and never expects a stream back.
GENERATION_ROUTES = frozenset({"chat", "completions", "responses"})


async def read_body(
    headers: list[tuple[bytes, bytes]], receive: Receive, limit: int, within: float = 30.0
) -> bytes:
    """The request body; 413 before reading when Content-Length exceeds `limit`, and as soon as
    the bytes read exceed it otherwise; 408 when the whole body has not arrived within
    `within` seconds (a client trickling bytes holds no connection for longer); 415 for a
    compressed body (`Content-Encoding`), which neither kvgate nor the engines decode."""
    for name, value in headers:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise InvalidRequest("Content-Length is not a number") from None
            if declared > limit:
                raise PayloadTooLarge(
                    f"request body of {declared} bytes exceeds the limit of {limit} bytes"
                )
        elif name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            raise UnsupportedMediaType(
                f"Content-Encoding {value.decode('latin-1')!r} is not supported: send the body "
                "uncompressed",
                code="unsupported_content_encoding",
            )
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(within):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {within:g} s", code="request_timeout"
        ) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_MAX_DEPTH = 254


class ClientGone(Exception):
    """The client disconnected before its request was read: nothing to answer."""


# The largest count an engine reads (a 64-bit integer).
_MAX_COUNT = 2**63 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_str(payload: dict[str, Any], key: str) -> str:
    value = payload.get(key)
    if value is None:
        raise InvalidRequest(
            f"'{key}' is a required property", param=key, code="missing_required_parameter"
        )
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{key}' must be a non-empty string", param=key, code="invalid_type")
    return value


def _check_messages(payload: dict[str, Any]) -> None:
    messages = payload.get("messages")
    if messages is None:
        raise InvalidRequest(
            "'messages' is a required property", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            "'messages' must be a non-empty array", param="messages", code="invalid_type"
        )
    for i, message in enumerate(messages):
        check_message(message, f"messages[{i}]")


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    if isinstance(first, str):
        return all(isinstance(v, str) for v in value)
    if _is_int(first):
        return all(_is_int(v) for v in value)
    if isinstance(first, list):
        return all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value)
    return False


def _check_carrier(payload: dict[str, Any], key: str) -> None:
    if key not in payload:
        raise InvalidRequest(
            f"'{key}' is a required property", param=key, code="missing_required_parameter"
        )
    if not _is_prompt(payload[key]):
        raise InvalidRequest(
            f"'{key}' must be a string, an array of strings, an array of token ids or an array "
            "of token-id arrays",
            param=key,
            code="invalid_type",
        )


def _check_common(payload: dict[str, Any], route: str) -> bool:
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream", code="invalid_type")
    options = payload.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest(
                "'stream_options' must be an object", param="stream_options", code="invalid_type"
            )
        if options and not stream:  # vLLM lets an empty one pass
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        for flag in ("include_usage", "continuous_usage_stats"):
            if options.get(flag) is not None and not isinstance(options[flag], bool):
                raise InvalidRequest(
                    f"'stream_options.{flag}' must be a boolean",
                    param=f"stream_options.{flag}",
                    code="invalid_type",
                )
    # A completion may echo its prompt and generate nothing (OpenAI's API and vLLM's).
    echo_only = route == "completions" and payload.get("echo") is True
    _check_count(payload, "max_tokens", 0 if echo_only else 1)
    _check_count(payload, "max_completion_tokens")
    _check_count(payload, "n")
    return stream


def _check_count(payload: dict[str, Any], key: str, least: int = 1) -> None:
    """An optional count: an integer or a whole float (`invalid_type` otherwise) of at least
    `least` (`invalid_value`)."""
    value = payload.get(key)
    if value is None:
        return
    # A whole float (`512.0`, what `json.dumps` writes for a computed budget) is an integer to
    # the engines (pydantic's lax int); so is a number past 64 bits, which orjson reads as a
    # float and no engine can serve.
    if not (_is_int(value) or (isinstance(value, float) and value.is_integer())):
        raise InvalidRequest(f"'{key}' must be an integer", param=key, code="invalid_type")
    if value < least:
        raise InvalidRequest(f"'{key}' must be at least {least}", param=key, code="invalid_value")
    if value > _MAX_COUNT:
        raise InvalidRequest(f"'{key}' is too large", param=key, code="invalid_value")


def _check_depth(body: bytes, payload: dict[str, Any]) -> None:
    """The gateway re-serialises bodies (tenant cache salt, stream resume, prompt text for
    routing) with orjson, which stops at 254 levels of nesting: deeper bodies are refused here
    rather than failing later. Only a body with that many brackets can be that deep, so the
    common case costs two byte counts."""
    if body.count(b"[") + body.count(b"{") < _MAX_DEPTH:
        return
    try:
        orjson.dumps(payload)
    except TypeError:
        raise InvalidRequest(
            f"request body is nested more than {_MAX_DEPTH} levels deep", code="invalid_json"
        ) from None


def _check_tools(payload: dict[str, Any]) -> None:
    tools = payload.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise InvalidRequest(
            "'tools' must be an array of objects", param="tools", code="invalid_type"
        )


def _check_response_input(payload: dict[str, Any]) -> None:
    """OpenAI Responses `input`: a string, or a non-empty array of input items (objects); a
    `previous_response_id`, if any, a string (decoded by kvgate/chain/responses_gate.py)."""
    _check_count(payload, "max_output_tokens")
    previous = payload.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidRequest(
            "'previous_response_id' must be a string",
            param="previous_response_id",
            code="invalid_type",
        )
    if "input" not in payload:
        raise InvalidRequest(
            "'input' is a required property", param="input", code="missing_required_parameter"
        )
    given = payload["input"]
    if isinstance(given, str):
        return
    if not isinstance(given, list) or not given:
        raise InvalidRequest(
            "'input' must be a string or a non-empty array of input items",
            param="input",
            code="invalid_type",
        )
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise InvalidRequest(
                f"input[{i}] must be an object", param=f"input[{i}]", code="invalid_type"
            )


def parse_payload(route: str, body: bytes) -> tuple[dict[str, Any], str, bool]:
    """Parse the body once and return (payload, model, stream), or raise InvalidRequest."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(
            f"request body is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})",
            code="invalid_json",
        ) from None
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_type")
    _check_depth(body, payload)
    model = _require_str(payload, "model")
    if len(model) > MAX_MODEL_CHARS:
        raise InvalidRequest(
            f"'model' is longer than {MAX_MODEL_CHARS} characters",
            param="model",
            code="invalid_value",
        )
    if route == "chat":
        _check_messages(payload)
        _check_tools(payload)
    elif route == "completions":
        if payload.get("prompt") is not None or payload.get("prompt_embeds") is None:
            _check_carrier(payload, "prompt")  # vLLM: `prompt_embeds` may stand for the prompt
    elif route == "responses":
        _check_response_input(payload)
    elif route == "embeddings":
        if "input" not in payload and "messages" in payload:
            _check_messages(payload)  # vLLM's chat embeddings: `messages` in place of `input`
        else:
            _check_carrier(payload, "input")
    stream = _check_common(payload, route) if route in GENERATION_ROUTES else False
    return payload, model, stream


def request_context(
    route: str,
    payload: dict[str, Any],
    *,
    headers: Headers | None = None,
    body: bytes = b"",
    upstream_path: str | None = None,
    chars_per_token: float = 4.0,
    media_tokens: int = MEDIA_TOKENS,
    options: RequestOptions | None = None,
    started: float | None = None,
) -> RequestContext:
    """The context of a request whose body and headers passed ingress: its options parsed
    from the headers (unless given) and its prompt view. Raises InvalidRequest for a malformed
    option header."""
    headers = headers or []
    if options is None:
        options = parse_request_options(headers)
    request_id = options.request_id
    body_names_request = False
    if not options.request_id_given:
        # vLLM names a request by the X-Request-Id header, else by the body's `request_id`:
        # the gateway's header must carry the body's, or the engine would drop it; one no
        # header can carry goes alone (no header), as it would reach the engine directly.
        given = payload.get("request_id")
        if sane_request_id(given):
            request_id = given
        elif isinstance(given, str) and given:
            body_names_request = True
    return RequestContext(
        request_id=request_id,
        body_names_request=body_names_request,
        route=route,
        upstream_path=upstream_path or _PATHS[route],
        client_headers=headers,
        body=body,
        payload=payload,
        model=str(payload.get("model", "")),
        stream=route in GENERATION_ROUTES and payload.get("stream") is True,
        options=options,
        view=PromptView(route, payload, chars_per_token, media_tokens),
        started=time.perf_counter() if started is None else started,
    )


def stored_response_context(
    scope: Scope,
    body: bytes,
    response_id: str,
    rest: str,
    route: str,
    *,
    chars_per_token: float = 4.0,
    started: float | None = None,
) -> RequestContext:
    """The context of a request on a `/v1/responses/{id}` route (kvgate/response_routes.py:
    `response_id` and the `rest` of the path after it, as `split` gave them; `route` as
    `route_of` named it) whose method is one forwarded: its body is forwarded as it came,
    unread; its method, query string and the rest of its path too. Raises InvalidRequest for
    a malformed option header."""
    method = scope["method"]
    query = scope.get("query_string", b"")
    options = parse_request_options(scope["headers"])
    return RequestContext(
        request_id=options.request_id,
        route=route,
        upstream_path=response_routes.upstream_path(response_id, rest, query),
        client_headers=scope["headers"],
        body=body,
        payload={},
        model="",
        stream=response_routes.wants_stream(route, query),
        options=options,
        view=PromptView(route, {}, chars_per_token),
        started=time.perf_counter() if started is None else started,
        method=method.encode(),
        response_id=response_id,
    )


# Each route's first path: where a context made without the client's path is sent.
_PATHS = {route: path for path, route in reversed(INFERENCE_ROUTES.items())}
