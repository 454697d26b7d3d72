"""What admission needs from the layers around it, as small protocols: the fleet's capacity
(routing implements it) and an observer for what happens in the queues (the metrics)."""

from __future__ import annotations

from typing import Protocol

from kvgate.types import RequestContext


class Capacity(Protocol):
    """What admission asks the fleet (routing implements it)."""

    def has_capacity(
        self, model: str, jurisdictions: frozenset[str] | None, pinned: str | None
    ) -> bool:
        """False only when every routable endpoint that could serve the model (in the
        jurisdictions, if given) is saturated, or, for a request `pinned` to one endpoint
        (by name), when that one is; True when none could (picking then answers 404 or
        503)."""
        ...

    def rejects_when_saturated(self, ctx: RequestContext) -> bool:
        """Whether `ctx`'s routing policy answers 503 `all_endpoints_saturated` rather than
        have the request wait when every endpoint is saturated (`when_saturated: reject`)."""
        ...

    def uncached_tokens(self, ctx: RequestContext) -> int:
        """The prompt tokens the best-placed endpoint would have to prefill for `ctx` (asked
        only for requests that wait)."""
        ...


class AdmissionObserver(Protocol):
    """What admission reports (Prometheus metrics in the gateway)."""

    def quota_rejected(self, tenant: str, limit: str) -> None:
        """A request was refused by a tenant limit (429)."""

    def shed(self, latency_class: str, reason: str) -> None:
        """A request was refused for overload (503)."""

    def waited(self, latency_class: str, result: str, seconds: float) -> None:
        """A wait in the queue ended: admitted, timeout, shed or gone."""

    def queue_length(self, latency_class: str, length: int) -> None:
        """The number of requests of a class waiting changed."""

    def settled(self, tenant: str, reserved: int, used: int) -> None:
        """A request ended: it had reserved `reserved` tokens of its tenant's quota and was
        charged `used` (0 when it never reached an engine)."""


class NoObserver:
    """Reports nowhere (admission without metrics, as in unit tests)."""

    def quota_rejected(self, tenant: str, limit: str) -> None:
        pass

    def shed(self, latency_class: str, reason: str) -> None:
        pass

    def waited(self, latency_class: str, result: str, seconds: float) -> None:
        pass

    def queue_length(self, latency_class: str, length: int) -> None:
        pass

    def settled(self, tenant: str, reserved: int, used: int) -> None:
        pass
