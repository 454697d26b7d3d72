"""Precise routing: one KV-event subscriber per configured endpoint, feeding the precise index,
and the per-request answer the router prices endpoints in precise mode with.

An endpoint is in precise mode while its subscriber is (`KvEventSubscriber.mode`: every batch
since a known-empty cache applied in order, stream not stalled) and its index entries did not
outgrow the engine's KV size; otherwise it is routed on the approximate index, which is kept
up to date for every endpoint all along, so a fallback starts warm. Every change of mode is
logged. A stall counts only while the endpoint serves traffic that fills blocks: a decision
that sends it at least one uncached block starts the subscriber's stall clock
(`routing.scrape_interval` times `stale_after_intervals`, 3).

Requests carrying a tenant's `cache_salt` are matched approximately: KV events carry token ids
but not the salt, so the precise index cannot tell tenants' blocks apart.

A pool tokenizer that encodes without the GIL (`off_loop`: Hugging Face `tokenizers`) runs on
a worker thread of its own, before admission (`TokenizeStage`): a long prompt nobody has sent
before takes milliseconds to encode, and on the event loop that would hold up every other
request's relay for as long. The ids stay on the request for admission and the pick.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq.asyncio

from kvgate.config import Config
from kvgate.routing.endpoints import Fleet
from kvgate.routing.kv_events import (
    APPROXIMATE,
    PRECISE,
    BlockRemoved,
    BlockStored,
    KvEventSubscriber,
    SubscriberCounters,
)
from kvgate.routing.match import ExactMatch
from kvgate.routing.precise_index import PreciseIndex, block_keys
from kvgate.routing.prompt_tokens import PromptTokenizer, load_tokenizers
from kvgate.routing.settings import EndpointKvEventsConfig, TokenizerConfig
from kvgate.routing.telemetry import EngineTelemetry
from kvgate.types import RequestContext

log = logging.getLogger("kvgate.routing")

OVERFLOWED = "index_overflow"
NOT_STARTED = "starting"
# The routes a prompt tokenizer reproduces (kvgate/routing/prompt_tokens.py).
TOKENIZED_ROUTES = frozenset({"chat", "completions", "responses"})


@dataclass(slots=True, eq=False)
class _Source:
    """One endpoint whose engine publishes KV events."""

    name: str
    events: EndpointKvEventsConfig
    tokenizer: TokenizerConfig
    subscriber: KvEventSubscriber | None = None


class PreciseRouting:
    """Subscribers, precise index and tokenizers of every pool configured for KV events.

    Raises ConfigError when a pool's tokenizer cannot be loaded. `start()` / `stop()` run the
    subscribers (the app's lifespan). `match(ctx)` is the producer step's precise part;
    `decided` records a decision; `mode(endpoint)` is what the operator surfaces read
    (`/readyz`, metrics, the admin endpoint list).
    """

    def __init__(
        self,
        fleet: Fleet,
        config: Config,
        *,
        speculative_ttl: float | None = None,
    ) -> None:
        routing = config.routing
        self.fleet = fleet
        self.stall_after = routing.scrape_interval * routing.stale_after_intervals
        self.index = PreciseIndex(
            routing.prefix.max_capacity,
            self.stall_after if speculative_ttl is None else speculative_ttl,
        )
        self._tokenizers = load_tokenizers(config)
        self._sources: dict[str, _Source] = {}
        # Per pool: the endpoints with KV events whose engines see the same token ids (pools
        # with an equal tokenizer config), the ones a request homed there is matched on.
        self._peers: dict[str, list[str]] = {}
        for pool_config, pool in zip(config.pools, fleet.pools, strict=True):
            if pool.name not in self._tokenizers:
                continue
            for endpoint_config, endpoint in zip(
                pool_config.endpoints, pool.endpoints, strict=True
            ):
                events = pool_config.kv_events_of(endpoint_config)
                if events is None:
                    continue
                self._sources[endpoint.name] = _Source(endpoint.name, events, pool_config.tokenizer)
                self.index.add_endpoint(endpoint.name, pool_config.tokenizer.block_size)
        for pool_config in config.pools:
            self._peers[pool_config.name] = [
                name
                for name, source in self._sources.items()
                if source.tokenizer == pool_config.tokenizer
            ]
        self._context: zmq.asyncio.Context | None = None
        self._encoder: ThreadPoolExecutor | None = None  # for `off_loop` tokenizers

    @property
    def configured(self) -> bool:
        """Whether any endpoint publishes KV events."""
        return bool(self._sources)

    @property
    def endpoints(self) -> list[str]:
        """The endpoints with KV events configured."""
        return list(self._sources)

    # --- lifespan ----------------------------------------------------------------------

    def start(self) -> None:
        """Start one subscriber per configured endpoint on the running loop."""
        if not self._sources:
            return
        self._context = zmq.asyncio.Context()
        for source in self._sources.values():
            source.subscriber = KvEventSubscriber(
                source.name,
                source.events.url,
                self,
                topic=source.events.topic,
                replay_url=source.events.replay_url,
                stall_after=self.stall_after,
                context=self._context,
            )
            source.subscriber.start()

    async def stop(self) -> None:
        for source in self._sources.values():
            if source.subscriber is not None:
                await source.subscriber.stop()
                source.subscriber = None
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._encoder is not None:
            self._encoder.shutdown(wait=False, cancel_futures=True)
            self._encoder = None

    # --- modes -------------------------------------------------------------------------

    def mode(self, endpoint: str) -> tuple[str, str] | None:
        """(`precise` | `approximate`, reason) for an endpoint with KV events configured;
        None for the others (they are routed approximately by configuration)."""
        source = self._sources.get(endpoint)
        if source is None:
            return None
        subscriber = source.subscriber
        if subscriber is None:
            return APPROXIMATE, NOT_STARTED
        if subscriber.mode == PRECISE and self.index.overflowed(endpoint):
            return APPROXIMATE, OVERFLOWED
        return subscriber.mode, subscriber.reason

    def approximate_endpoints(self) -> list[str]:
        """Endpoints configured for KV events that are routed approximately now."""
        return [name for name in self._sources if not self._precise(name)]

    def counters(self, endpoint: str) -> SubscriberCounters | None:
        """The subscriber's counters (None before it started)."""
        source = self._sources.get(endpoint)
        subscriber = source.subscriber if source is not None else None
        return subscriber.counters if subscriber is not None else None

    def _precise(self, endpoint: str) -> bool:
        source = self._sources[endpoint]
        subscriber = source.subscriber
        return (
            subscriber is not None
            and subscriber.mode == PRECISE
            and not self.index.overflowed(endpoint)
        )

    # --- KvEventSink (the subscribers call these in each engine's order) ---------------

    def stored(self, endpoint: str, event: BlockStored) -> None:
        was = self.index.overflowed(endpoint)
        self.index.stored(endpoint, event)
        if not was and self.index.overflowed(endpoint):
            log.warning(
                "kv events %s: approximate (%s: more blocks than the engine holds)",
                endpoint,
                OVERFLOWED,
            )

    def removed(self, endpoint: str, event: BlockRemoved) -> None:
        self.index.removed(endpoint, event)

    def cleared(self, endpoint: str) -> None:
        was = self.index.overflowed(endpoint)
        self.index.cleared(endpoint)
        if was:
            log.info("kv events %s: index cleared with the engine's cache", endpoint)

    # --- routing -----------------------------------------------------------------------

    def engine_size(self, endpoint: str, telemetry: EngineTelemetry) -> None:
        """The engine's reported KV size bounds its entries (and gives its block size)."""
        if endpoint in self._sources and telemetry.num_blocks is not None:
            self.index.set_engine_size(endpoint, telemetry.num_blocks, telemetry.block_size)

    def _tokenizer_for(self, ctx: RequestContext) -> tuple[str, PromptTokenizer] | None:
        """The request's pool and its tokenizer, when the request is routed precisely."""
        if ctx.cache_salt is not None:
            return None
        pool = self.fleet.home_pool(ctx.model)
        tokenizer = self._tokenizers.get(pool) if pool is not None else None
        return None if pool is None or tokenizer is None else (pool, tokenizer)

    async def tokenize(self, ctx: RequestContext) -> None:
        """Encode the request's prompt on the worker thread when its pool's tokenizer runs
        off the event loop (`ctx.prompt_ids`); otherwise `match` encodes it inline."""
        found = self._tokenizer_for(ctx)
        if found is None or ctx.route not in TOKENIZED_ROUTES:
            return
        _, tokenizer = found
        if not tokenizer.off_loop:
            return
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(1, thread_name_prefix="kvgate-tokenize")
        ids = await asyncio.get_running_loop().run_in_executor(
            self._encoder, tokenizer.prompt_ids, ctx.route, ctx.payload
        )
        ctx.prompt_ids = (ids,)

    def match(self, ctx: RequestContext) -> ExactMatch | None:
        """What every endpoint in precise mode holds of the request's prompt (None when the
        request is not routed precisely: no tokenizer for its pool, a salted tenant, a
        prompt the tokenizer cannot reproduce)."""
        found = self._tokenizer_for(ctx)
        if found is None:
            return None
        pool, tokenizer = found
        if ctx.prompt_ids is not None:
            ids = ctx.prompt_ids[0]
        else:
            ids = tokenizer.prompt_ids(ctx.route, ctx.payload)
        if ids is None:
            return None
        by_size: dict[int, list[str]] = {}
        for name in self._peers[pool]:
            if self._precise(name):
                by_size.setdefault(self.index.block_size(name), []).append(name)
        held: dict[str, int] = {}
        confirmed: dict[str, int] = {}
        keys: dict[int, list[int]] = {}
        for size, names in by_size.items():
            # A fully cached prompt still computes its last token: at most this many hit.
            chain = keys[size] = block_keys(ids, size, (len(ids) - 1) // size)
            both, events_only = self.index.match(chain, names)
            for name in names:
                held[name] = both[name] * size
                confirmed[name] = events_only[name] * size
        return ExactMatch(len(ids), held, confirmed, keys)

    def decided(self, exact: ExactMatch, endpoint: str) -> None:
        """The request went to `endpoint`: its blocks are a speculative entry there, and,
        when it fills at least one block, the endpoint's events are expected to move."""
        if endpoint not in exact.held:
            return
        size = self.index.block_size(endpoint)
        chain = exact.keys.get(size)
        if chain is None:
            return
        self.index.speculate(endpoint, chain[exact.confirmed[endpoint] // size :])
        subscriber = self._sources[endpoint].subscriber
        if subscriber is not None and _fills_a_block(exact, endpoint, size):
            subscriber.note_traffic()

    def engine_back(self, endpoint: str) -> None:
        """`endpoint` passed its health checks again after failing them: approximate until
        its next batch says whether its engine restarted (`KvEventSubscriber.engine_back`)."""
        source = self._sources.get(endpoint)
        if source is not None and source.subscriber is not None:
            source.subscriber.engine_back()

    def refused(self, exact: ExactMatch, endpoint: str) -> None:
        """The engine refused the request `decided` sent to `endpoint` (it stores nothing):
        its events owe nothing for it, so its silence is no stall."""
        if endpoint not in exact.held:
            return
        subscriber = self._sources[endpoint].subscriber
        size = self.index.block_size(endpoint)
        if subscriber is not None and _fills_a_block(exact, endpoint, size):
            subscriber.traffic_refused()


def _fills_a_block(exact: ExactMatch, endpoint: str, size: int) -> bool:
    """Whether the request `exact` describes makes `endpoint`'s engine store at least one
    block (so its events owe a batch for it)."""
    return exact.prompt_tokens - exact.held[endpoint] >= size


class TokenizeStage:
    """Before admission: the prompt's token ids for precise routing, encoded off the event
    loop when the pool's tokenizer allows it (`PreciseRouting.tokenize`)."""

    def __init__(self, precise: PreciseRouting) -> None:
        self.precise = precise

    async def __call__(self, ctx: RequestContext) -> None:
        if ctx.pinned is None:  # a pinned continuation is not routed
            await self.precise.tokenize(ctx)
