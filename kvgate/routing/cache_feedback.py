"""What the engines really had cached, read from every answer and fed back into the index.

Each answer's `usage.prompt_tokens_details.cached_tokens` is the engine's own count of the
prompt tokens it found in its prefix cache: ground truth for the prediction the router made
(`PrefixMatch.matched` of the chosen endpoint). The gateway asks engines for usage on every
stream (`stream_options.include_usage`, stripped again for clients that did not ask), so every
request that reaches an engine teaches the index something.

- The engine had less than predicted: the engine evicted a block the index thought it held.
  Engines evict least recently used blocks first, so everything the index last touched on
  that endpoint at or before that block's time is gone too: it is forgotten at once. The
  index's capacity for the endpoint shrinks to what remains (it held more than the engine
  could keep: engines also spend KV on decoding sequences and on output tokens).
  Unless the block may not have been cached yet: SGLang caches a prefill once it has computed
  it, and vLLM when it schedules it, which a request sent just before may not have reached (a
  longer prompt spends longer in tokenization); so a block that an earlier request was routed
  with less than one prefill before this one (this request's own time from being sent to its
  first token, or to its answer when not streamed, on the same engine at nearly the same
  moment) may simply not have existed yet.
  Such a shortfall is counted (`in_flight`) and forgets nothing: taken as an eviction it would
  forget every entry the endpoint touched before a moment ago, and a burst of one prefix would
  empty the endpoint's index.
- The engine had more than predicted: the index forgot too early; its capacity grows by the
  tokens it missed, never beyond the engine's reported KV size.

The prediction is the share of the prompt the index matched, times the prompt tokens the
engine counted (so the character-based token estimate's own error is not taken for drift).
Differences within a tolerance are not evidence: the engine caches whole blocks of its own
tokens under its chat template, the index blocks of characters, so one engine block, one index
block and the drift target (5% of the prediction) are allowed either way.

Only the span of the prompt the index hashes (its first `max_blocks` blocks) is compared: the
engine holding more of a long prompt than that is not drift. Per endpoint the predicted and
the cached tokens within that span are counted; their gap is the index's drift
(`kvgate_prefix_predicted_tokens_total`, `kvgate_prefix_cached_tokens_total`).

For an endpoint in precise mode (KV events) the precise index's answer confirmed by events is
compared too, exactly: equal to the engine's cached tokens or not
(`kvgate_precise_answers_total{endpoint, outcome}`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kvgate.routing.prefix_index import PrefixIndex
from kvgate.types import RequestContext

# Tokens per engine block when the engine does not report its block size (vLLM's default).
ENGINE_BLOCK_TOKENS = 16
# Differences up to this share of the prediction are estimation noise (the drift target).
DRIFT_TOLERANCE = 0.05


@dataclass(slots=True)
class EndpointDrift:
    """Per endpoint: tokens predicted cached and tokens the engine reported cached, over the
    answers that reported both; answers where the engine had less / more than predicted, and
    shortfalls on blocks that may still have been in prefill (`in_flight`, no correction)."""

    predicted_tokens: int = 0
    cached_tokens: int = 0
    over: int = 0
    under: int = 0
    in_flight: int = 0
    exact_agreed: int = 0
    exact_disagreed: int = 0


def cached_tokens(usage: dict[str, object] | None) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens`, when the engine reported it."""
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


class CacheFeedback:
    """Compares each answer's cached tokens with the prediction and corrects the index."""

    def __init__(self, index: PrefixIndex, min_capacity: int) -> None:
        self.index = index
        self.min_capacity = min_capacity  # one whole prompt: what an engine holds at least
        self.drift: dict[str, EndpointDrift] = {}
        self._kv_blocks: dict[str, int] = {}  # the engine's KV size in index blocks
        self._engine_block_tokens: dict[str, int] = {}

    def engine_size(self, endpoint: str, kv_blocks: int, block_tokens: int | None) -> None:
        """The engine reported its KV size (in index blocks) and block size (tokens): the
        index's capacity for it starts there and never grows beyond it."""
        self._kv_blocks[endpoint] = kv_blocks
        if block_tokens:
            self._engine_block_tokens[endpoint] = block_tokens
        self.index.set_capacity(endpoint, kv_blocks)

    def observe(self, ctx: RequestContext) -> None:
        """Learn from a finished request (called once, at settlement)."""
        prefix, endpoint = ctx.prefix, ctx.endpoint
        if prefix is None or endpoint is None or ctx.resumes or not prefix.blocks:
            return
        cached = cached_tokens(ctx.usage)
        if cached is None or ctx.usage is None:
            return
        prompt = ctx.usage.get("prompt_tokens")
        name = endpoint.name
        drift = self.drift.get(name)
        if drift is None:
            drift = self.drift[name] = EndpointDrift()
        exact = prefix.exact
        if exact is not None and name in exact.confirmed:  # the whole prompt, in engine tokens
            if exact.confirmed[name] == cached:
                drift.exact_agreed += 1
            else:
                drift.exact_disagreed += 1
        per_block = prefix.tokens_per_block
        # The index sees only the prompt's first `max_blocks` blocks: an engine holding more of
        # a long prompt is right, not the index wrong, so only that span is compared.
        covered = min(prefix.prompt_tokens, int(prefix.blocks * per_block))
        predicted = min(covered, int(prefix.matched.get(name, 0) * per_block))
        if isinstance(prompt, int) and prefix.prompt_tokens:
            # The index's share of the prompt, in the engine's own tokens: the character-based
            # estimate's error is not the index's.
            predicted = round(prompt * predicted / prefix.prompt_tokens)
            covered = round(prompt * covered / prefix.prompt_tokens)
        cached = min(cached, covered)
        drift.predicted_tokens += predicted
        drift.cached_tokens += cached
        engine_block = self._engine_block_tokens.get(name, ENGINE_BLOCK_TOKENS)
        tolerance = max(engine_block + per_block, DRIFT_TOLERANCE * predicted)
        if cached + tolerance < predicted:
            touched = prefix.touched.get(name)
            if touched is not None and _maybe_in_prefill(ctx, touched):
                drift.in_flight += 1
                return
            drift.over += 1
            if touched is not None:
                self.index.forget_touched_until(name, touched)
            remaining = self.index.entries(name)
            if remaining < self.index.capacity(name):
                self.index.set_capacity(name, max(self.min_capacity, remaining))
        elif cached > predicted + tolerance:
            drift.under += 1
            grown = self.index.capacity(name) + math.ceil((cached - predicted) / per_block)
            ceiling = self._kv_blocks.get(name, self.index.max_capacity)
            self.index.set_capacity(name, min(ceiling, grown))


def _maybe_in_prefill(ctx: RequestContext, touched: float) -> bool:
    """Whether the block last touched at `touched` (the index's clock) may still have been in
    the prefill of the request that touched it when this request was routed: less than this
    request's own prefill time (sent to first token, or to now for an answer not streamed)
    lay between the two decisions."""
    prefix = ctx.prefix
    if prefix is None or prefix.decided_at is None or ctx.sent_at is None:
        return False
    done = ctx.first_token_at if ctx.first_token_at is not None else time.perf_counter()
    return prefix.decided_at - touched < done - ctx.sent_at
