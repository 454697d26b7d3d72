"""kvgate's errors, each mapped to one OpenAI error shape and status in one place.

    KvgateError                      every error a client can receive from kvgate
    ├── ClientError                  the client was wrong (4xx); never counts against an engine
    │   ├── InvalidRequest           400 invalid_request_error (param names the field)
    │   ├── AuthenticationFailed     401 authentication_error
    │   ├── PermissionDenied         403 permission_error
    │   ├── NotFound                 404 not_found_error (model_not_found, unknown route)
    │   ├── MethodNotAllowed         405 invalid_request_error
    │   └── PayloadTooLarge          413 invalid_request_error
    ├── GatewayRefused               kvgate chose not to run the request now
    │   ├── RateLimited              429 rate_limit_error (quota), with Retry-After
    │   └── Overloaded               503 overloaded_error (no capacity), with Retry-After
    ├── UpstreamFailed               an engine failed or misbehaved
    │   ├── UpstreamError            the engine answered with an error: its status and message
    │   ├── UpstreamUnavailable      502 could not connect / connection broke before an answer
    │   ├── UpstreamTimeout          504 connect, first-token, stall or total deadline
    │   └── UpstreamProtocolError    502 the engine's answer could not be understood
    └── GatewayBug                   500 internal_error: a defect in kvgate itself

`to_body()` renders the OpenAI shape `{"error": {"message", "type", "param", "code"}}`;
`to_sse()` renders the same object as a terminal stream event.
"""

from __future__ import annotations

import orjson


class KvgateError(Exception):
    status: int = 500
    type: str = "internal_error"
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

    def to_dict(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_body(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def to_sse(self) -> bytes:
        return b"data: " + self.to_body() + b"\n\n"

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return []
        return [(b"retry-after", str(max(1, round(self.retry_after))).encode())]


class ClientError(KvgateError):
    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class InvalidRequest(ClientError):
    pass


class AuthenticationFailed(ClientError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(ClientError):
    status = 403
    type = "permission_error"
    default_code = "permission_denied"


class NotFound(ClientError):
    status = 404
    type = "not_found_error"
    default_code = "not_found"


class MethodNotAllowed(ClientError):
    status = 405
    default_code = "method_not_allowed"


class PayloadTooLarge(ClientError):
    status = 413
    default_code = "payload_too_large"


class GatewayRefused(KvgateError):
    pass


class RateLimited(GatewayRefused):
    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class Overloaded(GatewayRefused):
    status = 503
    type = "overloaded_error"
    default_code = "overloaded"


class UpstreamFailed(KvgateError):
    status = 502
    type = "upstream_error"
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


class UpstreamUnavailable(UpstreamFailed):
    default_code = "upstream_unavailable"


class UpstreamTimeout(UpstreamFailed):
    status = 504
    default_code = "upstream_timeout"


class UpstreamProtocolError(UpstreamFailed):
    default_code = "upstream_protocol_error"


class GatewayBug(KvgateError):
    status = 500
    type = "internal_error"
    default_code = "internal_error"


def upstream_error_from_body(
    status: int, body: bytes, retry_after: float | None = None
) -> UpstreamError:
    """Translate an engine's error body (vLLM nested, SGLang/old-vLLM flat) into OpenAI shape."""
    message = f"upstream returned HTTP {status}"
    error_type: str | None = None
    param: str | None = None
    code: str | int | None = status
    try:
        parsed = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        obj = parsed.get("error") if isinstance(parsed.get("error"), dict) else parsed
        if isinstance(obj.get("message"), str):
            message = obj["message"]
        elif isinstance(parsed.get("detail"), str):
            message = parsed["detail"]
        if isinstance(obj.get("type"), str):
            error_type = obj["type"]
        if isinstance(obj.get("param"), str):
            param = obj["param"]
        if isinstance(obj.get("code"), str | int) and not isinstance(obj.get("code"), bool):
            code = obj["code"]
    elif body:
        message = f"upstream returned HTTP {status}: {body[:200].decode(errors='replace')}"
    return UpstreamError(
        message,
        status=status,
        error_type=error_type,
        param=param,
        code=code,
        retry_after=retry_after,
    )
