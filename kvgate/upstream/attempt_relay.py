"""One attempt: send the request to one endpoint and relay its answer to the client.

Commit point: for streams, the response status and headers go to the client only when the first
upstream data event arrives. Any failure before that is raised as a KvgateError (answerable,
retriable); any failure after it is raised as `StreamBroken`, for the forwarder to resume the
stream or end it with an error event (kvgate/upstream/forwarder.py). The upstream response is
closed on every path (`_opened`, `_whole_answer`), which is what aborts generation on the engine
when the client goes away. Every attempt is reported to its endpoint's breaker exactly once
(`AttemptRecord`) and counted by `endpoint.begin_attempt` / `endpoint.end_attempt`. A
Responses API answer's response ids are relayed in the client's form, naming the endpoint
that answered (kvgate/upstream/response_id_rewrite.py); no other route pays for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import orjson

from kvgate.asgi import Send, send_bytes
from kvgate.body_members import unsalted
from kvgate.errors import (
    PROMPT_PARAMS,
    ClientStalled,
    KvgateError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamUnavailable,
    upstream_error_from_body,
)
from kvgate.request_options import ENDPOINT, REQUEST_ID
from kvgate.routing.endpoints import Endpoint
from kvgate.types import Headers, RequestContext
from kvgate.upstream.answer_usage import answer_usage, parsed_usage
from kvgate.upstream.attempts import judge
from kvgate.upstream.failures import Phase, attempt_failure
from kvgate.upstream.headers import upstream_headers
from kvgate.upstream.moving_deadline import TIMER_RESOLUTION, MovingDeadline
from kvgate.upstream.request_timeouts import RequestTimeouts
from kvgate.upstream.resilience import AttemptRecord, Resilience
from kvgate.upstream.response_id_rewrite import ResponseIdRewriter
from kvgate.upstream.resume import StreamTranscript
from kvgate.upstream.sse import MAX_EVENT_BYTES, SseProtocolError, SseScanner
from kvgate.upstream.transport import TransportError, UpstreamResponse, UpstreamTransport

# An engine asking for a pause longer than a day is read as a day.
_MAX_RETRY_AFTER = 86_400.0


class StreamBroken(Exception):
    """An attempt failed after the commit point: the client already has a 200 and events."""

    def __init__(self, error: KvgateError) -> None:
        super().__init__(error.message)
        self.error = error


class Throttled(Exception):
    """The pool's client-side throttle rejected the attempt before it was sent."""


@dataclass(slots=True)
class _Request:
    url: str
    headers: Headers
    body: bytes  # b"" once sent: a retry or a resume builds a request of its own
    connect_timeout: float
    # The body's field that holds the prompt, named by a too-long prompt's error.
    prompt_param: str
    method: bytes
    # A Responses API answer's id rewriting (None on every other route).
    ids: ResponseIdRewriter | None


class AttemptRelay:
    """Runs one attempt (`run`): raises the attempt's error, `StreamBroken` after the commit
    point, or `Throttled` when the attempt was not sent at all."""

    def __init__(
        self, transport: UpstreamTransport, max_error_body_bytes: int, resilience: Resilience
    ) -> None:
        self.transport = transport
        self.max_error_body_bytes = max_error_body_bytes
        self.resilience = resilience

    async def run(
        self,
        ctx: RequestContext,
        endpoint: Endpoint,
        send: Send,
        limits: RequestTimeouts,
        transcript: StreamTranscript | None,
        body: bytes | None = None,
    ) -> None:
        """`body`: what to send instead of `ctx.body` (a resume's continuation)."""
        record = self.resilience.begin(endpoint)
        if record is None:
            raise Throttled
        ctx.attempts += 1
        span = None if ctx.trace is None else ctx.trace.attempt(endpoint)
        sent = ctx.body if body is None else body
        if ctx.cache_salt is not None and endpoint.engine == "openai":
            sent = unsalted(sent, ctx.cache_salt)
        request = _Request(
            endpoint.url + ctx.upstream_path,
            upstream_headers(
                ctx.client_headers,
                None if ctx.body_names_request else ctx.request_id,
                endpoint.auth_header,
                None if span is None else span.headers(),
            ),
            sent,
            limits.connect,
            PROMPT_PARAMS.get(ctx.route, "messages"),
            ctx.method,
            None
            if ctx.response_ids is None
            else ResponseIdRewriter(ctx.response_ids, endpoint.url),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.remaining()
        first_token = limits.first_token
        if record.probe:
            first_token = min(first_token, self.resilience.settings.breaker.probe_timeout)
        if ctx.sent_at is None:
            ctx.sent_at = time.perf_counter()
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
            endpoint.record_success()
            if span is not None:
                span.end(None if ctx.outcome == "pending" else ctx.outcome)
        except StreamBroken as broken:
            record.failed(judge(broken.error, limits.client_shortened))
            if span is not None:
                span.end(str(broken.error.code))
            raise
        except KvgateError as error:
            record.failed(judge(error, limits.client_shortened))
            if span is not None:
                span.end(str(error.code))
            raise
        finally:
            record.abandoned()  # no-op unless the attempt ended without a verdict
            endpoint.end_attempt(ctx)
            if span is not None:
                span.end("interrupted")  # the client left, a drain ended the request, or a bug

    @asynccontextmanager
    async def _opened(
        self, request: _Request, until: float, deadline: float
    ) -> AsyncIterator[UpstreamResponse]:
        """A stream's response once its status and headers arrived (by `until`, the first-token
        deadline, at most the request's `deadline`), closed when the block ends, however it
        ends."""
        try:
            async with asyncio.timeout_at(until):
                response = await self.transport.open(
                    request.url,
                    request.headers,
                    request.body,
                    request.connect_timeout,
                    request.method,
                )
        except TimeoutError as expired:
            raise _timed_out(expired, deadline, "first_token") from None
        except TransportError as failure:
            raise attempt_failure(failure, "first_token") from None
        request.body = b""
        try:
            yield response
        finally:
            response.close()

    async def _error_from(self, response: UpstreamResponse, request: _Request) -> KvgateError:
        try:
            body = await response.read(self.max_error_body_bytes)
        except TransportError:
            body = b""
        error = upstream_error_from_body(
            response.status, body, _retry_after(response), request.prompt_param
        )
        if request.ids is not None:
            error.message = request.ids.text(error.message)
        return error

    async def _relay_unary(
        self, ctx: RequestContext, request: _Request, send: Send, deadline: float
    ) -> None:
        status, content_type, body = await self._whole_answer(request, deadline)
        if content_type.startswith("application/json") and not _looks_like_json(body):
            raise UpstreamProtocolError(
                "the engine's answer is not a complete JSON object",
                code="upstream_malformed_body",
            )
        parsed: Any = None
        if request.ids is not None:
            body, parsed = request.ids.body(body)
        ctx.status = status
        ctx.responded = True
        try:
            await send_bytes(send, status, body, content_type.encode(), _response_headers(ctx))
        finally:  # the answer does not wait for the accounting; a client gone still pays
            if ctx.response_id is None:  # a stored response's usage counted when it was made
                ctx.usage, ctx.response_model = (
                    answer_usage(body) if parsed is None else parsed_usage(parsed)
                )

    async def _whole_answer(self, request: _Request, deadline: float) -> tuple[int, str, bytes]:
        """The engine's status, content type and whole body, all by `deadline` (one deadline
        over connecting, the head and the body), its connection back in the pool (or closed)
        before the client is answered. An engine's error answer is raised as its error."""
        response: UpstreamResponse | None = None
        try:
            async with asyncio.timeout_at(deadline):
                response = await self.transport.open(
                    request.url,
                    request.headers,
                    request.body,
                    request.connect_timeout,
                    request.method,
                )
                request.body = b""
                if response.status >= 400:
                    raise await self._error_from(response, request)
                body = await response.read()
                content_type = response.headers.get("content-type", "application/json")
                return response.status, content_type, body
        except (TimeoutError, TransportError) as failure:
            raise attempt_failure(failure, "total") from None
        finally:
            if response is not None:
                response.close()

    async def _expect_stream(self, response: UpstreamResponse, request: _Request) -> None:
        """Raise the engine's error unless `response` is a 200 event stream."""
        if response.status != 200:
            raise await self._error_from(response, request)
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            error = await self._error_from(response, request)
            raise UpstreamProtocolError(
                f"the engine answered a stream request with '{content_type}': {error.message}",
                code="upstream_not_a_stream",
            )

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
        async with self._opened(request, first_token_until, deadline) as response:
            await self._expect_stream(response, request)
            loop = asyncio.get_running_loop()
            scanner = SseScanner(strip_usage=ctx.strip_usage)
            chunks: AsyncIterator[bytes] = response.iter_raw()
            phase: Phase = "first_token"
            # While a send waits for the client to read, the engine's timers do not run: only
            # the total deadline bounds it (a client that stops reading is not a stalled engine).
            writing = False
            error: KvgateError
            try:
                async with MovingDeadline(first_token_until) as timer:
                    pending: list[bytes] = []
                    size = 0
                    while scanner.data_events == 0:
                        chunk = await anext(chunks)
                        pending.append(scanner.feed(chunk))
                        size += len(chunk)
                        if size > MAX_EVENT_BYTES:
                            raise SseProtocolError(
                                f"no event in the first {MAX_EVENT_BYTES // 2**20} MiB of the "
                                "stream"
                            )
                    # An error as the stream's first event is the answer (an HTTP error, which
                    # may be retried); after other events, which this read may have brought
                    # with it, it ends the stream they begin.
                    engine_error = scanner.error
                    if engine_error is not None and scanner.data_events == 1 and not ctx.committed:
                        raise _event_error(engine_error, request.prompt_param)
                    first = b"".join(pending)
                    if transcript is not None:
                        first = transcript.shape(first)
                    first = _relayed(request, first)
                    endpoint.first_token(ctx)  # prefill done: the attempt now counts as decoding
                    record.first_token()
                    timer.move_to(deadline)
                    writing = True
                    if ctx.committed:
                        await _send_body(send, first)
                    else:
                        if transcript is None:  # no retry or resume can need the prompt now
                            ctx.release_prompt()
                        await _commit(ctx, send, first)
                    writing = False
                    phase = "stall"
                    record_gap = self.resilience.observer.token_gap_recorder(ctx.route)
                    relayed_at = time.perf_counter()
                    while not scanner.terminated:
                        timer.move_to(min(deadline, loop.time() + stall))
                        events = scanner.data_events
                        out = scanner.feed(await anext(chunks))
                        if transcript is not None and out:
                            out = transcript.shape(out)
                        if out:
                            out = _relayed(request, out)
                        # Inter-token latency: a chunk that relays an event other than [DONE]
                        # (`done` can only have turned True in this chunk).
                        if scanner.data_events - events > scanner.done:
                            now = time.perf_counter()
                            record_gap(now - relayed_at)
                            relayed_at = now
                        if out:
                            timer.move_to(deadline)
                            writing = True
                            await send(
                                {"type": "http.response.body", "body": out, "more_body": True}
                            )
                            writing = False
                    if scanner.error is None:
                        # Relay what the engine sends after [DONE] until it closes the stream.
                        await _send_body(send, _relayed(request, scanner.flush()))
                        async for chunk in chunks:
                            await _send_body(send, _relayed(request, chunk))
                        if request.ids is not None:
                            await _send_body(send, request.ids.flush())
            except TimeoutError as expired:
                error = (
                    ClientStalled(
                        "the client stopped reading the stream until the request's deadline",
                    )
                    if writing
                    else _timed_out(expired, deadline, phase)
                )
            except TransportError as failure:
                error = attempt_failure(failure, phase)
            except StopAsyncIteration:
                error = UpstreamUnavailable(
                    "the engine closed the stream without finishing it",
                    code="upstream_stream_truncated",
                )
            except SseProtocolError as exc:
                error = UpstreamProtocolError(str(exc), code="upstream_malformed_event")
            except BaseException:
                # Cancelled (the client left) or a send failed: what it was sent is charged.
                ctx.relayed_events += scanner.data_events
                raise
            else:
                ctx.relayed_events += scanner.data_events
                if ctx.response_id is None:  # a stored response's usage counted when it was made
                    ctx.usage = scanner.usage
                    ctx.response_model = scanner.model
                if transcript is not None and transcript.continuing:
                    ctx.usage = transcript.usage
                last = b""
                if scanner.error is not None:
                    # The engine's error event, in OpenAI's shape, ends the stream.
                    ctx.outcome = "upstream_error_event"
                    event_error = _event_error(scanner.error, request.prompt_param)
                    if request.ids is not None:
                        event_error.message = request.ids.text(event_error.message)
                    record.failed(judge(event_error))
                    # In the place of the engine's event, which the count includes.
                    last = event_error.to_stream_event(ctx.route, ctx.relayed_events - 1)
                ctx.responded = True
                await send({"type": "http.response.body", "body": last, "more_body": False})
                return
            ctx.relayed_events += scanner.data_events
            if ctx.committed:
                raise StreamBroken(error)
            raise error


def _timed_out(expired: TimeoutError, deadline: float, phase: Phase) -> KvgateError:
    """The error for a timer that expired in `phase`: the request's own deadline's when it
    fired at that deadline (a timer may fire up to its resolution early), so a client's short
    deadline is never reported as the engine's slowness."""
    at_deadline = asyncio.get_running_loop().time() + TIMER_RESOLUTION >= deadline
    return attempt_failure(expired, "total" if at_deadline else phase)


async def _commit(ctx: RequestContext, send: Send, first: bytes) -> None:
    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),  # as vLLM and SGLang send it
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        *_response_headers(ctx),
    ]
    ctx.status = 200
    ctx.committed = True
    ctx.first_token_at = time.perf_counter()
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": first, "more_body": True})


def _relayed(request: _Request, data: bytes) -> bytes:
    return data if request.ids is None else request.ids.events(data)


async def _send_body(send: Send, body: bytes) -> None:
    if body:
        await send({"type": "http.response.body", "body": body, "more_body": True})


def _retry_after(response: UpstreamResponse) -> float | None:
    """The engine's `Retry-After` in seconds (RFC 9110: delay-seconds or an HTTP-date), at
    most a day; None when absent or unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = (when - datetime.now(UTC)).total_seconds()
    if seconds != seconds:  # NaN
        return None
    return min(max(0.0, seconds), _MAX_RETRY_AFTER)


def _looks_like_json(body: bytes) -> bool:
    """Cheap completeness check of a JSON answer: one object, not cut short."""
    stripped = body.strip()
    return stripped[:1] == b"{" and stripped[-1:] == b"}"


def _event_error(error: dict[str, object], prompt_param: str) -> UpstreamError:
    """An error the engine sent as a stream event, as the error it would have answered."""
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 502
    return upstream_error_from_body(status, orjson.dumps({"error": error}), None, prompt_param)


def _response_headers(ctx: RequestContext) -> Headers:
    assert ctx.endpoint is not None
    return [
        (REQUEST_ID, ctx.request_id.encode()),
        (ENDPOINT, ctx.endpoint.name.encode()),
        *ctx.response_headers,
    ]
