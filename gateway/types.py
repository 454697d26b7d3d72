"""The core contracts every stage shares: the request context and the stage protocol."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.routing.endpoints import Endpoint

Headers = list[tuple[bytes, bytes]]


@dataclass(slots=True)
class RequestContext:
    """One request on its way through the chain; each stage reads it and fills in its part.

    Resources a stage takes (slots, reservations, in-flight counts) are released through
    `on_finish` callbacks, which run exactly once when the request ends on any path.
    """

    request_id: str
    route: str
    upstream_path: str
    client_headers: Headers
    body: bytes
    payload: dict[str, Any]
    model: str
    stream: bool
    started: float = field(default_factory=time.perf_counter)
    endpoint: Endpoint | None = None
    status: int = 0
    outcome: str = "pending"
    committed: bool = False
    responded: bool = False
    client_gone: bool = False
    first_token_at: float | None = None
    usage: dict[str, Any] | None = None
    _finishers: list[Callable[[RequestContext], None]] = field(default_factory=list)

    def on_finish(self, callback: Callable[[RequestContext], None]) -> None:
        self._finishers.append(callback)

    def finish(self) -> None:
        """Run every release callback once, newest first, even if one of them fails."""
        finishers, self._finishers = self._finishers, []
        errors: list[BaseException] = []
        for callback in reversed(finishers):
            try:
                callback(self)
            except Exception as exc:  # a failing release must not skip the others
                errors.append(exc)
        if errors:
            raise errors[0]


class Stage(Protocol):
    """A step of the request chain. It enriches the context or raises a KvgateError to refuse;
    whatever it takes it releases through `ctx.on_finish`."""

    async def __call__(self, ctx: RequestContext) -> None: ...
