"""Session affinity: the endpoint that last served a session, bounded and expiring."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Mapping

from kvgate.types import RequestContext

# Longer session ids are kept as their digest: the table holds up to 100,000 of them.
_MAX_SESSION_CHARS = 256
# Expired sessions dropped per `set`: more than one, so the table shrinks while traffic lasts.
_SWEEP_PER_SET = 4


def session_key(ctx: RequestContext) -> str | None:
    """The client's session: `x-kvgate-session-id` or `x-kvgate-workflow-id` header, else the
    body's `user` field. Scoped by tenant (one tenant naming another's session neither finds
    nor moves it) and by model, so one session may use several models."""
    session = ctx.options.session_id
    kind = "h"
    if session is None:
        user = ctx.payload.get("user")
        if not isinstance(user, str) or not user:
            return None
        session, kind = user, "u"
    if len(session) > _MAX_SESSION_CHARS:
        session = hashlib.blake2b(session.encode(errors="replace"), digest_size=16).hexdigest()
    tenant = ctx.tenant.name if ctx.tenant is not None else ""
    return f"{tenant}\x00{ctx.model}\x00{kind}\x00{session}"


class SessionAffinity:
    """session key → endpoint name, at most `max_sessions` (least recently used dropped),
    each forgotten `ttl` seconds after its last request."""

    def __init__(self, ttl: float = 600.0, max_sessions: int = 100_000) -> None:
        self.ttl = ttl
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: str, now: float | None = None) -> str | None:
        entry = self._sessions.get(key)
        if entry is None:
            return None
        now = time.monotonic() if now is None else now
        if now - entry[1] > self.ttl:
            del self._sessions[key]
            return None
        return entry[0]

    def set(self, key: str, endpoint: str, now: float | None = None) -> None:
        sessions = self._sessions
        now = time.monotonic() if now is None else now
        sessions[key] = (endpoint, now)
        sessions.move_to_end(key)
        # Least recently used first: drop a few expired sessions from the head on every set,
        # so sessions that never come back drain faster than new ones arrive instead of
        # staying until `max_sessions` pushes them out, at a bounded cost per request.
        for _ in range(_SWEEP_PER_SET):
            oldest = next(iter(sessions))
            if now - sessions[oldest][1] <= self.ttl:
                break
            del sessions[oldest]
        while len(sessions) > self.max_sessions:
            sessions.popitem(last=False)

    def adopt(self, old: SessionAffinity, names: Mapping[str, str]) -> None:
        """Keep `old`'s sessions on the endpoints that remain after a reload (`names`: old
        endpoint name → new name), least recently used first, at most `max_sessions`, and
        none that has expired under the new `ttl`."""
        now = time.monotonic()
        for key, (endpoint, touched) in old._sessions.items():
            new_name = names.get(endpoint)
            if new_name is not None and now - touched <= self.ttl:
                self.set(key, new_name, touched)
