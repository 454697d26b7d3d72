"""The request chain: where a request is refused, where it waits and where it is sent.

    ingress (app) → [stages: auth → classify → admit → pick] → forward → settle

Stages run in order over one RequestContext; the first that raises a KvgateError stops the
chain, its error goes to the client (before the commit point), and every resource taken so far
is released by `ctx.finish()`. A client disconnect cancels the chain wherever it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvgate.asgi import Receive, Send, send_error
from kvgate.errors import GatewayBug, KvgateError
from kvgate.types import RequestContext, Stage
from kvgate.upstream.forwarder import Forwarder

log = logging.getLogger("kvgate.chain")


class RequestChain:
    def __init__(
        self, stages: Sequence[Stage], forward: Forwarder, settle: Callable[[RequestContext], None]
    ) -> None:
        self.stages = tuple(stages)
        self.forward = forward
        self.settle = settle

    async def handle(self, ctx: RequestContext, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
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
            if not ctx.client_gone:
                raise
            task.uncancel()
            ctx.outcome = "client_disconnect"
            ctx.status = ctx.status or 499
        except Exception:
            log.exception("request %s failed inside the gateway", ctx.request_id)
            await _answer_error(ctx, send, GatewayBug("internal gateway error"))
        finally:
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
    await send_error(send, error, [(b"x-request-id", ctx.request_id.encode())])


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
