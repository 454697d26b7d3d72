"""The timeouts of one request: global config, the tenant tier's overrides, the client's header.

    timeouts (config) ─▶ timeouts.tiers[ctx.tier] ─▶ x-kvgate-timeout-ms,
                                                     x-kvgate-first-token-timeout-ms
                      ─▶ ctx.deadline (set by the request chain), whichever is earliest

A header can only shorten a limit, never raise it beyond the tier's policy. When the client
(header) or the chain (`ctx.deadline`) shortened a limit, running into it says nothing about
the engine, so such timeouts never count as endpoint failures (`client_shortened`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvgate.config import TimeoutsConfig
from kvgate.types import RequestContext


@dataclass(frozen=True, slots=True)
class RequestTimeouts:
    """Seconds, except `deadline`: an absolute `time.perf_counter()` value."""

    connect: float
    first_token: float
    stall: float
    deadline: float
    client_shortened: bool

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()


def resolve_timeouts(ctx: RequestContext, timeouts: TimeoutsConfig) -> RequestTimeouts:
    """The limits for `ctx` (its timeout headers were validated at ingress)."""
    tier = timeouts.tiers.get(ctx.tier) if ctx.tier else None
    connect, first_token = timeouts.connect, timeouts.first_token
    stall, total = timeouts.stall, timeouts.total
    if tier is not None:
        connect = tier.connect or connect
        first_token = tier.first_token or first_token
        stall = tier.stall or stall
        total = tier.total or total
    shortened = False
    asked_total = ctx.options.total_timeout
    if asked_total is not None and asked_total < total:
        total, shortened = asked_total, True
    asked_first = ctx.options.first_token_timeout
    if asked_first is not None and asked_first < first_token:
        first_token, shortened = asked_first, True
    deadline = ctx.started + total
    if ctx.deadline is not None and ctx.deadline < deadline:
        deadline, shortened = ctx.deadline, True
    return RequestTimeouts(connect, first_token, stall, deadline, shortened)
