"""The client's `x-kvgate-*` request headers: their names, and one scan that reads them all.

Every option a client can set by header is parsed and validated here, at ingress, before any
stage takes anything: a malformed header is a 400 that costs no quota, queue position or engine.

    x-request-id                    the request id (kept when sane, else a fresh one)
    x-kvgate-timeout-ms             shorten the total time limit
    x-kvgate-first-token-timeout-ms shorten the time to the first streamed event
    x-kvgate-deadline               seconds within which the whole request must finish
    x-kvgate-workflow-id, -step     an agent workflow and this request's step (`3` or `3/5`)
    x-kvgate-session-id             a session for endpoint affinity
    x-kvgate-explain: 1             ask for the routing explanation (operators only)
    x-kvgate-admin-key              the operator's admin key, with x-kvgate-explain
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TypeGuard

from kvgate.errors import InvalidRequest
from kvgate.types import Headers, header_value

REQUEST_ID = b"x-request-id"
TOTAL_TIMEOUT = b"x-kvgate-timeout-ms"
FIRST_TOKEN_TIMEOUT = b"x-kvgate-first-token-timeout-ms"
DEADLINE = b"x-kvgate-deadline"
WORKFLOW_ID = b"x-kvgate-workflow-id"
WORKFLOW_STEP = b"x-kvgate-workflow-step"
SESSION_ID = b"x-kvgate-session-id"
EXPLAIN = b"x-kvgate-explain"
ADMIN_KEY = b"x-kvgate-admin-key"
# Response headers kvgate adds.
ENDPOINT = b"x-kvgate-endpoint"
ROUTE_EXPLAIN = b"x-kvgate-route-explain"

# 1 to 128 visible ASCII characters: safe in a header, a log line and a trace, and what
# clients use (`job/42#7`, UUIDs, `req_…`); spaces and control characters are not.
_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")
_WORKFLOW_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")
_STEP = re.compile(rb"\s*(\d{1,6})\s*(?:/\s*(\d{1,6})\s*)?")
_MAX_MS_DIGITS = 9
_OPTION_HEADERS = frozenset(
    {REQUEST_ID, TOTAL_TIMEOUT, FIRST_TOKEN_TIMEOUT, DEADLINE, WORKFLOW_ID, WORKFLOW_STEP,
     SESSION_ID, EXPLAIN, ADMIN_KEY}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Workflow:
    """An agent workflow a request belongs to (`x-kvgate-workflow-id`, `-step: 3/5`)."""

    id: str
    step: int
    total: int | None


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What the client asked for by header; None where it asked for nothing. Seconds."""

    request_id: str
    request_id_given: bool = False  # the client's X-Request-Id, not a fresh one
    total_timeout: float | None = None
    first_token_timeout: float | None = None
    deadline: float | None = None
    workflow: Workflow | None = None
    session_id: str | None = None
    explain: bool = False
    admin_key: bytes | None = None


def fresh_request_id() -> str:
    return os.urandom(16).hex()  # 128 random bits, as uuid4().hex but without the UUID object


def sane_request_id(value: object) -> TypeGuard[str]:
    """Whether `value` may be sent on as an X-Request-Id (1 to 128 visible ASCII characters)."""
    return isinstance(value, str) and _REQUEST_ID.fullmatch(value.encode()) is not None


def request_id_from(headers: Headers) -> str:
    """The client's X-Request-Id when it is sane, else a fresh one."""
    value = header_value(headers, REQUEST_ID)
    if value is not None and _REQUEST_ID.fullmatch(value):
        return value.decode()
    return fresh_request_id()


def parse_request_options(headers: Headers) -> RequestOptions:
    """One pass over the headers; raises InvalidRequest naming the first malformed one."""
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in _OPTION_HEADERS and name not in found:
            found[name] = value
    if not found:
        return RequestOptions(fresh_request_id())
    raw_id = found.get(REQUEST_ID)
    admin_key = found.get(ADMIN_KEY)
    given = raw_id is not None and _REQUEST_ID.fullmatch(raw_id) is not None
    return RequestOptions(
        request_id=raw_id.decode() if given and raw_id is not None else fresh_request_id(),
        request_id_given=given,
        total_timeout=_milliseconds(found, TOTAL_TIMEOUT),
        first_token_timeout=_milliseconds(found, FIRST_TOKEN_TIMEOUT),
        deadline=_deadline(found.get(DEADLINE)),
        workflow=_workflow(found.get(WORKFLOW_ID), found.get(WORKFLOW_STEP)),
        session_id=_session(found.get(SESSION_ID), found.get(WORKFLOW_ID)),
        explain=found.get(EXPLAIN, b"").strip() == b"1",
        admin_key=admin_key.strip() if admin_key is not None else None,
    )


def _milliseconds(found: dict[bytes, bytes], name: bytes) -> float | None:
    value = found.get(name)
    if value is None:
        return None
    if not value.isdigit() or len(value) > _MAX_MS_DIGITS or int(value) == 0:
        raise InvalidRequest(
            f"{name.decode()} must be a positive whole number of milliseconds",
            param=name.decode(),
            code="invalid_timeout_header",
        )
    return int(value) / 1000


def _deadline(raw: bytes | None) -> float | None:
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < 1e7):
        raise InvalidRequest(
            "x-kvgate-deadline must be a positive number of seconds",
            param=DEADLINE.decode(),
            code="invalid_header",
        )
    return seconds


def _workflow(raw_id: bytes | None, raw_step: bytes | None) -> Workflow | None:
    if raw_id is None and raw_step is None:
        return None
    if raw_id is None or not _WORKFLOW_ID.fullmatch(raw_id):
        raise InvalidRequest(
            "x-kvgate-workflow-id must be 1-128 characters of "
            "A-Z a-z 0-9 . _ : - when a workflow step is given",
            param=WORKFLOW_ID.decode(),
            code="invalid_header",
        )
    step, total = 1, None
    if raw_step is not None:
        match = _STEP.fullmatch(raw_step)
        if (
            match is None
            or int(match.group(1)) < 1
            or (match.group(2) is not None and int(match.group(2)) < int(match.group(1)))
        ):
            raise InvalidRequest(
                "x-kvgate-workflow-step must be 'N' or 'N/TOTAL' with 1 <= N <= TOTAL",
                param=WORKFLOW_STEP.decode(),
                code="invalid_header",
            )
        step = int(match.group(1))
        total = int(match.group(2)) if match.group(2) is not None else None
    return Workflow(raw_id.decode(), step, total)


def _session(session: bytes | None, workflow: bytes | None) -> str | None:
    """The session for endpoint affinity: the session id, else the workflow id."""
    value = session or workflow
    return value.decode("latin-1") if value else None
