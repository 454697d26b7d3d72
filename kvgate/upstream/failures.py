"""What a failed attempt means to the client: transport failures and timeouts as kvgate errors.

The transport raises its own small tree (`kvgate/upstream/transport.py`) and the attempt's
timers raise `TimeoutError`; `attempt_failure` is the one place either becomes the
`UpstreamFailed` the client (and `attempts.judge`) sees, by the phase the attempt was in:

    first_token   opening the response or waiting for the first event of a stream
    stall         between two events after the first
    total         the whole request (a unary answer, or the request's own deadline)
"""

from __future__ import annotations

from typing import Literal

from kvgate.errors import (
    KvgateError,
    Overloaded,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from kvgate.upstream.transport import ConnectFailed, ConnectTimeout, PoolExhausted, TransportError

Phase = Literal["first_token", "stall", "total"]
CONNECTIONS_EXHAUSTED = "upstream_connections_exhausted"

_TIMEOUT_ERRORS: dict[Phase, tuple[str, str]] = {
    "first_token": ("no first token from the engine in time", "upstream_first_token_timeout"),
    "stall": ("the engine stopped sending tokens", "upstream_stall_timeout"),
    "total": ("the request exceeded its total deadline", "deadline_exceeded"),
}

_BROKE_WHERE: dict[Phase, str] = {
    "first_token": "before the first token",
    "stall": "mid-stream",
    "total": "before the answer was complete",
}


def attempt_failure(failure: TransportError | TimeoutError, phase: Phase) -> KvgateError:
    """The error for a transport failure or an expired timer met in `phase`."""
    if isinstance(failure, PoolExhausted):
        # The gateway's own limit: the engine is not to blame, nor is another engine free of it.
        return Overloaded(
            f"the gateway has no free upstream connection ({failure}; upstream.max_connections)",
            code=CONNECTIONS_EXHAUSTED,
            retry_after=1,
        )
    if isinstance(failure, ConnectTimeout):
        return UpstreamTimeout(
            "timed out connecting to the engine", code="upstream_connect_timeout"
        )
    if isinstance(failure, ConnectFailed):
        return UpstreamUnavailable(
            "could not connect to the engine", code="upstream_connect_failed"
        )
    if isinstance(failure, TransportError):
        return UpstreamUnavailable(
            f"the engine connection broke {_BROKE_WHERE[phase]} ({failure})",
            code="upstream_connection_lost",
        )
    message, code = _TIMEOUT_ERRORS[phase]
    return UpstreamTimeout(message, code=code)
