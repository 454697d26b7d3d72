"""The engine core: continuous batching over a paged KV cache with prefix caching.

Each step takes the running requests (decodes and unfinished chunked prefills) first, then
admits waiting requests while the token budget, `max_num_seqs` and free KV blocks allow,
like vLLM's scheduler. The vLLM flavour caches a request's full blocks when it is scheduled,
as vLLM V1 does (`allocate_slots` caches the blocks of the tokens the step will compute), so
a request scheduled after another with the same prefix hits it even while that prefix is
still being prefilled, in the same step or a later one; the SGLang flavour caches them when
the step that computed them ends, as SGLang inserts into its radix tree after a prefill.
When a running request needs a block and none is free, the lowest-priority (for FCFS:
newest) running request is preempted: its blocks are freed and it goes back to the waiting
queue to be recomputed. A step then "runs" for
    (step_seconds + prefill tokens x prefill_token_seconds + decodes x decode_seq_seconds)
    / speed
and every request whose computed tokens caught up samples its next token. With a KV-event
publisher, the blocks the step cached or evicted are published as one batch at its end.

Immediate profiles (`fast`) bypass the queue: a request is served in full inside `submit`,
still going through prefix matching so cached-token counts and metrics stay truthful.
"""

import asyncio
import bisect
import contextlib

from .kv_cache import BlockPool, extend_block_hashes
from .kv_event_publisher import KvEventFault, KvEventPublisher
from .options import EngineOptions
from .sequence import GenerationRequest
from .stats import EngineCounters
from .textgen import TAIL_CHARS, TextGenerator

ABORTED = "abort"


class EngineCore:
    """Owns the KV pool, the waiting and running queues and the step loop of one engine."""

    def __init__(
        self,
        options: EngineOptions,
        counters: EngineCounters,
        kv_events: KvEventPublisher | None = None,
    ) -> None:
        self._options = options
        self._timing = options.timing
        self._counters = counters
        self._generator = TextGenerator(options.seed)
        self._block_size = options.block_size
        self._kv_events = kv_events
        self._cache_when_scheduled = options.flavor == "vllm"
        self.pool = BlockPool(options.kv_blocks, options.block_size, kv_events)
        self.waiting: list[GenerationRequest] = []
        self.running: list[GenerationRequest] = []
        self._work_arrived = asyncio.Event()
        self._step_loop: asyncio.Task[None] | None = None

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop on the running event loop (no-op for immediate profiles)."""
        if not self._timing.immediate and self._step_loop is None:
            self._step_loop = asyncio.get_running_loop().create_task(self._run_steps())

    async def close(self) -> None:
        """Stop the step loop and finish every queued or running request as aborted."""
        if self._step_loop is not None:
            self._step_loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._step_loop
            self._step_loop = None
        for request in [*self.running, *self.waiting]:
            self._finish(request, ABORTED)
        self.running.clear()
        self.waiting.clear()

    # --- requests --------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        """Queue `request` (or, for immediate profiles, serve it to completion now)."""
        if self._timing.immediate:
            self._serve_immediately(request)
            self._publish_kv_events()
            return
        bisect.insort(self.waiting, request, key=lambda queued: queued.schedule_key)
        self._work_arrived.set()

    def abort(self, request: GenerationRequest, *, by_client: bool = True) -> None:
        """Drop an unfinished request and free its blocks; `by_client` counts it as aborted
        by a client disconnect (injected crashes are not)."""
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
            self._free_blocks(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if by_client:
            self._counters.requests_aborted += 1
        self._finish(request, ABORTED)
        self._work_arrived.set()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (published as `AllBlocksCleared`)."""
        self.pool.reset_prefix_cache()
        self._publish_kv_events()

    def set_kv_event_fault(self, fault: KvEventFault | None) -> None:
        """Set or clear (None) an event-stream fault; `restart` acts at once, as a restarted
        engine would look to subscribers: empty cache, new salt, sequence from 0."""
        assert self._kv_events is not None, "kv events are off"
        if fault is not None and fault.mode == "restart":
            self.pool.reset_prefix_cache()
            self._kv_events.restart()
        else:
            self._kv_events.fault = fault

    def _publish_kv_events(self) -> None:
        if self._kv_events is not None:
            self._kv_events.flush()

    @property
    def num_used_tokens(self) -> int:
        """Token slots held by requests (blocks in use x block size)."""
        return (self.pool.num_blocks - self.pool.num_free) * self._block_size

    # --- the step loop ---------------------------------------------------------------

    async def _run_steps(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.running and not self.waiting:
                self._work_arrived.clear()
                await self._work_arrived.wait()
                continue
            started = loop.time()
            batch = self._schedule()
            if not batch:
                # Everything running was preempted; admission resumes next step. If nothing
                # runs at all, only a new arrival or an abort can change the picture.
                self._publish_kv_events()  # evictions made before the preemptions
                self._work_arrived.clear()
                if self.running:
                    await asyncio.sleep(0)
                else:
                    await self._work_arrived.wait()
                continue
            planned = self._step_seconds(batch)
            await asyncio.sleep(max(0.0, started + planned - loop.time()))
            now = loop.time()
            self._attribute_step(batch, now - started - planned)
            self._complete_step(batch, now)
            self._publish_kv_events()

    @staticmethod
    def _step_work(batch: list[tuple[GenerationRequest, int]]) -> tuple[int, int]:
        """(prefill tokens, decoding sequences) of a step: a request computing one token
        decodes."""
        prefill_tokens = sum(count for _, count in batch if count > 1)
        return prefill_tokens, sum(1 for _, count in batch if count == 1)

    def _step_seconds(self, batch: list[tuple[GenerationRequest, int]]) -> float:
        timing = self._timing
        prefill_tokens, decodes = self._step_work(batch)
        seconds = (
            timing.step_seconds
            + prefill_tokens * timing.prefill_token_seconds
            + decodes * timing.decode_seq_seconds
        )
        return seconds / self._options.speed

    def _attribute_step(self, batch: list[tuple[GenerationRequest, int]], overrun: float) -> None:
        """Add a step's cost, by part, to each request in it still before its first token."""
        timing, speed = self._timing, self._options.speed
        prefill_tokens, decodes = self._step_work(batch)
        for request, count in batch:
            if request.first_token_at is not None:
                continue
            own = count if count > 1 else 0
            parts = request.first_token_time
            parts.step_base += timing.step_seconds / speed
            parts.own_prefill += own * timing.prefill_token_seconds / speed
            parts.shared_prefill += (prefill_tokens - own) * timing.prefill_token_seconds / speed
            parts.decodes += decodes * timing.decode_seq_seconds / speed
            parts.overrun += overrun

    def _schedule(self) -> list[tuple[GenerationRequest, int]]:
        """Pick this step's work: `(request, tokens to compute)` pairs."""
        budget = self._options.max_num_batched_tokens
        batch: dict[GenerationRequest, int] = {}
        preempted = False
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            count = min(len(request.all_tokens) - request.num_computed, budget)
            while not self._grow(request, request.num_computed + count):
                victim = max(self.running, key=lambda running: running.schedule_key)
                budget += batch.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                batch[request] = count
                budget -= count
                self._scheduled(request, count)
        if not preempted:
            budget = self._admit_waiting(batch, budget)
        return list(batch.items())

    def _admit_waiting(self, batch: dict[GenerationRequest, int], budget: int) -> int:
        size = self._block_size
        while self.waiting and budget > 0 and len(self.running) < self._options.max_num_seqs:
            request = self.waiting[0]
            total = len(request.all_tokens)
            extend_block_hashes(
                request.block_hashes, request.all_tokens, total, size, request.params.cache_salt
            )
            # At least one token is always computed, so a fully cached prompt hits one
            # block less than it holds, as in vLLM.
            hit = self.pool.cached_prefix(request.block_hashes[: (total - 1) // size])
            computed = len(hit) * size
            count = min(total - computed, budget)
            needed = -(-(computed + count) // size) - len(hit)
            if self.pool.num_free_besides(hit) < needed:
                break
            self.pool.reference(hit)
            new_blocks = self.pool.allocate(needed)
            assert new_blocks is not None  # checked just above
            request.blocks = hit + new_blocks
            request.num_computed = computed
            request.num_registered_blocks = len(hit)
            self._count_prefix_lookup(request, computed)
            self.waiting.pop(0)
            self.running.append(request)
            batch[request] = count
            budget -= count
            self._scheduled(request, count)
        return budget

    def _scheduled(self, request: GenerationRequest, count: int) -> None:
        """`count` more tokens of `request` run in this step: with vLLM's caching, its full
        blocks up to them are cached now."""
        if self._cache_when_scheduled:
            self._register_full_blocks(request, request.num_computed + count)

    def _grow(self, request: GenerationRequest, num_tokens: int) -> bool:
        needed = -(-num_tokens // self._block_size) - len(request.blocks)
        if needed <= 0:
            return True
        blocks = self.pool.allocate(needed)
        if blocks is None:
            return False
        request.blocks.extend(blocks)
        return True

    def _preempt(self, request: GenerationRequest) -> None:
        self.running.remove(request)
        self._free_blocks(request)
        bisect.insort(self.waiting, request, key=lambda queued: queued.schedule_key)
        self._counters.preemptions += 1

    def _complete_step(self, batch: list[tuple[GenerationRequest, int]], now: float) -> None:
        for request, count in batch:
            if request.finished:  # aborted while the step ran
                continue
            request.num_computed += count
            self._register_full_blocks(request, request.num_computed)
            if request.num_computed == len(request.all_tokens):
                self._sample(request, now)
                if request.finished:
                    self.running.remove(request)
                    self._free_blocks(request)

    # --- immediate serving -----------------------------------------------------------

    def _serve_immediately(self, request: GenerationRequest) -> None:
        size = self._block_size
        total = len(request.all_tokens)
        extend_block_hashes(
            request.block_hashes, request.all_tokens, total, size, request.params.cache_salt
        )
        hit = self.pool.cached_prefix(request.block_hashes[: (total - 1) // size])
        self._count_prefix_lookup(request, len(hit) * size)
        now = asyncio.get_running_loop().time()
        while not request.finished:
            self._sample(request, now)
        # Leave the request's full blocks in the cache as if it had just released them.
        self.pool.reference(hit)
        needed = -(-len(request.all_tokens) // size) - len(hit)
        request.blocks = hit + (self.pool.allocate(needed) or [])
        request.num_registered_blocks = len(hit)
        request.num_computed = min(len(request.all_tokens), len(request.blocks) * size)
        self._register_full_blocks(request, request.num_computed)
        self._free_blocks(request)

    # --- shared bookkeeping ----------------------------------------------------------

    def _count_prefix_lookup(self, request: GenerationRequest, hit_tokens: int) -> None:
        self._counters.prefix_queries += len(request.all_tokens)
        self._counters.prefix_hits += hit_tokens
        if request.cached_tokens is None:
            request.cached_tokens = hit_tokens

    def _register_full_blocks(self, request: GenerationRequest, tokens: int) -> None:
        """Cache the full blocks of `request`'s first `tokens` tokens not cached yet."""
        full = tokens // self._block_size
        if full <= request.num_registered_blocks:
            return
        extend_block_hashes(
            request.block_hashes,
            request.all_tokens,
            tokens,
            self._block_size,
            request.params.cache_salt,
        )
        first = request.num_registered_blocks
        cached = [
            index
            for index in range(first, full)
            if self.pool.register(request.blocks[index], request.block_hashes[index])
        ]
        request.num_registered_blocks = full
        if self._kv_events is not None and cached:
            self._record_stored(request, cached)

    def _record_stored(self, request: GenerationRequest, cached: list[int]) -> None:
        """One `BlockStored` per run of consecutive newly cached blocks (a block another
        already caches is skipped, so its successor starts a new run)."""
        assert self._kv_events is not None
        size = self._block_size
        hashes = request.block_hashes
        start = 0
        for position in range(1, len(cached) + 1):
            if position < len(cached) and cached[position] == cached[position - 1] + 1:
                continue
            first, last = cached[start], cached[position - 1]
            self._kv_events.stored(
                hashes[first : last + 1],
                hashes[first - 1] if first else None,
                request.all_tokens[first * size : (last + 1) * size],
            )
            start = position

    def _free_blocks(self, request: GenerationRequest) -> None:
        self.pool.release(request.blocks)
        request.blocks = []
        request.num_computed = 0
        request.num_registered_blocks = 0

    def _sample(self, request: GenerationRequest, now: float) -> None:
        """Append the next token to `request` and decide whether it finished."""
        token, ends = self._generator.next_token(request.tail)
        request.tail = (request.tail + token)[-TAIL_CHARS:]
        request.all_tokens.append(token)
        request.output_tokens.append(token)
        request.output_chars += len(token)
        counters = self._counters
        counters.generation_tokens += 1
        if request.first_token_at is None:
            request.first_token_at = now
            counters.prompt_tokens += len(request.prompt_tokens)
            counters.time_to_first_token.observe(now - request.arrival)
            counters.first_tokens.append(_first_token_record(request))
        else:
            assert request.last_token_at is not None
            counters.inter_token_latency.observe(now - request.last_token_at)
        request.last_token_at = now
        params = request.params
        if (params.stop and self._hit_stop_string(request)) or (ends and not params.ignore_eos):
            self._finish(request, "stop")
        elif (
            len(request.output_tokens) >= params.max_tokens
            or len(request.all_tokens) >= self._options.context_length
        ):
            self._finish(request, "length")
        else:
            request.notify()

    def _hit_stop_string(self, request: GenerationRequest) -> bool:
        """Look for a stop string ending in the newest token; on a hit, cut the text before it."""
        stops = request.params.stop
        tokens = request.output_tokens
        wanted = max(map(len, stops)) + len(tokens[-1]) - 1
        pieces: list[str] = []
        length = 0
        for token in reversed(tokens):
            pieces.append(token)
            length += len(token)
            if length >= wanted:
                break
        window = "".join(reversed(pieces))
        hits = [(index, stop) for stop in stops if (index := window.find(stop)) != -1]
        if not hits:
            return False
        index, stop = min(hits)
        request.text_limit = request.output_chars - len(window) + index
        request.stop_reason = stop
        return True

    def _finish(self, request: GenerationRequest, reason: str) -> None:
        request.finish_reason = reason
        if reason != ABORTED:
            self._counters.requests_completed += 1
            if request.last_token_at is not None:
                self._counters.e2e_latency.observe(request.last_token_at - request.arrival)
        request.notify()


def _first_token_record(request: GenerationRequest) -> tuple[object, ...]:
    """What /sim/first-tokens says of one request (FIRST_TOKEN_FIELDS): its time to first
    token in the engine, its prompt and hit, and where that time went (`waiting`: outside any
    step)."""
    assert request.first_token_at is not None
    ttft = request.first_token_at - request.arrival
    parts = request.first_token_time
    return (
        request.request_id,
        ttft,
        len(request.prompt_tokens),
        request.cached_tokens or 0,
        ttft - parts.total(),
        parts.step_base,
        parts.own_prefill,
        parts.shared_prefill,
        parts.decodes,
        parts.overrun,
    )
