"""State shared by every pool's router in one process: the prefix index, the hasher, the
session table and the explain setting; and the producer step that matches a prompt once."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.routing.affinity import SessionAffinity, session_key
from kvgate.routing.cache_feedback import CacheFeedback
from kvgate.routing.endpoints import Endpoint
from kvgate.routing.match import PrefixMatch
from kvgate.routing.precise import PreciseRouting
from kvgate.routing.prefix_hasher import PrefixHasher
from kvgate.routing.prefix_index import PrefixIndex
from kvgate.routing.settings import ExplainMode, RoutingConfig
from kvgate.routing.telemetry import EngineTelemetry
from kvgate.types import RequestContext

log = logging.getLogger("kvgate.routing")


@dataclass(slots=True)
class RoutingServices:
    """State shared by every pool's picker in one process: the prefix index, the hasher, the
    session table, and the explain setting."""

    index: PrefixIndex
    hasher: PrefixHasher
    affinity: SessionAffinity
    explain: ExplainMode
    chars_per_token: float
    max_candidates: int = 0
    rng: random.Random = field(default_factory=random.Random)
    # Precise routing from the engines' KV events, when some pool has them (the app sets it).
    precise: PreciseRouting | None = None
    feedback: CacheFeedback = field(init=False)
    # Endpoints chosen in this process (retries' choices included), by (endpoint, policy).
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.feedback = CacheFeedback(self.index, self.hasher.max_blocks)

    @classmethod
    def from_config(
        cls,
        routing: RoutingConfig,
        chars_per_token: float = 4.0,
        make_index: Callable[[int, float, int], PrefixIndex] = PrefixIndex,
    ) -> RoutingServices:
        """`make_index(default_capacity, ttl, max_capacity)` builds the prefix index (a
        shared one when replicas sync through a store); `chars_per_token` is the request
        view's (`classification.chars_per_token`)."""
        prefix = routing.prefix
        return cls(
            index=make_index(prefix.default_capacity, prefix.ttl, prefix.max_capacity),
            hasher=PrefixHasher(prefix.block_chars, prefix.max_blocks),
            affinity=SessionAffinity(routing.affinity_ttl, routing.affinity_max_sessions),
            explain=routing.explain,
            chars_per_token=chars_per_token,
            max_candidates=routing.max_candidates,
        )

    def shortlist(self, ctx: RequestContext, endpoints: list[Endpoint]) -> list[Endpoint]:
        """At most `max_candidates` of a larger pool, so that a decision's cost does not grow
        with the pool: the endpoints holding the deepest part of the prompt (up to three
        quarters of the places, ties from a random starting point), the session's endpoint, then
        the rest from a window of the pool at a random offset, so every endpoint is as likely
        to be considered (the power of d choices: the best of a random 16 is nearly always as
        lightly loaded as the best of all)."""
        limit = self.max_candidates
        if not limit or len(endpoints) <= limit:
            return endpoints
        rng = self.rng
        prefix = ctx.prefix
        keep: list[Endpoint] = []
        if prefix is not None:
            depth = prefix.held_blocks
            if prefix.matched or prefix.exact is not None:
                keep = [e for e in endpoints if depth(e.name)]
            places = limit - limit // 4
            if len(keep) > places:
                turn = rng.randrange(len(keep))
                keep = keep[turn:] + keep[:turn]
                keep.sort(key=lambda e: depth(e.name), reverse=True)  # stable: ties rotate
                del keep[places:]
            if prefix.affinity is not None and all(e.name != prefix.affinity for e in keep):
                keep += [e for e in endpoints if e.name == prefix.affinity][:1]
        start = rng.randrange(len(endpoints))
        wrapped = max(0, start + limit - len(endpoints))
        window = endpoints[start : start + limit] + endpoints[:wrapped]
        if not keep:
            return window
        # A window as large as the places left plus the kept ones has enough others in it.
        kept = set(keep)
        others = [e for e in window if e not in kept]
        return keep + others[: limit - len(keep)]

    def size_index(self, endpoint: Endpoint, telemetry: EngineTelemetry) -> None:
        """Bound an endpoint's index entries by its engine's KV cache, in blocks of text."""
        if telemetry.kv_tokens is not None:
            blocks = telemetry.kv_tokens * self.chars_per_token / self.hasher.block_chars
            self.feedback.engine_size(endpoint.name, max(1, int(blocks)), telemetry.block_size)
        if self.precise is not None:
            self.precise.engine_size(endpoint.name, telemetry)

    def prefix_match(self, ctx: RequestContext) -> PrefixMatch:
        """Hash the request's prompt once, match it against every endpoint and look up its
        session (the producer step; retries and fallback pools reuse it)."""
        session = session_key(ctx)
        hashes = self.hasher.chain(ctx.view.canonical, ctx.model, ctx.cache_salt)
        return PrefixMatch(
            hashes=hashes,
            prompt_tokens=ctx.view.prompt_tokens,
            tokens_per_block=self.hasher.block_chars / self.chars_per_token,
            matched=self.index.match(hashes),
            session=session,
            affinity=self.affinity.get(session) if session is not None else None,
            exact=self.precise.match(ctx) if self.precise is not None else None,
            eviction_touch_of=self.index.eviction_touch,
            room_of=self.index.room,
        )

    def endpoint_recovered(self, endpoint: Endpoint) -> None:
        """`endpoint` passed its health check after failing it: its engine may have restarted,
        and a restarted engine's prefix cache is empty, so the approximate index forgets what
        it held there. Kept, a stale index would send every request with those prefixes to a
        cold cache at once; forgotten, it costs one cold placement per prefix when the engine
        had kept its cache (an outage without a restart). The prefix index is this process's:
        other replicas forget when their own health checks see the outage.

        The precise index is left to the engine's events, and the endpoint is routed
        approximately until its next batch: a restarted engine's publisher starts its
        sequence again, which the subscriber sees as a restart (it clears the index then);
        an engine that only missed health checks kept its cache, and never publishes again
        the blocks it holds, so clearing here would leave the index empty for good."""
        self.index.clear(endpoint.name)
        if self.precise is not None:
            self.precise.engine_back(endpoint.name)
        log.info("endpoint %s is back: its prefix index entries are forgotten", endpoint.name)

    def forget_refused(self, prefix: PrefixMatch, endpoint: str) -> None:
        """The engine at `endpoint` answered the request with an error instead of running it
        (a prompt too long, a bad parameter, an overloaded engine), so it cached nothing of
        it: the blocks the decision recorded there beyond those the endpoint already held
        are forgotten, or the next request with this prompt would be sent there for a hit
        the engine never had. Only this process's index forgets (replicas that took the
        decision's delta correct it from their own answers); a precise endpoint's
        speculative entry expires on its own."""
        held = prefix.matched.get(endpoint, 0)
        if held < prefix.blocks and prefix.hashes:
            self.index.evict(endpoint, (prefix.hashes[held],))
        if self.precise is not None and prefix.exact is not None:
            self.precise.refused(prefix.exact, endpoint)

    def record_precise(self, prefix: PrefixMatch, endpoint: str) -> None:
        """The decision for a request with this match went to `endpoint` (speculative entry
        in the precise index; the endpoint's event stream is now expected to move)."""
        if self.precise is not None and prefix.exact is not None:
            self.precise.decided(prefix.exact, endpoint)

    def explain_allowed(self, ctx: RequestContext) -> bool:
        """`never`; `always` (anyone who sends `x-kvgate-explain: 1`); or `admin`: the auth
        stage found `x-kvgate-explain: 1` with a valid admin key in `x-kvgate-admin-key`
        (or the gateway is open) and set `ctx.explain`."""
        if self.explain == "never":
            return False
        if self.explain == "admin":
            return ctx.explain
        return ctx.options.explain
