"""Session affinity: the endpoint that last served a session, bounded and expiring."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Mapping

from kvgate.types import RequestContext

# Longer session ids are kept as their digest: the table holds up to 100,000 of them.
_MAX_SESSION_CHARS = 256


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
        sessions[key] = (endpoint, time.monotonic() if now is None else now)
        sessions.move_to_end(key)
        while len(sessions) > self.max_sessions:
            sessions.popitem(last=False)

    def adopt(self, old: SessionAffinity, names: Mapping[str, str]) -> None:
        """Keep `old`'s sessions on the endpoints that remain after a reload (`names`: old
        endpoint name → new name), least recently used first, at most `max_sessions`."""
        for key, (endpoint, touched) in old._sessions.items():
            new_name = names.get(endpoint)
            if new_name is not None:
                self.set(key, new_name, touched)
