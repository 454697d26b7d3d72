"""The request chain: where a request is refused, where it waits and where it is sent.

    ingress (app) → [stages: auth → classify → admit → pick] → forward → settle

Stages run in order over one RequestContext; the first that raises a KvgateError stops the
chain, its error goes to the client (before the commit point), and every resource taken so far
is released by `ctx.finish()`. A client disconnect cancels the chain wherever it is;
`end_requests` (the end of a drain) cancels every request in the chain and answers each with
an error: a stream gets it as its last event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvgate.asgi import Receive, Send, send_error
from kvgate.errors import GatewayBug, KvgateError
from kvgate.request_options import REQUEST_ID
from kvgate.types import Forward, RequestContext, Stage

log = logging.getLogger("kvgate.chain")


class RequestChain:
    def __init__(
        self, stages: Sequence[Stage], forward: Forward, settle: Callable[[RequestContext], None]
    ) -> None:
        self.stages = tuple(stages)
        self.forward = forward
        self.settle = settle
        self._running: set[asyncio.Task[object]] = set()
        self._ending: KvgateError | None = None

    def end_requests(self, error: KvgateError) -> int:
        """End every request in the chain now with `error` (as the last event of a stream
        already under way, else as the answer); returns how many there were."""
        self._ending = error
        for task in self._running:
            task.cancel()
        return len(self._running)

    async def handle(self, ctx: RequestContext, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, ctx))
        try:
            for stage in self.stages:
                await stage(ctx)
            await self.forward(ctx, send)
            if ctx.outcome == "pending":
                ctx.outcome = "ok"
        except KvgateError as error:
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
        except Exception:
            log.exception("request %s failed inside the gateway", ctx.request_id)
            await _answer_error(ctx, send, GatewayBug("internal gateway error"))
        finally:
            self._running.discard(task)
            watcher.cancel()
            try:
                ctx.finish()
            finally:
                self.settle(ctx)


async def _answer_error(ctx: RequestContext, send: Send, error: KvgateError) -> None:
    ctx.outcome = str(error.code)
    if ctx.responded:
        return
    ctx.responded = True
    if ctx.committed:
        await send({"type": "http.response.body", "body": error.to_sse(), "more_body": False})
        return
    ctx.status = error.status
    await send_error(send, error, [(REQUEST_ID, ctx.request_id.encode())])


async def _watch_disconnect(
    receive: Receive, task: asyncio.Task[None], ctx: RequestContext
) -> None:
    """Cancel the request's task when its client goes away before the answer is complete."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not ctx.responded:
                ctx.client_gone = True
                task.cancel()
            return
