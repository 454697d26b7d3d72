"""What an attempt's failure means: retry it? blame the engine? was it an overload signal?

The retry policy lives here as data, in one function; the forwarder only follows it:

| failure (error code)                               | retry | endpoint failure | overload |
|----------------------------------------------------|-------|------------------|----------|
| connect failed / connection lost / truncated       | yes   | yes              | yes      |
| connect or first-token timeout                     | yes   | yes (1)          | yes      |
| malformed stream or body (protocol error)          | yes   | yes              | yes      |
| engine 502, 503, 504                               | yes   | yes              | yes      |
| engine 429 with Retry-After                        | yes   | no               | yes      |
| engine 429 without Retry-After                     | no    | no               | yes      |
| engine 500 and other 5xx                           | no    | yes              | yes      |
| engine 401, 403: the endpoint's api_key refused    | yes   | yes              | no       |
| engine 4xx (400, 404, 413, 422, ...)               | no    | no               | no       |
| total deadline                                     | no    | yes (1)          | yes      |
| stall after the first token                        | —     | yes              | yes      |
| gateway's connections all in use; client not reading | no  | no (released)    | no       |

(1) not when the client or the chain shortened that limit (see limits.py).
Overload (the throttle's "not accepted") covers every failure and 429. Retry-After on 429/503
also holds the endpoint out of rotation for that long (breaker `hold`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.errors import (
    UPSTREAM_AUTH_FAILED,
    ClientStalled,
    KvgateError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from kvgate.upstream.failures import CONNECTIONS_EXHAUSTED

_RETRIABLE_STATUS = frozenset({502, 503, 504})
_LIMIT_CODES = frozenset({"upstream_first_token_timeout", "deadline_exceeded"})


@dataclass(frozen=True, slots=True)
class Verdict:
    retriable: bool
    endpoint_failure: bool
    overload: bool
    hold: float | None = None
    # The engine had no part in the attempt's end (the gateway's own limit, or a client that
    # stopped reading): counted as released, neither a failure nor an answer.
    released: bool = False


NEUTRAL = Verdict(retriable=False, endpoint_failure=False, overload=False)
RELEASED = Verdict(retriable=False, endpoint_failure=False, overload=False, released=True)


def judge(error: KvgateError, client_shortened: bool = False) -> Verdict:
    """Classify the error of one attempt (see the table in the module docstring)."""
    if isinstance(error, UpstreamError):
        status = error.status
        if error.code == UPSTREAM_AUTH_FAILED:
            # The gateway's credentials, not the client's request: another endpoint may take
            # them, and this one fails every request until its config is fixed.
            return Verdict(retriable=True, endpoint_failure=True, overload=False)
        if status == 429:
            return Verdict(error.retry_after is not None, False, True, error.retry_after)
        if status >= 500:
            hold = error.retry_after if status == 503 else None
            return Verdict(status in _RETRIABLE_STATUS, True, True, hold)
        return NEUTRAL
    if isinstance(error, ClientStalled) or error.code == CONNECTIONS_EXHAUSTED:
        return RELEASED
    if isinstance(error, UpstreamTimeout):
        blamed = not (client_shortened and error.code in _LIMIT_CODES)
        return Verdict(error.code != "deadline_exceeded", blamed, True)
    if isinstance(error, UpstreamUnavailable | UpstreamProtocolError):
        return Verdict(True, True, True)
    return NEUTRAL
