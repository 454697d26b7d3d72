"""Forwarding one request to its engines: the `forward` stage's retry and resume policy.

Attempt loop (see docs/resilience.md): the PickStage chose the first endpoint; when an attempt
fails before the commit point with a retriable error (kvgate/upstream/attempts.py) the
forwarder backs off (full jitter) and tries another endpoint from `picker.choose(ctx,
exclude=tried)`, at most `max_attempts` in all, within the request's deadline, while the
pool's retry budget and client-side throttle allow. Each attempt is one `AttemptRelay.run`
(kvgate/upstream/attempt_relay.py), which owns the commit point. A request pinned to the
endpoint that stores its Responses API conversation (`ctx.pinned`) is never retried elsewhere:
no other engine has it.

A failure after the commit point ends the stream with an OpenAI-shaped error event, never with
silence or a fake `[DONE]` — unless the pool opted in to `resume`, in which case the answer
continues on another endpoint in the same stream (kvgate/upstream/resume.py).
"""

from __future__ import annotations

import asyncio

from kvgate.asgi import Send
from kvgate.config import TimeoutsConfig
from kvgate.errors import (
    ClientStalled,
    KvgateError,
    Overloaded,
    UpstreamError,
    UpstreamFailed,
    drop_tracebacks,
)
from kvgate.routing.endpoints import Endpoint
from kvgate.routing.router import EndpointPicker
from kvgate.types import RequestContext
from kvgate.upstream.attempt_relay import AttemptRelay, StreamBroken, Throttled
from kvgate.upstream.attempts import judge
from kvgate.upstream.backoff import full_jitter_delay
from kvgate.upstream.request_timeouts import RequestTimeouts, resolve_timeouts
from kvgate.upstream.resilience import Resilience
from kvgate.upstream.resume import StreamTranscript, continuation_body, resume_eligible
from kvgate.upstream.retry_budget import RetryBudget
from kvgate.upstream.transport import UpstreamTransport
from kvgate.upstream.usage_request import request_usage

_DONE = b"data: [DONE]\n\n"


class Forwarder:
    """Sends `ctx` to `ctx.endpoint` (and, on retriable failures, to others chosen by
    `picker`) and relays the answer to the client through `send`."""

    def __init__(
        self,
        transport: UpstreamTransport,
        timeouts: TimeoutsConfig,
        max_error_body_bytes: int,
        resilience: Resilience,
        picker: EndpointPicker | None = None,
    ) -> None:
        self.timeouts = timeouts
        self.resilience = resilience
        self.picker = picker
        self.relay = AttemptRelay(transport, max_error_body_bytes, resilience)

    async def __call__(self, ctx: RequestContext, send: Send) -> None:
        assert ctx.endpoint is not None
        request_usage(ctx)
        limits = resolve_timeouts(ctx, self.timeouts)
        budget = self.resilience.budgets[ctx.endpoint.pool]
        budget.request_started()
        try:
            await self._forward(ctx, send, limits, budget)
        finally:
            budget.request_finished()

    async def _forward(
        self, ctx: RequestContext, send: Send, limits: RequestTimeouts, budget: RetryBudget
    ) -> None:
        endpoint = ctx.endpoint
        assert endpoint is not None
        pool = endpoint.pool
        transcript = (
            StreamTranscript(ctx)
            if pool in self.resilience.resume_pools and resume_eligible(ctx)
            else None
        )
        tried: list[Endpoint] = []
        last_error: KvgateError | None = None
        holding_retry = False
        try:
            while True:
                try:
                    await self.relay.run(ctx, endpoint, send, limits, transcript)
                    return
                except StreamBroken as broken:
                    tried.append(endpoint)
                    await self._after_break(ctx, send, limits, transcript, tried, broken.error)
                    return
                except Throttled:
                    if last_error is None:
                        throttle = self.resilience.settings.throttle
                        raise Overloaded(
                            "the engines of this pool are failing; kvgate is shedding load "
                            "so they can recover",
                            code="upstream_throttled",
                            retry_after=throttle.retry_after,
                        ) from None
                    self.resilience.observer.retry_denied(pool, "throttle")
                    raise self._final(last_error) from None
                except KvgateError as error:
                    tried.append(endpoint)
                    if isinstance(error, UpstreamError) and self.picker is not None:
                        self.picker.refused(ctx, endpoint)
                    drop_tracebacks(error)  # kept for its fields while the next attempt runs
                    last_error = error
                    if holding_retry:
                        budget.release()
                        holding_retry = False
                    endpoint, holding_retry = await self._next_endpoint(
                        ctx, error, limits, budget, tried
                    )
                    ctx.endpoint = endpoint
        finally:
            if holding_retry:
                budget.release()

    async def _next_endpoint(
        self,
        ctx: RequestContext,
        error: KvgateError,
        limits: RequestTimeouts,
        budget: RetryBudget,
        tried: list[Endpoint],
    ) -> tuple[Endpoint, bool]:
        """The endpoint for the next attempt, after the back-off, and whether the retry holds
        a place in the budget; raises `error` when the policy says to stop. A failure that is
        the endpoint's own while the rest of the pool serves (`Resilience.failure_is_local`)
        is retried even when the budget is spent: the budget stops retry storms on a sick
        pool, not the redirection of requests away from one dead engine."""
        verdict = judge(error, limits.client_shortened)
        # A request pinned to the endpoint storing its response has nowhere else to go.
        if not verdict.retriable or ctx.client_gone or ctx.pinned is not None:
            raise self._final(error)
        pool = tried[0].pool
        settings = self.resilience.settings.retries
        observer = self.resilience.observer

        def stop(reason: str) -> KvgateError:
            observer.retry_denied(pool, reason)
            return self._final(error)

        retry = len(tried)
        if self.picker is None or retry >= settings.max_attempts:
            raise stop("attempts")
        delay = full_jitter_delay(retry, settings.backoff_base, settings.backoff_cap)
        # An engine's Retry-After is that engine's (it is held out of rotation): the retry
        # goes to another, whatever the pause asked for.
        if limits.remaining() <= delay:
            raise stop("deadline")
        held = budget.try_acquire()
        if not held and not (
            verdict.endpoint_failure and self.resilience.failure_is_local(tried[-1])
        ):
            raise stop("budget")
        try:
            endpoint = self.picker.choose(ctx, exclude=tried)
            observer.retry(pool, str(error.code))
            await asyncio.sleep(delay)
        except KvgateError:
            if held:
                budget.release()
            raise stop("no_endpoint") from None
        except BaseException:
            if held:
                budget.release()
            raise
        return endpoint, held

    def _final(self, error: KvgateError) -> KvgateError:
        """The error the client gets: an engine failure tells it when to come back."""
        if (
            isinstance(error, UpstreamFailed)
            and error.retry_after is None
            and error.status in (502, 503, 504)
        ):
            error.retry_after = self.resilience.settings.throttle.retry_after
        return error

    async def _after_break(
        self,
        ctx: RequestContext,
        send: Send,
        limits: RequestTimeouts,
        transcript: StreamTranscript | None,
        tried: list[Endpoint],
        error: KvgateError,
    ) -> None:
        """The stream broke after the commit point: resume it if allowed, else end it with an
        error event (a client that stopped reading gets none: its error goes to the chain,
        which drops the connection)."""
        if isinstance(error, ClientStalled):
            raise error
        observer = self.resilience.observer
        pool = tried[0].pool
        while transcript is not None and ctx.resumes < self.resilience.settings.max_resumes:
            if transcript.finished:  # every token arrived; only the end of stream was lost
                ctx.responded = True
                await send({"type": "http.response.body", "body": _DONE, "more_body": False})
                return
            if error.code == "deadline_exceeded" or limits.remaining() <= 0:
                break  # the request's own deadline: never resumed
            body = continuation_body(ctx, transcript)
            if body is None or self.picker is None:
                break
            try:
                endpoint = self.picker.choose(ctx, exclude=tried)
            except KvgateError:
                break
            ctx.resumes += 1
            transcript.begin_continuation()
            tried.append(endpoint)
            ctx.endpoint = endpoint
            try:
                await self._continue(ctx, endpoint, body, send, limits, transcript)
            except StreamBroken as broken:
                error = broken.error
                continue
            except Throttled:
                break
            except KvgateError as failure:
                drop_tracebacks(failure)  # kept for its fields, as in `_forward`
                error = failure
                continue
            ctx.resume_overhead_tokens = transcript.overhead_tokens
            if transcript.usage is not None:
                ctx.usage = transcript.usage
            observer.resumed(pool, "ok", transcript.overhead_tokens)
            return
        if ctx.resumes:
            observer.resumed(pool, "failed", transcript.overhead_tokens if transcript else 0)
        ctx.outcome = error.outcome
        ctx.responded = True
        last = error.to_stream_event(ctx.route, ctx.relayed_events)
        await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _continue(
        self,
        ctx: RequestContext,
        endpoint: Endpoint,
        body: bytes,
        send: Send,
        limits: RequestTimeouts,
        transcript: StreamTranscript,
    ) -> None:
        """One continuation of a broken stream on `endpoint`; traced as a resume span (whose
        child is the attempt) when tracing is on."""
        if ctx.trace is None:
            await self.relay.run(ctx, endpoint, send, limits, transcript, body)
            return
        span = ctx.trace.span(
            "kvgate.resume",
            {
                "kvgate.resume": ctx.resumes,
                "kvgate.resume.relayed_tokens": transcript.content_events,
            },
        )
        try:
            await self.relay.run(ctx, endpoint, send, limits, transcript, body)
        except StreamBroken as broken:
            span.end(str(broken.error.code))
            raise
        except KvgateError as error:
            span.end(str(error.code))
            raise
        except Throttled:
            span.end("upstream_throttled")
            raise
        else:
            span.end()
        finally:
            span.end("interrupted")  # the client left, a drain ended the request, or a bug
