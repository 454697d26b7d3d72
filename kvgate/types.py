"""The core contracts every stage shares: the request context and the stage protocol."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvgate.chain.intent import Intent
    from kvgate.chain.tenants import KeyRecord, Tenant
    from kvgate.prompt_view import PromptView
    from kvgate.request_options import RequestOptions
    from kvgate.routing.endpoints import Endpoint
    from kvgate.routing.match import PrefixMatch
    from kvgate.routing.response_ids import ResponseIds

Headers = list[tuple[bytes, bytes]]


def header_value(headers: Headers, name: bytes) -> bytes | None:
    """The first value of header `name` (lower-case, as ASGI gives names), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


@dataclass(slots=True, weakref_slot=True)
class RequestContext:
    """One request on its way through the chain; each stage reads it and fills in its part.

    Resources a stage takes (slots, reservations, in-flight counts) are released through
    `on_finish` callbacks, which run exactly once when the request ends on any path.
    """

    request_id: str
    route: str
    upstream_path: str
    client_headers: Headers
    body: bytes
    payload: dict[str, Any]
    model: str
    stream: bool
    # The client's x-kvgate-* headers, parsed and validated at ingress.
    options: RequestOptions
    # The prompt as every stage reads it (text pieces, canonical text, one token estimate).
    view: PromptView
    started: float = field(default_factory=time.perf_counter)
    # The HTTP method sent upstream (POST but on the `/v1/responses/{id}` routes).
    method: bytes = b"POST"
    # The body's `request_id` names the request for the engine and no header may carry it (not
    # a sane header value): no X-Request-Id goes upstream, or vLLM would take that instead.
    body_names_request: bool = False
    # The response a `/v1/responses/{id}` route names, as the client sent its id (None on the
    # inference routes).
    response_id: str | None = None
    endpoint: Endpoint | None = None
    # The one endpoint that can serve the request: it stores the response the request names
    # or continues (`previous_response_id`). No stage picks another; no attempt goes elsewhere.
    pinned: Endpoint | None = None
    # Responses API requests: how the engine's response ids are relayed to the client
    # (kvgate/routing/response_ids.py); None on the other routes, which pay nothing for it.
    response_ids: ResponseIds | None = None
    status: int = 0
    outcome: str = "pending"
    committed: bool = False
    responded: bool = False
    client_gone: bool = False
    first_token_at: float | None = None
    # When the first upstream request was sent (time.perf_counter()).
    sent_at: float | None = None
    usage: dict[str, Any] | None = None
    # Request chain (kvgate/chain): who asks, what kind of work it is, and by when.
    tenant: Tenant | None = None
    key_id: str | None = None
    # The client's key, checked at ingress before its body was read (None: not checked yet,
    # or an open gateway); the auth stage takes it from there.
    verified_key: KeyRecord | None = None
    # The client asked to see routing scores and may (kvgate/chain/auth.py).
    explain: bool = False
    intent: Intent | None = None
    tier: str = ""
    # Lower runs first: latency-class rank x 100 + tier priority (see docs/tenants.md).
    priority: int = 0
    # Absolute time.perf_counter() by which the whole request must be finished.
    deadline: float | None = None
    # Salt of the tenant's prefix-cache namespace (also set as `cache_salt` in the body).
    cache_salt: str | None = None
    # Jurisdictions the request may be served in (endpoint label `jurisdiction`); None: any.
    allowed_jurisdictions: frozenset[str] | None = None
    # SSE data events relayed to the client (streams), for usage estimates without `usage`.
    relayed_events: int = 0
    # The gateway asked the engine for usage the client did not ask for: drop its chunk.
    strip_usage: bool = False
    # Routing: prefix match data computed once by the picker (retries reuse it), and headers
    # the gateway adds to the response next to x-kvgate-endpoint (e.g. the route explanation).
    prefix: PrefixMatch | None = None
    # The prompt's token ids as its pool's engines will see them, computed off the event loop
    # before admission when the pool's tokenizer can run in a thread (precise routing); a
    # 1-tuple of the tokenizer's answer (None inside: it cannot reproduce this prompt).
    prompt_ids: tuple[list[int] | None] | None = None
    response_headers: Headers = field(default_factory=list)
    # Resilience (kvgate/upstream): upstream attempts dispatched (retries and resumes
    # included), streams resumed on another endpoint, and the prompt tokens re-read to do so.
    attempts: int = 0
    resumes: int = 0
    resume_overhead_tokens: int = 0
    # The model the client asked for, when a policy's fallback model serves the request
    # instead (`ctx.model` is then the fallback; kvgate/routing/router.py).
    fallback_from: str | None = None
    # The model the engine named in the answer it reported usage with (None: not reported).
    response_model: str | None = None
    # This request's trace (kvgate/observability/request_trace.py); None when tracing is off (then
    # nothing on the request path calls OpenTelemetry) or the request is not sampled.
    trace: RequestTrace | None = None
    _finishers: list[Callable[[RequestContext], None]] = field(default_factory=list)

    def release_prompt(self) -> None:
        """Drop the body, the parsed payload, the prompt view's text and the prompt's hashes
        (for a long prompt, several copies of it) once nothing will send or route the request
        again: a stream past its commit point that cannot be resumed. What settlement,
        metrics, traces and the quota read stays (the token estimates, the prefix match's
        counts, the usage). `payload` is empty and `body` is b"" from then on."""
        self.body = b""
        self.payload = {}
        self.view.release()
        if self.prefix is not None:
            self.prefix.release_prompt()

    def on_finish(self, callback: Callable[[RequestContext], None]) -> None:
        self._finishers.append(callback)

    def finish(self) -> None:
        """Run every release callback once, newest first, even if one of them fails."""
        finishers, self._finishers = self._finishers, []
        errors: list[BaseException] = []
        for callback in reversed(finishers):
            try:
                callback(self)
            except Exception as exc:  # a failing release must not skip the others
                errors.append(exc)
        if errors:
            raise errors[0]


class TraceSpan(Protocol):
    """One timed step of a traced request."""

    def headers(self) -> Headers:
        """The W3C trace-context headers (`traceparent`, `tracestate`) naming this span as
        the parent, for a request this step sends."""
        ...

    def end(self, error: str | None = None) -> None:
        """End the step; `error` is the error code that failed it, if any. Only the first
        call counts."""


class RequestTrace(Protocol):
    """The trace of one request: a span for the request, children for its steps. Made at the
    start of the chain when tracing is on and the request sampled; the chain ends it with
    `finish` after settling.
    A new span's parent is the innermost span of the request still open (a request's steps
    run one after the other)."""

    # When the stages started, then when each one ended (`time.perf_counter()`): the chain
    # appends as each stage ends, so that a stage costs the trace nothing more.
    stage_ends: list[float]

    def stage_failed(self, error: str) -> None:
        """The stage under way (the one after the last that ended) failed with `error`."""

    def span(
        self, name: str, attributes: dict[str, str | int | float | bool] | None = None
    ) -> TraceSpan:
        """A new step of the request, with the attributes it reports."""
        ...

    def attempt(self, endpoint: Endpoint) -> TraceSpan:
        """A new span for one upstream attempt to `endpoint`, the `ctx.attempts`-th."""
        ...

    def finish(self) -> None:
        """End the request's span with what the context says about the outcome."""


class Stage(Protocol):
    """A step of the request chain. It enriches the context or raises a KvgateError to refuse;
    whatever it takes it releases through `ctx.on_finish`."""

    async def __call__(self, ctx: RequestContext) -> None: ...


class Forward(Protocol):
    """The last step of the chain: send the request to `ctx.endpoint` (and, on failures it may
    retry, to others) and relay the answer through the ASGI `send`."""

    async def __call__(
        self, ctx: RequestContext, send: Callable[[MutableMapping[str, Any]], Awaitable[None]]
    ) -> None: ...
