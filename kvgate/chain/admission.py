"""The `admit` stage: tenant quotas and concurrency, and waiting for capacity under saturation.

In order, for each request:

1. Quotas: reserve one request and `prompt + max_tokens` tokens (`quotas.py`). 429
   `Retry-After` when a bucket is short; the reservation is settled to actual usage (or released
   in full if the request never reached an engine) when the request ends, on every path.
2. Run now when the tenant is below `max_concurrent`, no request of the same or a better class
   waits for the same endpoints, and not every endpoint that could serve it is `saturated`.
3. Otherwise wait (`queues.py`): bounded by the tenant's `max_queued` (429) and by
   `admission.max_queued` overall (503; when full, the worst waiter — lowest class, then lowest
   tier, then latest deadline — is shed to make room for a better newcomer). A wait ends when
   the dispatcher grants it; at its class's `max_queue_wait` or when its deadline can no longer
   be met (503); or at client disconnect, which removes it at once.

Drain (`drain`, on SIGTERM): every waiting request and every request admitted from then on gets
503 `draining` with `Retry-After: 1` at once (another replica can take it); requests already
admitted run on.

The dispatcher is one task owned by the controller. It runs when an admitted request finishes,
when a request is queued, and every `recheck_interval` while anything waits (engine telemetry
changes without any request finishing); it is idle otherwise. Before granting, a waiter whose
remaining deadline is shorter than its predicted time to finish is refused (503): it never
reaches an engine. The prediction is per model, from requests that finished (`predict.py`):
TTFT (dispatch → first event) plus `max_tokens` x the time per output token, each on the slow
side (mean plus `prediction_deviations` mean deviations); a deadline shorter than the TTFT
alone is the issue's rule, the token term keeps work that could only miss its deadline (and be
cut off by the relay) off the engines. After each grant it lets the
granted request run up to its dispatch before testing saturation again, so one free slot is
not handed out twice.

Usage settled for a request: the engine's `usage` when it reported one; for a stream without
it, the estimated prompt tokens plus one token per data event relayed; a non-stream answer
without `usage` is charged its full reservation; a request that produced nothing is charged 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from functools import partial

from kvgate.background import OwnedTask
from kvgate.chain.admission_ports import AdmissionObserver, Capacity, NoObserver
from kvgate.chain.classify import Classifier, output_limit_field
from kvgate.chain.intent import CLASS_RANK, CLASSES_BY_RANK, Intent
from kvgate.chain.predict import DurationPredictor
from kvgate.chain.queues import AdmissionQueue, QueueKey, Waiter
from kvgate.chain.settings import AdmissionConfig
from kvgate.chain.tenants import Tenant
from kvgate.errors import InvalidRequest, Overloaded, RateLimited, retry_after_seconds
from kvgate.state.quotas import QuotaExceeded, QuotaStore, QuotaTooSmall, Reservation
from kvgate.types import RequestContext

log = logging.getLogger("kvgate.admission")

_ALL_CLASSES = range(len(CLASSES_BY_RANK))
_RATE_WINDOW = 64


class _CompletionRate:
    """Requests finished per second over the last 64 completions (for Retry-After)."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=_RATE_WINDOW)

    def tick(self, now: float) -> None:
        self._times.append(now)

    def per_second(self, now: float) -> float:
        if len(self._times) < 2:
            return 1.0
        span = max(now - self._times[0], 1e-3)
        return (len(self._times) - 1) / span


class AdmissionController:
    """Owns tenant concurrency counts, the admission queue and its dispatcher task."""

    def __init__(
        self,
        capacity: Capacity,
        quotas: QuotaStore,
        classifier: Classifier,
        config: AdmissionConfig,
        observer: AdmissionObserver | None = None,
    ) -> None:
        self.capacity = capacity
        self.quotas = quotas
        self.classifier = classifier
        self.config = config
        self.observer: AdmissionObserver = observer or NoObserver()
        self.queue = AdmissionQueue()
        self.active: dict[str, int] = {}
        self.queued: dict[str, int] = {}
        self.predictor = DurationPredictor(
            config.initial_ttft, config.initial_token_time, config.prediction_deviations
        )
        self._rate = _CompletionRate()
        self.draining = False
        self._wake = asyncio.Event()
        self._dispatcher = OwnedTask("admission-dispatcher")

    # --- the stage's entry point ------------------------------------------------------------

    async def admit(self, ctx: RequestContext) -> None:
        tenant, intent = ctx.tenant, ctx.intent
        assert tenant is not None and intent is not None, "auth and classify run first"
        self.check_open()
        reservation = await self._reserve(tenant, intent, output_limit_field(ctx))
        ctx.on_finish(partial(self._settle, reservation))
        pinned = None if ctx.pinned is None else ctx.pinned.name
        key: QueueKey = (ctx.model, ctx.allowed_jurisdictions, pinned)
        rank = CLASS_RANK[intent.latency_class]
        below_cap = self._below_cap(tenant)
        if not self.config.enabled:
            if not below_cap:
                raise self._limited(tenant, "max_concurrent", 1.0)
            self._start(ctx, tenant)
            return
        room = self.capacity.has_capacity(*key)
        if below_cap and room and not self.queue.waiting_at_or_above(key, rank, self._below_cap):
            self._start(ctx, tenant)
            return
        if not room and ctx.pinned is None and self.capacity.rejects_when_saturated(ctx):
            # The policy says a saturated fleet is a refusal, not a wait.
            self.observer.shed(intent.latency_class, "all_endpoints_saturated")
            raise Overloaded(
                f"Every endpoint serving '{ctx.model}' is saturated; retry later",
                code="all_endpoints_saturated",
                retry_after=self._retry_after(),
            )
        await self._wait(ctx, tenant, intent, key, rank)

    def check_open(self) -> None:
        """503 `draining` once the process drains: new requests are refused from then on."""
        if self.draining:
            raise _draining()

    # --- quotas -----------------------------------------------------------------------------

    async def _reserve(self, tenant: Tenant, intent: Intent, limit_field: str) -> Reservation:
        """`limit_field`: the body field that limits the completion (named in a refusal)."""
        try:
            return await self.quotas.reserve(tenant.name, tenant.quota, intent.reserved_tokens)
        except QuotaTooSmall as exc:
            raise InvalidRequest(
                f"This request needs about {exc.needed} tokens (estimated prompt plus "
                f"{limit_field}) but the tenant's tokens_per_minute is {exc.allowance}; lower "
                f"{limit_field} or shorten the prompt",
                param=limit_field,
                code="tokens_exceed_quota",
            ) from None
        except QuotaExceeded as exc:
            raise self._limited(tenant, exc.limit, exc.retry_after) from None

    def _limited(self, tenant: Tenant, limit: str, retry_after: float) -> RateLimited:
        self.observer.quota_rejected(tenant.name, limit)
        return RateLimited(
            f"Rate limit reached for this API key: {limit}; retry after "
            f"{retry_after_seconds(retry_after)} s",
            code=f"{limit}_exceeded",
            retry_after=retry_after,
        )

    def _settle(self, reservation: Reservation, ctx: RequestContext) -> None:
        if ctx.endpoint is None:
            self.quotas.release(reservation)
            used = 0
        else:
            used = _used_tokens(ctx, reservation)
            self.quotas.settle(reservation, used)
        self.observer.settled(reservation.tenant, reservation.tokens, used)

    # --- capacity ---------------------------------------------------------------------------

    def _below_cap(self, tenant: Tenant) -> bool:
        cap = tenant.limits.max_concurrent
        return cap is None or self.active.get(tenant.name, 0) < cap

    def predicted_ttft(self, model: str) -> float:
        return self.predictor.ttft(model)

    def predicted_duration(self, model: str, output_tokens: int) -> float:
        """Seconds from dispatch to the last token of a request for `output_tokens` (on the
        slow side: see `predict.py`)."""
        return self.predictor.duration(model, output_tokens)

    def _start(self, ctx: RequestContext, tenant: Tenant) -> None:
        self.active[tenant.name] = self.active.get(tenant.name, 0) + 1
        ctx.on_finish(partial(self._done, tenant, time.perf_counter()))

    def _done(self, tenant: Tenant, started: float, ctx: RequestContext) -> None:
        self.active[tenant.name] -= 1
        now = time.perf_counter()
        self._rate.tick(now)
        if ctx.first_token_at is not None:
            self.predictor.observe_ttft(ctx.model, ctx.first_token_at - started)
            tokens = _completion_tokens(ctx)
            if tokens > 1 and ctx.outcome == "ok":
                self.predictor.observe_token_time(
                    ctx.model, (now - ctx.first_token_at) / (tokens - 1)
                )
        if len(self.queue):
            self._wake.set()

    # --- waiting ----------------------------------------------------------------------------

    async def _wait(
        self, ctx: RequestContext, tenant: Tenant, intent: Intent, key: QueueKey, rank: int
    ) -> None:
        max_queued = tenant.limits.max_queued
        if max_queued is not None and self.queued.get(tenant.name, 0) >= max_queued:
            raise self._limited(tenant, "max_queued", self._retry_after())
        loop = asyncio.get_running_loop()
        assert ctx.deadline is not None
        boost = 0.0
        if intent.workflow is not None:
            boost = self.config.workflow_step_boost * (intent.workflow.step - 1)
        waiter = Waiter(
            ctx=ctx,
            tenant=tenant,
            key=key,
            rank=rank,
            deadline=ctx.deadline,
            boost=boost,
            enqueued=time.perf_counter(),
            future=loop.create_future(),
            prefill=self._prefill_seconds(ctx),
        )
        wait_until = ctx.deadline - self.predicted_duration(ctx.model, intent.max_tokens)
        if wait_until <= waiter.enqueued:
            raise self._shed(
                waiter, "deadline_unmeetable", "This request cannot start before its deadline"
            )
        # Which limit ends the wait: the deadline (less the predicted run) or the class's.
        deadline_ends_it = True
        max_wait = self.classifier.max_queue_wait(intent.latency_class)
        if max_wait is not None and waiter.enqueued + max_wait < wait_until:
            wait_until, deadline_ends_it = waiter.enqueued + max_wait, False
        self._make_room(waiter)
        self._enqueue(waiter)
        span = None if ctx.trace is None else ctx.trace.span("kvgate.admission.wait")
        try:
            async with asyncio.timeout(max(0.0, wait_until - time.perf_counter())):
                await waiter.future
        except TimeoutError:
            if not waiter.granted:
                self._leave(waiter, "timeout")
                if not self._below_cap(tenant) and self.capacity.has_capacity(*key):
                    # What held it was the tenant's own concurrency, not the fleet: a 429,
                    # as every limit of the tenant's is.
                    raise self._limited(tenant, "max_concurrent", self._retry_after()) from None
                if deadline_ends_it:
                    raise self._shed(
                        waiter,
                        "deadline_unmeetable",
                        "No capacity became free in time for this request to finish by its "
                        "deadline",
                    ) from None
                raise self._shed(
                    waiter,
                    "queue_timeout",
                    "No capacity became free within this request's class's longest wait",
                ) from None
        finally:
            waiter.resumed.set()
            if not waiter.granted:
                self._leave(waiter, "gone")
            if span is not None:
                span.end(None if waiter.granted else "not_admitted")

    def _prefill_seconds(self, ctx: RequestContext) -> float:
        """Predicted prefill time of a waiting request, for shortest-prefill-first ordering."""
        if not self.config.shortest_prefill_first:
            return 0.0
        return self.capacity.uncached_tokens(ctx) / self.config.prefill_tokens_per_second

    def _enqueue(self, waiter: Waiter) -> None:
        self.queue.push(waiter)
        self.queued[waiter.tenant.name] = self.queued.get(waiter.tenant.name, 0) + 1
        self._gauge(waiter.rank)
        self._ensure_dispatcher()
        self._wake.set()

    def _leave(self, waiter: Waiter, result: str) -> bool:
        """Take `waiter` out of the queue once (False if it already left)."""
        if not self.queue.remove(waiter):
            return False
        self._left(waiter, result)
        return True

    def _left(self, waiter: Waiter, result: str) -> None:
        self.queued[waiter.tenant.name] -= 1
        self._gauge(waiter.rank)
        self.observer.waited(
            CLASSES_BY_RANK[waiter.rank], result, time.perf_counter() - waiter.enqueued
        )

    def _make_room(self, newcomer: Waiter) -> None:
        """Enforce `max_queued`: shed the worst waiter if the newcomer is better, else refuse
        the newcomer."""
        if len(self.queue) < self.config.max_queued:
            return
        victim = self.queue.shed_candidate()
        if victim is None or victim.shed_order() <= newcomer.shed_order():
            raise self._shed(newcomer, "queue_full", "The gateway's queues are full")
        self._leave(victim, "shed")
        if not victim.future.done():
            victim.future.set_exception(
                self._shed(
                    victim, "displaced", "Shed from the queue to make room for more urgent work"
                )
            )

    def _shed(self, waiter: Waiter, reason: str, message: str) -> Overloaded:
        self.observer.shed(CLASSES_BY_RANK[waiter.rank], reason)
        return Overloaded(f"{message}; retry later", code=reason, retry_after=self._retry_after())

    def _retry_after(self) -> float:
        now = time.perf_counter()
        return min(60.0, max(1.0, (len(self.queue) + 1) / self._rate.per_second(now)))

    def _gauge(self, rank: int) -> None:
        self.observer.queue_length(CLASSES_BY_RANK[rank], self.queue.length(rank))

    # --- drain ------------------------------------------------------------------------------

    def drain(self) -> None:
        """Refuse every waiting request now and every new one from now on (503 `draining`)."""
        self.draining = True
        for waiter in self.queue.waiters():
            self._leave(waiter, "shed")
            self.observer.shed(CLASSES_BY_RANK[waiter.rank], "draining")
            if not waiter.future.done():
                waiter.future.set_exception(_draining())

    # --- the dispatcher ---------------------------------------------------------------------

    def _ensure_dispatcher(self) -> None:
        self._dispatcher.start(self._run())

    async def stop(self) -> None:
        await self._dispatcher.stop()

    async def _run(self) -> None:
        wake = self._wake
        while True:
            if len(self.queue):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.recheck_interval):
                        await wake.wait()
            else:
                await wake.wait()
            wake.clear()
            try:
                await self._dispatch()
            except Exception:
                log.exception("admission dispatcher failed; waiters keep their deadlines")

    async def _dispatch(self) -> None:
        for key in self.queue.waiting_keys():
            while self.capacity.has_capacity(*key):
                waiter = self.queue.pop_next(key, _ALL_CLASSES, self._below_cap)
                if waiter is None:
                    break
                if waiter.future.done():  # its task is already unwinding
                    self._left(waiter, "gone")
                    continue
                remaining = waiter.deadline - time.perf_counter()
                intent = waiter.ctx.intent
                assert intent is not None
                if remaining < self.predicted_duration(intent.model, intent.max_tokens):
                    self._left(waiter, "shed")
                    waiter.future.set_exception(
                        self._shed(
                            waiter,
                            "deadline_unmeetable",
                            "This request cannot start before its deadline",
                        )
                    )
                    continue
                self._left(waiter, "admitted")
                self._start(waiter.ctx, waiter.tenant)
                waiter.granted = True
                waiter.future.set_result(None)
                await waiter.resumed.wait()
                await asyncio.sleep(0)


def _draining() -> Overloaded:
    return Overloaded(
        "This gateway is shutting down; retry the request", code="draining", retry_after=1
    )


def _completion_tokens(ctx: RequestContext) -> int:
    usage = ctx.usage
    if usage is not None and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return ctx.relayed_events


def _used_tokens(ctx: RequestContext, reservation: Reservation) -> int:
    usage = ctx.usage
    if usage is not None:
        total = usage.get("total_tokens")
        if isinstance(total, int):
            return total
        return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    intent = ctx.intent
    if ctx.relayed_events and intent is not None:
        return intent.prompt_tokens + ctx.relayed_events
    if ctx.status == 200 and not ctx.stream:
        return reservation.tokens
    return 0


class AdmissionStage:
    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller

    async def __call__(self, ctx: RequestContext) -> None:
        await self.controller.admit(ctx)
