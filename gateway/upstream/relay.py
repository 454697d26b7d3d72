"""Forwarding one request to its endpoint and relaying the answer: the `forward` stage.

Commit point: for streams, the response status and headers go to the client only when the first
upstream data event arrives. Any failure before that is raised as a KvgateError (so the caller
can answer cleanly or try elsewhere); any failure after it ends the stream with an OpenAI-shaped
error event, never with silence or a fake `[DONE]`. Every upstream response is closed on every
path, which is what aborts generation on the engine when the client goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx

from gateway.asgi import Send, send_bytes
from gateway.config import TimeoutsConfig
from gateway.errors import (
    KvgateError,
    Overloaded,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
    upstream_error_from_body,
)
from gateway.types import Headers, RequestContext
from gateway.upstream.headers import upstream_headers
from gateway.upstream.sse import SseProtocolError, SseScanner

_FIRST_EVENT_LIMIT = 1024 * 1024


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


class Forwarder:
    """Sends `ctx` to `ctx.endpoint` and relays the answer to the client through `send`."""

    def __init__(self, client: httpx.AsyncClient, timeouts: TimeoutsConfig,
                 max_error_body_bytes: int) -> None:
        self.client = client
        self.timeouts = timeouts
        self.max_error_body_bytes = max_error_body_bytes

    async def __call__(self, ctx: RequestContext, send: Send) -> None:
        endpoint = ctx.endpoint
        assert endpoint is not None
        headers = upstream_headers(ctx.client_headers, ctx.request_id, endpoint.auth_header)
        request = self.client.build_request("POST", endpoint.url + ctx.upstream_path,
                                            content=ctx.body, headers=headers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeouts.total - (time.perf_counter() - ctx.started)
        endpoint.begin_attempt(ctx)
        try:
            if ctx.stream:
                await self._relay_stream(ctx, request, send, deadline)
            else:
                await self._relay_unary(ctx, request, send, deadline)
        finally:
            endpoint.end_attempt(ctx)

    async def _open(self, request: httpx.Request, until: float, phase: str) -> httpx.Response:
        try:
            async with asyncio.timeout_at(until):
                return await self.client.send(request, stream=True)
        except TimeoutError:
            raise _timeout(phase) from None
        except httpx.ConnectTimeout:
            raise UpstreamTimeout("timed out connecting to the engine",
                                  code="upstream_connect_timeout") from None
        except httpx.PoolTimeout:
            raise Overloaded("no upstream connection became free in time",
                             code="upstream_pool_exhausted", retry_after=1) from None
        except httpx.ConnectError:
            raise UpstreamUnavailable("could not connect to the engine",
                                      code="upstream_connect_failed") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(
                f"the engine closed the connection before answering ({type(exc).__name__})",
                code="upstream_connection_lost") from None

    async def _error_from(self, response: httpx.Response) -> KvgateError:
        body = b""
        try:
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) >= self.max_error_body_bytes:
                    break
        except httpx.HTTPError:
            pass
        return upstream_error_from_body(response.status_code, body, _retry_after(response))

    async def _relay_unary(self, ctx: RequestContext, request: httpx.Request, send: Send,
                           deadline: float) -> None:
        response = await self._open(request, deadline, "total")
        try:
            if response.status_code >= 400:
                raise await self._error_from(response)
            try:
                async with asyncio.timeout_at(deadline):
                    body = await response.aread()
            except TimeoutError:
                raise _timeout("total") from None
            except httpx.HTTPError as exc:
                raise UpstreamUnavailable(
                    f"the engine connection broke while answering ({type(exc).__name__})",
                    code="upstream_connection_lost") from None
            content_type = response.headers.get("content-type", "application/json").encode()
            ctx.status = response.status_code
            ctx.responded = True
            await send_bytes(send, response.status_code, body, content_type,
                             _response_headers(ctx))
        finally:
            await response.aclose()

    async def _relay_stream(self, ctx: RequestContext, request: httpx.Request, send: Send,
                            deadline: float) -> None:
        loop = asyncio.get_running_loop()
        first_token_until = min(deadline, loop.time() + self.timeouts.first_token)
        response = await self._open(request, first_token_until, "first_token")
        try:
            if response.status_code != 200:
                raise await self._error_from(response)
            content_type = response.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                error = await self._error_from(response)
                raise UpstreamProtocolError(
                    f"the engine answered a stream request with '{content_type}': "
                    f"{error.message}", code="upstream_not_a_stream")
            await self._relay_events(ctx, response, send, deadline, first_token_until)
        finally:
            await response.aclose()

    async def _relay_events(self, ctx: RequestContext, response: httpx.Response, send: Send,
                            deadline: float, first_token_until: float) -> None:
        loop = asyncio.get_running_loop()
        scanner = SseScanner()
        chunks: AsyncIterator[bytes] = response.aiter_raw()
        phase = "first_token"
        try:
            async with asyncio.timeout_at(first_token_until) as timer:
                pending: list[bytes] = []
                size = 0
                while scanner.data_events == 0:
                    chunk = await anext(chunks)
                    scanner.feed(chunk)
                    pending.append(chunk)
                    size += len(chunk)
                    if size > _FIRST_EVENT_LIMIT:
                        raise SseProtocolError("no event in the first MiB of the stream")
                await self._commit(ctx, send, b"".join(pending))
                phase = "stall"
                stall = self.timeouts.stall
                while not scanner.terminated:
                    timer.reschedule(min(deadline, loop.time() + stall))
                    chunk = await anext(chunks)
                    scanner.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                # Relay anything the engine sends after [DONE] until it closes the stream.
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except TimeoutError:
            await self._fail(ctx, send, _timeout("total" if loop.time() >= deadline else phase))
            return
        except StopAsyncIteration:
            await self._fail(ctx, send, UpstreamUnavailable(
                "the engine closed the stream without finishing it",
                code="upstream_stream_truncated"))
            return
        except SseProtocolError as exc:
            await self._fail(ctx, send, UpstreamProtocolError(str(exc)))
            return
        except httpx.HTTPError as exc:
            await self._fail(ctx, send, UpstreamUnavailable(
                f"the engine connection broke mid-stream ({type(exc).__name__})",
                code="upstream_connection_lost"))
            return
        ctx.usage = scanner.usage
        if scanner.error is not None:
            ctx.outcome = "upstream_error_event"
        ctx.responded = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _commit(self, ctx: RequestContext, send: Send, first: bytes) -> None:
        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *_response_headers(ctx),
        ]
        ctx.status = 200
        ctx.committed = True
        ctx.first_token_at = time.perf_counter()
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})

    async def _fail(self, ctx: RequestContext, send: Send, error: KvgateError) -> None:
        """Before commit: raise for the caller. After: end the stream with an error event."""
        if not ctx.committed:
            raise error
        ctx.outcome = str(error.code)
        ctx.responded = True
        await send({"type": "http.response.body", "body": error.to_sse(), "more_body": False})


def _response_headers(ctx: RequestContext) -> Headers:
    assert ctx.endpoint is not None
    return [(b"x-request-id", ctx.request_id.encode()),
            (b"x-kvgate-endpoint", ctx.endpoint.name.encode())]


_TIMEOUT_ERRORS = {
    "first_token": ("no first token from the engine in time", "upstream_first_token_timeout"),
    "stall": ("the engine stopped sending tokens", "upstream_stall_timeout"),
    "total": ("the request exceeded its total deadline", "deadline_exceeded"),
}


def _timeout(phase: str) -> UpstreamTimeout:
    message, code = _TIMEOUT_ERRORS[phase]
    return UpstreamTimeout(message, code=code)
