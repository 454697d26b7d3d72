"""What the picker learns about one request before scoring: computed once, read by scorers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class ExactMatch:
    """What the engines in precise mode hold of the prompt, from their KV events.

    `prompt_tokens` is the engine's own count (the pool's tokenizer); `held[name]` the prompt
    tokens endpoint `name` holds counting speculative entries (recent decisions not yet
    confirmed by events), `confirmed[name]` by its events alone: one entry per endpoint in
    precise mode. `keys[block_size]` is the prompt's block-key chain (to record the decision).
    """

    prompt_tokens: int
    held: dict[str, int]
    confirmed: dict[str, int]
    keys: dict[int, list[int]]


@dataclass(slots=True)
class PrefixMatch:
    """The request's prompt as the prefix index sees it, and how much of it each endpoint
    probably holds. Produced once per request (retries reuse it); scorers only read it.

    `matched[name]` is the number of leading blocks endpoint `name` held when the request was
    first routed (before the decision was recorded), for every endpoint holding at least the
    first block; the others hold none. `session` is the affinity key, if any. Endpoints in
    `exact` (precise mode) are priced by it instead; `matched` stays the approximate index's
    answer, which the cache feedback keeps correcting for when precise mode is lost.
    """

    hashes: Sequence[int]  # a PromptChain: hashed when first needed
    prompt_tokens: int
    tokens_per_block: float
    matched: dict[str, int] = field(default_factory=dict)
    session: str | None = None
    affinity: str | None = None
    # When each endpoint chosen for this request had last touched the deepest block of it
    # that the index thought it held, taken before the decision was recorded (for feedback).
    touched: dict[str, float] = field(default_factory=dict)
    # When the decision was recorded (the index's clock, `time.monotonic()`).
    decided_at: float | None = None
    exact: ExactMatch | None = None
    # len(hashes), kept when `release_prompt` drops the hashes.
    blocks: int = field(init=False)
    # The index's `eviction_touch(endpoint, blocks)`: what recording blocks there pushes out.
    eviction_touch_of: Callable[[str, int], float] | None = None
    # The index's `room(endpoint, blocks)`: what is left free there after recording them.
    room_of: Callable[[str, int], int] | None = None

    def __post_init__(self) -> None:
        self.blocks = len(self.hashes)

    def release_prompt(self) -> None:
        """Drop the prompt's hashes (and the block keys of precise mode): once the request is
        routed for good, only the counts are read (`blocks`, `matched`, the token figures)."""
        self.hashes = ()
        if self.exact is not None:
            self.exact.keys = {}

    def match_ratio(self, endpoint: str) -> float:
        exact = self.exact
        if exact is not None and endpoint in exact.held:
            return exact.held[endpoint] / exact.prompt_tokens if exact.prompt_tokens else 0.0
        if not self.blocks:
            return 0.0
        return self.matched.get(endpoint, 0) / self.blocks

    def held_blocks(self, endpoint: str) -> float:
        """How much of the prompt `endpoint` holds, in the approximate index's blocks."""
        exact = self.exact
        if exact is not None and endpoint in exact.held:
            return exact.held[endpoint] / self.tokens_per_block
        return self.matched.get(endpoint, 0)

    def uncached_by_endpoint(self, endpoints: list[str]) -> list[int]:
        """`uncached_tokens` of each endpoint, in one pass (the scorers' hot path)."""
        prompt, per_block, matched = self.prompt_tokens, self.tokens_per_block, self.matched.get
        exact = self.exact
        if exact is None:
            out = [prompt - int(matched(name, 0) * per_block) for name in endpoints]
        else:
            held, exact_prompt = exact.held, exact.prompt_tokens
            out = [
                exact_prompt - held[name]
                if name in held
                else prompt - int(matched(name, 0) * per_block)
                for name in endpoints
            ]
        return [u if u > 0 else 0 for u in out]

    def uncached_tokens(self, endpoint: str) -> int:
        """Prompt tokens `endpoint` probably does not hold."""
        return self.uncached_by_endpoint([endpoint])[0]

    def eviction_touch(self, endpoint: str) -> float:
        """When the block that placing this prompt's uncached blocks on `endpoint` would
        evict was last touched (-inf when they fit there, or without an index)."""
        if self.eviction_touch_of is None:
            return -math.inf
        return self.eviction_touch_of(endpoint, self._uncached_blocks(endpoint))

    def room(self, endpoint: str) -> int:
        """Blocks `endpoint` would have free after taking this prompt's uncached blocks (0
        without an index)."""
        if self.room_of is None:
            return 0
        return self.room_of(endpoint, self._uncached_blocks(endpoint))

    def _uncached_blocks(self, endpoint: str) -> int:
        return math.ceil(self.uncached_tokens(endpoint) / self.tokens_per_block)
