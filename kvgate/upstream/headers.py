"""Which request headers travel upstream, and which the gateway adds."""

from __future__ import annotations

from kvgate.request_options import REQUEST_ID
from kvgate.types import Headers

# RFC 9110 §7.6.1 hop-by-hop headers, plus those kvgate sets itself or must never forward:
# the client's Authorization (the endpoint's own key is used), Host, framing and encoding, and
# the content type (the body is the JSON object the gateway read: vLLM refuses any other
# declared type, and a client's curl -d says application/x-www-form-urlencoded).
_NEVER_FORWARD = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"content-type",
        b"content-encoding",
        b"authorization",
        b"accept-encoding",
        b"x-request-id",
        b"proxy-connection",
    }
)
_GATEWAY_PREFIX = b"x-kvgate-"
_TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})


def upstream_headers(
    client_headers: Headers,
    request_id: str | None,
    auth_header: bytes | None,
    trace_context: Headers | None = None,
) -> Headers:
    """Client headers minus hop-by-hop ones (and any named in Connection), plus the request id
    (unless None), `content-type: application/json` and the endpoint's credentials.
    `traceparent` and other end-to-end headers pass through, except that a given
    `trace_context` (the attempt span's, when tracing is on) replaces the client's
    `traceparent` and `tracestate`."""
    named_in_connection: set[bytes] = set()
    for name, value in client_headers:
        if name == b"connection":
            named_in_connection.update(t.strip().lower() for t in value.split(b","))
    if trace_context is not None:
        named_in_connection |= _TRACE_CONTEXT
    out: Headers = [
        (name, value)
        for name, value in client_headers
        if name not in _NEVER_FORWARD
        and name not in named_in_connection
        and not name.startswith(_GATEWAY_PREFIX)
    ]
    if trace_context is not None:
        out += trace_context
    if request_id is not None:
        out.append((REQUEST_ID, request_id.encode()))
    out.append((b"accept-encoding", b"identity"))
    out.append((b"content-type", b"application/json"))
    if auth_header is not None:
        out.append((b"authorization", auth_header))
    return out
