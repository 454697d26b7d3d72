"""The HTTP surface of one simulated engine, as a plain ASGI application.

Routes: the OpenAI endpoints, the engine's own JSON APIs (`/tokenize`, `/detokenize`, rerank,
score, `/classify`, `/pooling`: kvgate/sim/engine_apis.py), `/health`, `/metrics`, the
flavour's extras (vLLM `/reset_prefix_cache`, `/v1/responses` and, under
`/v1/responses/{id}`, retrieve and cancel; SGLang `/v1/loads`, `/get_load`, `/flush_cache`,
`/health_generate`) and the simulator's own `/sim/stats`, `/sim/first-tokens` and
`/sim/faults` (and `/sim/kv-events/faults` when the engine publishes KV events). Inference
requests pass through the fault injector first; everything else is never faulted.
"""

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from .asgi_types import Receive, Scope, Send
from .connection import DisconnectWatch, abort_connection
from .embeddings import embeddings_response
from .engine_apis import ENGINE_APIS, VOCABULARY, EngineApi
from .engine_core import ABORTED, EngineCore
from .faults import Fault
from .http_io import JSON_HEADERS as _JSON
from .http_io import read_body as _read_body
from .http_io import respond as _respond
from .kv_event_publisher import KvEventPublisher
from .kv_event_routes import kv_event_fault_routes
from .metrics import render_metrics
from .openai_api import (
    CHAT,
    COMPLETION,
    ApiError,
    Generation,
    full_response,
    now_seconds,
    output_text,
    parse_generation,
    stream_chunk,
    usage_chunk,
)
from .options import EngineOptions
from .response_store import PREFIX as STORED_RESPONSES
from .response_store import ResponseStore
from .responses_api import RESPONSE, ResponseGeneration, deliver_response, parse_response_request
from .stats import EngineCounters

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_DONE = b"data: [DONE]\n\n"
_GARBAGE_EVENT = b'data: {"choices": [{"delta": {"content": "unterminated\n\n'


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class EngineApp:
    """ASGI app of one engine; `apply_fault(None)` clears, `apply_fault(fault)` sets."""

    def __init__(
        self,
        options: EngineOptions,
        core: EngineCore,
        counters: EngineCounters,
        draw_fault: Callable[[], Fault | None],
        apply_fault: Callable[[Fault | None], None],
        describe_faults: Callable[[], dict[str, Any]],
        health_hangs: Callable[[], bool],
        kv_events: KvEventPublisher | None = None,
    ) -> None:
        self._options = options
        self._core = core
        self._counters = counters
        self._draw_fault = draw_fault
        self._apply_fault = apply_fault
        self._describe_faults = describe_faults
        self._health_hangs = health_hangs
        self.closing = asyncio.Event()
        self.responses = ResponseStore(options.responses_store)
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("GET", "/sim/stats"): self._stats,
            ("GET", "/sim/first-tokens"): self._first_tokens,
            ("GET", "/sim/faults"): self._get_faults,
            ("POST", "/sim/faults"): self._set_faults,
            ("DELETE", "/sim/faults"): self._clear_faults,
        }
        for path, api in ENGINE_APIS.items():
            self._routes[("POST", path)] = functools.partial(self._engine_api, api)
        if options.flavor == "sglang":
            self._routes |= {
                ("GET", "/health_generate"): self._health,
                ("GET", "/v1/loads"): self._loads,
                ("GET", "/get_load"): self._legacy_load,
                ("POST", "/flush_cache"): self._reset_prefix_cache,
            }
        else:
            self._routes[("POST", "/reset_prefix_cache")] = self._reset_prefix_cache
            self._routes[("POST", "/v1/responses")] = self._responses
        if kv_events is not None:
            self._routes |= kv_event_fault_routes(core, kv_events)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        if handler is None and self._stores_responses(scope["path"]):
            handler = self._stored_response
        if handler is None:
            known = any(path == scope["path"] for _, path in self._routes)
            status = 405 if known else 404
            await self._error(
                send,
                ApiError(
                    status,
                    f"{scope['method']} {scope['path']} "
                    + ("not allowed" if known else "not found"),
                ),
            )
            return
        await handler(scope, receive, send)

    def _stores_responses(self, path: str) -> bool:
        return (
            self._options.flavor == "vllm"
            and path.startswith(STORED_RESPONSES)
            and len(path) > len(STORED_RESPONSES)
        )

    async def _error(self, send: Send, error: ApiError, headers: list | None = None) -> None:
        body = orjson.dumps(error.body(self._options.flavor))
        await _respond(send, error.status, body, [*_JSON, *(headers or [])])

    # --- plain endpoints -------------------------------------------------------------

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._health_hangs():  # the `hang_health` fault: no answer until the prober leaves
            async with DisconnectWatch(receive, lambda: None) as watch:
                await watch.sleep(None, self.closing)
            return
        await _respond(send, 503 if self.closing.is_set() else 200, b"", [])

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        text = render_metrics(self._options, self._core, self._counters)
        await _respond(
            send,
            200,
            text.encode(),
            [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
        )

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = self._options.flavor
        data = [
            {
                "id": name,
                "object": "model",
                "created": now_seconds(),
                "owned_by": owner,
                "root": name,
                "parent": None,
                "max_model_len": self._options.context_length,
            }
            for name in self._options.models
        ]
        await _respond(send, 200, orjson.dumps({"object": "list", "data": data}))

    async def _loads(self, scope: Scope, receive: Receive, send: Send) -> None:
        core = self._core
        capacity = self._options.kv_blocks * self._options.block_size
        queries = self._counters.prefix_queries
        load = {
            "dp_rank": 0,
            "num_running_reqs": len(core.running),
            "num_waiting_reqs": len(core.waiting),
            "num_waiting_uncached_tokens": sum(len(r.all_tokens) for r in core.waiting),
            "num_used_tokens": core.num_used_tokens,
            "num_total_tokens": core.num_used_tokens + sum(len(r.all_tokens) for r in core.waiting),
            "max_total_num_tokens": capacity,
            "max_running_requests": self._options.max_num_seqs,
            "token_usage": core.pool.usage,
            "gen_throughput": 0.0,
            "cache_hit_rate": self._counters.prefix_hits / queries if queries else 0.0,
            "utilization": len(core.running) / self._options.max_num_seqs,
        }
        body = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version": "sim",
            "loads": [load],
        }
        await _respond(send, 200, orjson.dumps(body))

    async def _legacy_load(self, scope: Scope, receive: Receive, send: Send) -> None:
        core = self._core
        load = {
            "dp_rank": 0,
            "num_reqs": len(core.running) + len(core.waiting),
            "num_waiting_reqs": len(core.waiting),
            "num_tokens": core.num_used_tokens + sum(len(r.all_tokens) for r in core.waiting),
        }
        await _respond(send, 200, orjson.dumps([load]))

    async def _reset_prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._core.reset_prefix_cache()
        await _respond(send, 200, b"", [])

    async def _stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        core = self._core
        body = {
            **self._counters.as_json(),
            "num_running": len(core.running),
            "num_waiting": len(core.waiting),
            "kv_cache_usage": core.pool.usage,
            "responses_stored": len(self.responses),
        }
        await _respond(send, 200, orjson.dumps(body))

    async def _first_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = {"first_tokens": self._counters.first_tokens_json()}
        await _respond(send, 200, orjson.dumps(body))

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, orjson.dumps(self._describe_faults()))

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            fault = Fault.from_json(orjson.loads(await _read_body(receive)))
        except (ValueError, orjson.JSONDecodeError) as error:
            await self._error(send, ApiError(400, str(error)))
            return
        await _respond(send, 200, orjson.dumps({"fault": fault.as_json()}))
        # Applied after answering: a `refuse` fault closes this very connection.
        self._apply_fault(fault)

    async def _clear_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._apply_fault(None)
        await _respond(send, 200, orjson.dumps({"fault": None}))

    # --- inference -------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._inference(scope, receive, send, CHAT)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._inference(scope, receive, send, COMPLETION)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._inference(scope, receive, send, "embedding")

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._inference(scope, receive, send, RESPONSE)

    async def _stored_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Retrieve or cancel a stored response (counted as a request received)."""
        self._record_arrival(scope, await _read_body(receive))
        try:
            answer = self.responses.answer(
                self._core, scope["method"], scope["path"], scope["query_string"]
            )
        except ApiError as error:
            await self._error(send, error)
            return
        await _respond(send, 200, orjson.dumps(answer))

    async def _engine_api(self, api: EngineApi, scope: Scope, receive: Receive, send: Send) -> None:
        """One of the engine's own JSON APIs (counted as a request received, never faulted)."""
        body = self._record_arrival(scope, await _read_body(receive))
        if body is None:
            await self._error(send, ApiError(400, "request body is not valid JSON"))
            return
        try:
            answer = api(body, self._options, VOCABULARY)
        except ApiError as error:
            await self._error(send, error)
            return
        await _respond(send, 200, orjson.dumps(answer))

    def _header_request_id(self, scope: Scope) -> str | None:
        """The X-Request-Id that names a request on vLLM (ahead of the body's `request_id`)."""
        if self._options.flavor != "vllm":
            return None
        for key, value in scope["headers"]:
            if key == b"x-request-id":
                return value.decode("latin-1")
        return None

    def _record_arrival(self, scope: Scope, raw_body: bytes) -> Any:
        """Count the request and keep its headers and body for /sim/stats; return the body."""
        try:
            body = orjson.loads(raw_body)
        except orjson.JSONDecodeError:
            body = None
        self._counters.requests_received += 1
        self._counters.last_request = {
            "path": scope["path"],
            "headers": {
                key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]
            },
            "body": body if body is not None else raw_body.decode("utf-8", "replace"),
        }
        return body

    async def _inference(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        arrival = asyncio.get_running_loop().time()
        raw_body = await _read_body(receive)
        body = self._record_arrival(scope, raw_body)
        fault = self._draw_fault()
        if fault is not None:
            self._counters.faults_applied += 1
            if not await self._before_answer(fault, receive, send):
                return
        if body is None:
            await self._error(send, ApiError(400, "request body is not valid JSON"))
            return
        generation: Generation
        try:
            if kind == "embedding":
                await _respond(send, 200, orjson.dumps(embeddings_response(body, self._options)))
                return
            if kind == RESPONSE:
                generation = parse_response_request(body, self._options, arrival, self.responses)
            else:
                generation = parse_generation(
                    kind, body, self._options, arrival, self._header_request_id(scope)
                )
        except ApiError as error:
            await self._error(send, error)
            return
        request = generation.request
        self._core.submit(request)
        if request.finished and fault is None:  # served immediately: nothing to watch
            await self._deliver(generation, send, None, None)
            return
        async with DisconnectWatch(receive, lambda: self._core.abort(request)) as watch:
            await self._deliver(generation, send, watch, fault)

    async def _before_answer(self, fault: Fault, receive: Receive, send: Send) -> bool:
        """Apply the faults that strike before any answer; False if nothing more is sent."""
        if fault.mode == "http_error":
            headers = (
                [(b"retry-after", str(fault.retry_after).encode())]
                if fault.retry_after is not None
                else []
            )
            await self._error(send, ApiError(fault.status, "injected fault"), headers)
            return False
        if fault.mode == "reset_before_first_byte":
            abort_connection(send)
            return False
        if fault.mode in ("hang", "slow_first_token"):
            delay = None if fault.mode == "hang" else fault.delay_ms / 1000
            async with DisconnectWatch(receive, lambda: None) as watch:
                return await watch.sleep(delay, self.closing)
        return True

    async def _deliver(
        self, generation: Generation, send: Send, watch: DisconnectWatch | None, fault: Fault | None
    ) -> None:
        if isinstance(generation, ResponseGeneration):  # of the faults in the answer, the crash
            crash_after = fault.tokens if fault and fault.mode == "crash_after_tokens" else None
            await deliver_response(
                generation,
                send,
                now_seconds(),
                self.responses,
                crash_after,
                functools.partial(self._crash, generation, send),
            )
        elif generation.stream:
            await self._stream(generation, send, watch, fault)
        else:
            await self._answer(generation, send, watch, fault)

    def _crash(self, generation: Generation, send: Send) -> None:
        self._core.abort(generation.request, by_client=False)
        abort_connection(send)

    async def _answer(
        self, generation: Generation, send: Send, watch: DisconnectWatch | None, fault: Fault | None
    ) -> None:
        request = generation.request
        mode = fault.mode if fault is not None else None
        trigger = fault.tokens if fault is not None else 0
        while not request.finished and (mode is None or len(request.output_tokens) < trigger):
            await request.wait_for_progress()
        if request.finish_reason == ABORTED:
            if watch is None or not watch.disconnected.is_set():
                await self._error(send, ApiError(503, "engine shutting down"))
            return
        if mode == "crash_after_tokens":
            self._crash(generation, send)
            return
        if mode == "malformed_sse":
            self._core.abort(request, by_client=False)
            await _respond(send, 200, b'{"id": "malformed')
            return
        if fault is not None and watch is not None and mode == "stall_after_tokens":
            await watch.sleep(fault.delay_ms / 1000, self.closing)
        while not request.finished:
            await request.wait_for_progress()
        await _respond(send, 200, orjson.dumps(full_response(generation, now_seconds())))

    async def _stream(
        self, generation: Generation, send: Send, watch: DisconnectWatch | None, fault: Fault | None
    ) -> None:
        """Relay tokens as SSE events; a stream fault fires after `fault.tokens` tokens
        (or at the last token, if the answer is shorter)."""
        request = generation.request
        created = now_seconds()
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        events: list[bytes] = []
        sglang = self._options.flavor == "sglang"
        # SGLang's chat streams end with a chunk of their own that carries the finish reason
        # and an empty delta; vLLM's carry it on the last content chunk.
        apart = sglang and generation.kind == CHAT
        if generation.kind == CHAT:
            events.append(_event(stream_chunk(generation, created, None, role=True, sglang=sglang)))
        mode = fault.mode if fault is not None else None
        trigger = fault.tokens if fault is not None else 0
        sent = 0
        released_chars = 0
        holdback = max(map(len, request.params.stop), default=1) - 1
        while True:
            available = len(request.output_tokens)
            upto = available
            fires = mode is not None and (available >= trigger or request.finished)
            if fires:
                upto = min(available, trigger)
            finished = request.finished and upto == available
            if finished and request.finish_reason == ABORTED:
                if watch is None or not watch.disconnected.is_set():
                    error = ApiError(503, "engine shutting down").body(self._options.flavor)
                    events += [_event(error), _DONE]
                    await send({"type": "http.response.body", "body": b"".join(events)})
                return
            new_tokens = request.output_tokens[sent:upto]
            sent = upto
            if holdback or request.text_limit is not None:
                text = "".join(request.output_tokens[:sent])
                limit = len(output_text(request)) if finished else len(text) - holdback
                pieces = [text[released_chars:limit]] if limit > released_chars else []
                released_chars = max(released_chars, limit)
            else:
                pieces = new_tokens
            if finished and not pieces and not apart:
                pieces = [""]
            last = len(pieces) - 1
            for index, piece in enumerate(pieces):
                reason = request.finish_reason if finished and index == last and not apart else None
                events.append(
                    _event(stream_chunk(generation, created, piece, reason, sglang=sglang))
                )
            if finished and apart:
                finish = stream_chunk(generation, created, None, request.finish_reason, sglang=True)
                events.append(_event(finish))
            if fires:
                await send(
                    {"type": "http.response.body", "body": b"".join(events), "more_body": True}
                )
                events = []
                if mode == "crash_after_tokens":
                    self._crash(generation, send)
                    return
                if mode == "malformed_sse":
                    events.append(_GARBAGE_EVENT)
                elif mode == "stall_after_tokens" and watch is not None and fault is not None:
                    await watch.sleep(fault.delay_ms / 1000, self.closing)
                mode = None
            if finished:
                if generation.include_usage:
                    events.append(_event(usage_chunk(generation, created)))
                events.append(_DONE)
                await send({"type": "http.response.body", "body": b"".join(events)})
                return
            if events and sent:  # as vLLM: the role chunk leaves with the first token
                await send(
                    {"type": "http.response.body", "body": b"".join(events), "more_body": True}
                )
                events = []
            await request.wait_for_progress()
