"""The request chain: where a request is refused, where it waits and where it is sent.

    ingress (app) → [stages: auth → classify → admit → pick] → forward → settle

Stages run in order over one RequestContext; the first that raises a KvgateError stops the
chain, its error goes to the client (before the commit point), and every resource taken so far
is released by `ctx.finish()`. A client disconnect cancels the chain wherever it is;
`end_requests` (the end of a drain) cancels every request in the chain and answers each with
an error: a stream gets it as its last event. The server says that the client left through the
request's `ON_DISCONNECT` hook when it offers one (kvgate's own protocol does); under another
server a task per request watches `receive()` for `http.disconnect`.

With tracing on (`tracing` given), the request gets a trace whose span ends after settling,
so a stream's span ends with the stream; each stage runs inside a step of the trace named
`kvgate.<stage>` (AuthStage: `kvgate.auth`, ModelFallbackStage: `kvgate.model_fallback`),
which the tracing makes a child span or folds into the request's.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

from kvgate.asgi import ABORT, ON_DISCONNECT, Receive, Scope, Send, send_error
from kvgate.errors import ClientStalled, GatewayBug, KvgateError, drop_tracebacks
from kvgate.request_options import ENDPOINT, REQUEST_ID
from kvgate.types import Forward, RequestContext, RequestTrace, Stage

log = logging.getLogger("kvgate.chain")


class Tracing(Protocol):
    """Where request traces come from (kvgate/observability/tracing.py)."""

    def start(self, ctx: RequestContext, stages: tuple[str, ...]) -> RequestTrace | None:
        """The trace of a request that has just entered the chain, whose stages have these
        span names (the chain's, in order); None when it is not traced (not sampled)."""
        ...


class RequestChain:
    def __init__(
        self,
        stages: Sequence[Stage],
        forward: Forward,
        settle: Callable[[RequestContext], None],
        tracing: Tracing | None = None,
    ) -> None:
        self.stages = tuple(stages)
        self.forward = forward
        self.settle = settle
        self.tracing = tracing
        self._span_names = tuple(_span_name(stage) for stage in self.stages)
        self._running: set[asyncio.Task[object]] = set()
        self._ending: KvgateError | None = None

    async def _traced_stages(self, ctx: RequestContext, trace: RequestTrace) -> None:
        """The stages, each one's end noted in `trace` (or, for the one that fails, why)."""
        ends = trace.stage_ends
        for stage in self.stages:
            try:
                await stage(ctx)
            except KvgateError as error:
                trace.stage_failed(str(error.code))
                raise
            except asyncio.CancelledError:
                # The client left, or a drain ended the request.
                trace.stage_failed("interrupted")
                raise
            except Exception:
                trace.stage_failed("internal_error")
                raise
            ends.append(time.perf_counter())

    def end_requests(self, error: KvgateError) -> int:
        """End every request in the chain now with `error` (as the last event of a stream
        already under way, else as the answer); returns how many there were."""
        self._ending = error
        for task in self._running:
            task.cancel()
        return len(self._running)

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        watcher: asyncio.Task[None] | None = None
        if ON_DISCONNECT in scope:
            scope[ON_DISCONNECT] = partial(_client_left, task, ctx)
        else:
            watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, ctx))
        if self.tracing is not None:
            ctx.trace = self.tracing.start(ctx, self._span_names)
        try:
            if ctx.trace is None:
                for stage in self.stages:
                    await stage(ctx)
            else:
                await self._traced_stages(ctx, ctx.trace)
            await self.forward(ctx, send)
            if ctx.outcome == "pending":
                ctx.outcome = "ok"
        except ClientStalled as stalled:
            # Nothing more can reach a client that stopped reading: its connection goes now.
            ctx.outcome = stalled.outcome
            ctx.responded = True
            abort = scope.get(ABORT)
            if abort is not None:
                abort()
        except KvgateError as error:
            drop_tracebacks(error)
            await _answer_error(ctx, send, error)
        except asyncio.CancelledError:
            if ctx.client_gone:
                task.uncancel()
                ctx.outcome = "client_disconnect"
                ctx.status = ctx.status or 499
            elif self._ending is not None:
                task.uncancel()
                await _answer_error(ctx, send, self._ending)
            else:
                raise
        except Exception as bug:
            log.exception("request %s failed inside the gateway", ctx.request_id)
            drop_tracebacks(bug)
            await _answer_error(ctx, send, GatewayBug("internal gateway error"))
        finally:
            self._running.discard(task)
            if watcher is None:
                scope[ON_DISCONNECT] = None
            else:
                watcher.cancel()
            try:
                ctx.finish()
            finally:
                try:
                    self.settle(ctx)
                finally:
                    if ctx.trace is not None:
                        # Unlinked from the context (which may wait for the cyclic collector),
                        # the trace and its spans are freed as soon as it is finished.
                        trace, ctx.trace = ctx.trace, None
                        trace.finish()


def _span_name(stage: Stage) -> str:
    """`kvgate.` and the stage's class name in snake case, without `Stage`."""
    words = re.findall(r"[A-Z][a-z0-9]*", type(stage).__name__.removesuffix("Stage"))
    return "kvgate." + "_".join(w.lower() for w in words)


async def _answer_error(ctx: RequestContext, send: Send, error: KvgateError) -> None:
    ctx.outcome = error.outcome
    if ctx.responded:
        return
    ctx.responded = True
    if ctx.committed:
        last = error.to_stream_event(ctx.route, ctx.relayed_events)
        await send({"type": "http.response.body", "body": last, "more_body": False})
        return
    ctx.status = error.status
    headers = [(REQUEST_ID, ctx.request_id.encode())]
    if ctx.attempts and ctx.endpoint is not None:  # the engine that answered, or failed
        headers.append((ENDPOINT, ctx.endpoint.name.encode()))
    await send_error(send, error, headers)


async def _watch_disconnect(
    receive: Receive, task: asyncio.Task[None], ctx: RequestContext
) -> None:
    """Under a server without the `ON_DISCONNECT` hook: wait for `http.disconnect`."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            _client_left(task, ctx)
            return


def _client_left(task: asyncio.Task[None], ctx: RequestContext) -> None:
    """Cancel the request's task when its client goes away before the answer is complete."""
    if not ctx.responded:
        ctx.client_gone = True
        task.cancel()
