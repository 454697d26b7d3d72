"""Forwarding one request to its engines and relaying the answer: the `forward` stage.

Attempt loop (see docs/resilience.md): the PickStage chose the first endpoint; when an attempt
fails before the commit point with a retriable error (kvgate/upstream/attempts.py) the
forwarder backs off (full jitter) and tries another endpoint from `picker.choose(ctx,
exclude=tried)`, at most `max_attempts` in all, within the request's deadline, while the
pool's retry budget and client-side throttle allow. Every attempt is reported to its
endpoint's breaker exactly once (`AttemptRecord`) and counted by `endpoint.begin_attempt` /
`endpoint.end_attempt`.

Commit point: for streams, the response status and headers go to the client only when the first
upstream data event arrives. Any failure before that is raised as a KvgateError (answerable,
retriable); any failure after it ends the stream with an OpenAI-shaped error event, never with
silence or a fake `[DONE]` — unless the pool opted in to `resume`, in which case the answer
continues on another endpoint in the same stream (kvgate/upstream/resume.py). Every upstream
response is closed on every path, which is what aborts generation on the engine when the
client goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.asgi import Send, send_bytes
from kvgate.config import TimeoutsConfig
from kvgate.errors import (
    KvgateError,
    Overloaded,
    UpstreamError,
    UpstreamFailed,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
    upstream_error_from_body,
)
from kvgate.routing.endpoints import Endpoint
from kvgate.routing.router import EndpointPicker
from kvgate.types import Headers, RequestContext
from kvgate.upstream.attempts import judge
from kvgate.upstream.backoff import full_jitter_delay
from kvgate.upstream.headers import upstream_headers
from kvgate.upstream.limits import RequestLimits, resolve_limits
from kvgate.upstream.resilience import AttemptRecord, Resilience
from kvgate.upstream.resume import StreamTranscript, continuation_body, resume_eligible
from kvgate.upstream.retry_budget import RetryBudget
from kvgate.upstream.sse import SseProtocolError, SseScanner
from kvgate.upstream.transport import (
    ConnectFailed,
    ConnectTimeout,
    TransportError,
    UpstreamResponse,
    UpstreamTransport,
)

_FIRST_EVENT_LIMIT = 1024 * 1024
_DONE = b"data: [DONE]\n\n"


class _StreamBroken(Exception):
    """An attempt failed after the commit point: the client already has a 200 and events."""

    def __init__(self, error: KvgateError) -> None:
        super().__init__(error.message)
        self.error = error


class _Throttled(Exception):
    """The pool's client-side throttle rejected the attempt before it was sent."""


def _retry_after(response: UpstreamResponse) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


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
        self.transport = transport
        self.timeouts = timeouts
        self.max_error_body_bytes = max_error_body_bytes
        self.resilience = resilience
        self.picker = picker

    async def __call__(self, ctx: RequestContext, send: Send) -> None:
        assert ctx.endpoint is not None
        limits = resolve_limits(ctx, self.timeouts)
        budget = self.resilience.budgets[ctx.endpoint.pool]
        budget.request_started()
        try:
            await self._forward(ctx, send, limits, budget)
        finally:
            budget.request_finished()

    # --- the attempt loop ------------------------------------------------------------------

    async def _forward(
        self, ctx: RequestContext, send: Send, limits: RequestLimits, budget: RetryBudget
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
                    await self._attempt(ctx, endpoint, ctx.body, send, limits, transcript)
                    return
                except _StreamBroken as broken:
                    tried.append(endpoint)
                    await self._after_break(ctx, send, limits, transcript, tried, broken.error)
                    return
                except _Throttled:
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
                    last_error = error
                    if holding_retry:
                        budget.release()
                        holding_retry = False
                    endpoint = await self._next_endpoint(ctx, error, limits, budget, tried)
                    holding_retry = True
                    ctx.endpoint = endpoint
        finally:
            if holding_retry:
                budget.release()

    async def _next_endpoint(
        self,
        ctx: RequestContext,
        error: KvgateError,
        limits: RequestLimits,
        budget: RetryBudget,
        tried: list[Endpoint],
    ) -> Endpoint:
        """The endpoint for the next attempt, after the back-off (holding a retry from the
        budget); raises `error` when the policy says to stop."""
        verdict = judge(error, limits.client_shortened)
        if not verdict.retriable or ctx.client_gone:
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
        remaining = limits.remaining()
        if remaining <= delay or (error.retry_after or 0) > remaining:
            raise stop("deadline")
        if not budget.try_acquire():
            raise stop("budget")
        try:
            endpoint = self.picker.choose(ctx, exclude=tried)
            observer.retry(pool, str(error.code))
            await asyncio.sleep(delay)
        except KvgateError:
            budget.release()
            raise stop("no_endpoint") from None
        except BaseException:
            budget.release()
            raise
        return endpoint

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
        limits: RequestLimits,
        transcript: StreamTranscript | None,
        tried: list[Endpoint],
        error: KvgateError,
    ) -> None:
        """The stream broke after the commit point: resume it if allowed, else end it with an
        error event."""
        observer = self.resilience.observer
        pool = tried[0].pool
        while transcript is not None and ctx.resumes < self.resilience.settings.max_resumes:
            if transcript.finished:  # every token arrived; only the end of stream was lost
                ctx.responded = True
                await send({"type": "http.response.body", "body": _DONE, "more_body": False})
                return
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
                await self._attempt(ctx, endpoint, body, send, limits, transcript)
            except _StreamBroken as broken:
                error = broken.error
                continue
            except _Throttled:
                break
            except KvgateError as failure:
                error = failure
                continue
            ctx.resume_overhead_tokens = transcript.overhead_tokens
            if transcript.usage is not None:
                ctx.usage = transcript.usage
            observer.resumed(pool, "ok", transcript.overhead_tokens)
            return
        if ctx.resumes:
            observer.resumed(pool, "failed", transcript.overhead_tokens if transcript else 0)
        ctx.outcome = str(error.code)
        ctx.responded = True
        await send({"type": "http.response.body", "body": error.to_sse(), "more_body": False})

    # --- one attempt -----------------------------------------------------------------------

    async def _attempt(
        self,
        ctx: RequestContext,
        endpoint: Endpoint,
        body: bytes,
        send: Send,
        limits: RequestLimits,
        transcript: StreamTranscript | None,
    ) -> None:
        record = self.resilience.begin(endpoint)
        if record is None:
            raise _Throttled
        request = _Request(
            endpoint.url + ctx.upstream_path,
            upstream_headers(ctx.client_headers, ctx.request_id, endpoint.auth_header),
            body,
            limits.connect,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.remaining()
        first_token = limits.first_token
        if record.probe:
            first_token = min(first_token, self.resilience.settings.breaker.probe_timeout)
        ctx.attempts += 1
        endpoint.begin_attempt(ctx)
        try:
            if ctx.stream:
                await self._relay_stream(
                    ctx,
                    endpoint,
                    request,
                    send,
                    deadline,
                    min(deadline, loop.time() + first_token),
                    limits.stall,
                    record,
                    transcript,
                )
            else:
                await self._relay_unary(ctx, request, send, deadline)
            record.succeeded()
        except _StreamBroken as broken:
            record.failed(judge(broken.error, limits.client_shortened))
            raise
        except KvgateError as error:
            record.failed(judge(error, limits.client_shortened))
            raise
        finally:
            record.abandoned()  # no-op unless the attempt ended without a verdict
            endpoint.end_attempt(ctx)

    async def _open(self, request: _Request, until: float, phase: str) -> UpstreamResponse:
        try:
            async with asyncio.timeout_at(until):
                return await self.transport.open(
                    request.url, request.headers, request.body, request.connect_timeout
                )
        except TimeoutError:
            raise _timeout(phase) from None
        except ConnectTimeout:
            raise UpstreamTimeout(
                "timed out connecting to the engine", code="upstream_connect_timeout"
            ) from None
        except ConnectFailed:
            raise UpstreamUnavailable(
                "could not connect to the engine", code="upstream_connect_failed"
            ) from None
        except TransportError as exc:
            raise UpstreamUnavailable(
                f"the engine closed the connection before answering ({exc})",
                code="upstream_connection_lost",
            ) from None

    async def _error_from(self, response: UpstreamResponse) -> KvgateError:
        try:
            body = await response.read(self.max_error_body_bytes)
        except TransportError:
            body = b""
        return upstream_error_from_body(response.status, body, _retry_after(response))

    async def _relay_unary(
        self, ctx: RequestContext, request: _Request, send: Send, deadline: float
    ) -> None:
        response = await self._open(request, deadline, "total")
        try:
            if response.status >= 400:
                raise await self._error_from(response)
            try:
                async with asyncio.timeout_at(deadline):
                    body = await response.read()
            except TimeoutError:
                raise _timeout("total") from None
            except TransportError as exc:
                raise UpstreamUnavailable(
                    f"the engine connection broke while answering ({exc})",
                    code="upstream_connection_lost",
                ) from None
            content_type = response.headers.get("content-type", "application/json")
            if content_type.startswith("application/json") and not _looks_like_json(body):
                raise UpstreamProtocolError(
                    "the engine's answer is not a complete JSON object",
                    code="upstream_malformed_body",
                )
            ctx.status = response.status
            ctx.usage = _answer_usage(body)
            ctx.responded = True
            await send_bytes(
                send, response.status, body, content_type.encode(), _response_headers(ctx)
            )
        finally:
            response.close()

    async def _relay_stream(
        self,
        ctx: RequestContext,
        endpoint: Endpoint,
        request: _Request,
        send: Send,
        deadline: float,
        first_token_until: float,
        stall: float,
        record: AttemptRecord,
        transcript: StreamTranscript | None,
    ) -> None:
        response = await self._open(request, first_token_until, "first_token")
        try:
            if response.status != 200:
                raise await self._error_from(response)
            content_type = response.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                error = await self._error_from(response)
                raise UpstreamProtocolError(
                    f"the engine answered a stream request with '{content_type}': {error.message}",
                    code="upstream_not_a_stream",
                )
            await self._relay_events(
                ctx,
                endpoint,
                response,
                send,
                deadline,
                first_token_until,
                stall,
                record,
                transcript,
            )
        finally:
            response.close()

    async def _relay_events(
        self,
        ctx: RequestContext,
        endpoint: Endpoint,
        response: UpstreamResponse,
        send: Send,
        deadline: float,
        first_token_until: float,
        stall: float,
        record: AttemptRecord,
        transcript: StreamTranscript | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        scanner = SseScanner()
        chunks: AsyncIterator[bytes] = response.iter_raw()
        phase = "first_token"
        error: KvgateError
        try:
            async with asyncio.timeout_at(first_token_until) as timer:
                pending: list[bytes] = []
                size = 0
                while scanner.data_events == 0:
                    chunk = await anext(chunks)
                    pending.append(scanner.feed(chunk))
                    size += len(chunk)
                    if size > _FIRST_EVENT_LIMIT:
                        raise SseProtocolError("no event in the first MiB of the stream")
                if scanner.error is not None and not ctx.committed:
                    raise _event_error(scanner.error)
                first = b"".join(pending)
                if transcript is not None:
                    first = transcript.shape(first)
                endpoint.first_token(ctx)  # prefill done: the attempt now counts as decoding
                record.first_token()
                if ctx.committed:
                    await _send_body(send, first)
                else:
                    await self._commit(ctx, send, first)
                phase = "stall"
                while not scanner.terminated:
                    timer.reschedule(min(deadline, loop.time() + stall))
                    out = scanner.feed(await anext(chunks))
                    if transcript is not None and out:
                        out = transcript.shape(out)
                    await _send_body(send, out)
                # Relay anything the engine sends after [DONE] until it closes the stream.
                await _send_body(send, scanner.flush())
                async for chunk in chunks:
                    await _send_body(send, chunk)
        except TimeoutError:
            error = _timeout("total" if loop.time() >= deadline else phase)
        except StopAsyncIteration:
            error = UpstreamUnavailable(
                "the engine closed the stream without finishing it",
                code="upstream_stream_truncated",
            )
        except SseProtocolError as exc:
            error = UpstreamProtocolError(str(exc), code="upstream_malformed_event")
        except TransportError as exc:
            error = UpstreamUnavailable(
                f"the engine connection broke mid-stream ({exc})", code="upstream_connection_lost"
            )
        else:
            ctx.relayed_events += scanner.data_events
            ctx.usage = scanner.usage
            if transcript is not None and transcript.continuing:
                ctx.usage = transcript.usage
            if scanner.error is not None:
                ctx.outcome = "upstream_error_event"
                record.failed(judge(_event_error(scanner.error)))
            ctx.responded = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        ctx.relayed_events += scanner.data_events
        if ctx.committed:
            raise _StreamBroken(error)
        raise error

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


@dataclass(frozen=True, slots=True)
class _Request:
    url: str
    headers: Headers
    body: bytes
    connect_timeout: float


async def _send_body(send: Send, body: bytes) -> None:
    if body:
        await send({"type": "http.response.body", "body": body, "more_body": True})


def _looks_like_json(body: bytes) -> bool:
    """Cheap completeness check of a JSON answer: one object, not cut short."""
    stripped = body.strip()
    return stripped[:1] == b"{" and stripped[-1:] == b"}"


def _event_error(error: dict[str, object]) -> UpstreamError:
    """An error the engine sent as a stream event, as the error it would have answered."""
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 502
    return upstream_error_from_body(status, orjson.dumps({"error": error}))


def _answer_usage(body: bytes) -> dict[str, Any] | None:
    """The `usage` of a non-stream answer, for quota settlement (parsed only if present)."""
    if b'"usage"' not in body:
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = parsed.get("usage") if isinstance(parsed, dict) else None
    return usage if isinstance(usage, dict) else None


def _response_headers(ctx: RequestContext) -> Headers:
    assert ctx.endpoint is not None
    return [
        (b"x-request-id", ctx.request_id.encode()),
        (b"x-kvgate-endpoint", ctx.endpoint.name.encode()),
        *ctx.response_headers,
    ]


_TIMEOUT_ERRORS = {
    "first_token": ("no first token from the engine in time", "upstream_first_token_timeout"),
    "stall": ("the engine stopped sending tokens", "upstream_stall_timeout"),
    "total": ("the request exceeded its total deadline", "deadline_exceeded"),
}


def _timeout(phase: str) -> UpstreamTimeout:
    message, code = _TIMEOUT_ERRORS[phase]
    return UpstreamTimeout(message, code=code)
