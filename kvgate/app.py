"""The gateway as one ASGI application, assembled from a Config.

Inference routes are plain ASGI (the hot path); the few operational routes answer small JSON or
text bodies. The upstream client and the health monitor live from lifespan startup to shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from collections.abc import Mapping

import orjson
from opentelemetry.sdk.trace.export import SpanExporter

from kvgate import response_routes
from kvgate.admin_listener import is_admin_route, unknown_route
from kvgate.asgi import JSON, Message, Receive, Scope, Send, send_bytes, send_error
from kvgate.chain.admin import AdminRoutes
from kvgate.chain.admission import AdmissionController, AdmissionStage
from kvgate.chain.auth import Authenticator, AuthStage, RevokedKey
from kvgate.chain.classify import Classifier, ClassifyStage
from kvgate.chain.model_routes import ModelRoutes, is_model_route
from kvgate.chain.pipeline import RequestChain
from kvgate.chain.responses_gate import ResponsesStage
from kvgate.chain.stored_responses import StoredResponseStage
from kvgate.chain.tenants import KeyRecord, TenantDirectory
from kvgate.config import Config, StateConfig
from kvgate.cors import with_cors
from kvgate.errors import KvgateError, MethodNotAllowed, Overloaded
from kvgate.fleet_admin import FleetAdminRoutes
from kvgate.ingress import (
    INFERENCE_ROUTES,
    ClientGone,
    parse_payload,
    read_body,
    request_context,
    stored_response_context,
)
from kvgate.observability.access_log import AccessLog
from kvgate.observability.cost import Pricing
from kvgate.observability.metrics import GatewayMetrics
from kvgate.observability.precise import PreciseCollector
from kvgate.observability.process import ProcessCollector
from kvgate.observability.resilience import BreakerStateCollector
from kvgate.observability.routing import RoutingCollector
from kvgate.observability.state import StateCollector
from kvgate.observability.tracing import build_tracing
from kvgate.request_options import REQUEST_ID, parse_request_options, request_id_from
from kvgate.routing.endpoints import Endpoint, Fleet, build_pool
from kvgate.routing.health import HealthMonitor
from kvgate.routing.policy_catalog import load_policies
from kvgate.routing.precise import PreciseRouting, TokenizeStage
from kvgate.routing.prefix_index import PrefixIndex
from kvgate.routing.response_ids import signing_key
from kvgate.routing.router import ModelFallbackStage, PickStage, build_router
from kvgate.routing.services import RoutingServices
from kvgate.routing.shared_index import SharedPrefixIndex
from kvgate.routing.telemetry import TelemetryScraper
from kvgate.state import MemoryStore, RedisStore, RedisStoreSettings, ReplicaLoad
from kvgate.types import Headers, RequestContext
from kvgate.upstream.control_client import build_control_client
from kvgate.upstream.forwarder import Forwarder
from kvgate.upstream.resilience import Resilience
from kvgate.upstream.transport import UpstreamTransport

log = logging.getLogger("kvgate")

_STARTUP_PROBE_SECONDS = 3.0
_OPERATIONAL_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
# The route label of a request for a path the gateway does not serve.
UNKNOWN_ROUTE = "unknown"
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"


def build_store(config: StateConfig) -> MemoryStore | RedisStore:
    if config.backend == "memory":
        return MemoryStore()
    assert config.url is not None
    return RedisStore(
        RedisStoreSettings(
            url=config.url,
            prefix=config.key_prefix,
            op_timeout=config.op_timeout,
            heartbeat_interval=config.heartbeat_interval,
            snapshot_interval=config.snapshot_interval,
            stream_maxlen=config.stream_maxlen,
            max_connections=config.max_connections,
            idle_timeout=config.idle_timeout,
        )
    )


class GatewayApp:
    """Assembled from a validated Config; raises ConfigError when a pool's routing policy
    cannot be loaded (`kvgate check-config` reports the same problems). `metrics` is the
    process's instruments when an app built from an earlier config hands them on (reload).
    `span_exporter` receives the spans in place of the configured exporter when tracing is
    on (tests read them in memory)."""

    def __init__(
        self,
        config: Config,
        metrics: GatewayMetrics | None = None,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        self.config = config
        # Set when the process starts to drain (SIGTERM): /readyz answers 503 from then on.
        self.draining = False
        self._drain_end: asyncio.TimerHandle | None = None
        self.fleet = Fleet(
            (build_pool(p, config.routing) for p in config.pools), config.health.panic_threshold
        )
        self.store = build_store(config.state)
        self.routing = RoutingServices.from_config(
            config.routing,
            config.classification.chars_per_token,
            functools.partial(
                SharedPrefixIndex, self.store, {e.name: e.url for e in self.fleet.endpoints}
            )
            if config.state.backend == "redis"
            else PrefixIndex,
        )
        self.routing.index.add_endpoints(e.name for e in self.fleet.endpoints)
        precise = PreciseRouting(self.fleet, config)  # KV events, where pools configure them
        self.routing.precise = precise if precise.configured else None
        self.picker = build_router(self.fleet, load_policies(config), self.routing)
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.metrics.configure(config)
        self.pricing = Pricing(config.pools, self.fleet.endpoints)
        self.access_log = AccessLog(enabled=config.server.access_log)
        # The HTTP side of the app, behind the CORS protocol when `server.cors` is set.
        # `kvgate serve` calls it directly (`hot_reload.py`), a call fewer than `__call__`.
        cors = config.server.cors
        self.serve_http = self._http if cors is None else with_cors(self._http, cors)
        # None unless `observability.tracing` (or OTEL_*) turns tracing on.
        self.tracing = build_tracing(
            config.observability.tracing,
            span_exporter,
            self.metrics.trace_spans_dropped.inc,
            self.metrics.trace_exporter_restarts.inc,
        )
        self.tenants = TenantDirectory(config.auth, config.tiers)
        self.key_checker = Authenticator(self.tenants)
        self.classifier = Classifier(config.classification)
        self.admission = AdmissionController(
            self.picker,
            self.store.quotas,
            self.classifier,
            config.admission,
            self.metrics.admission,
        )
        self.models = ModelRoutes(self.fleet, self.tenants, config.server.models_require_key)
        # With `server.admin_port` set, /metrics and /admin/* are served only there
        # (kvgate/admin_listener.py) and are unknown routes on this, the public port.
        self.admin_on_public_port = config.server.admin_port is None
        # httpx for the control plane (health, discovery, telemetry); the data path has its own
        # HTTP/1.1 client (kvgate/upstream/transport.py).
        self.client = build_control_client(config.upstream, config.timeouts)
        self.transport = UpstreamTransport(config.upstream, config.timeouts.connect)
        # Breakers on every endpoint, retry budgets and throttles per pool (docs/resilience.md).
        self.resilience = Resilience(config, self.fleet, self.metrics.resilience)
        self.admin = FleetAdminRoutes(
            config,
            self.fleet,
            self.resilience,
            self.routing.index,
            AdminRoutes(
                self.tenants,
                self.classifier,
                self.admission,
                config.classification,
            ),
            self._index_mode,
        )
        # This app's state, read at scrape time (per process: docs/observability.md).
        self.views = (
            RoutingCollector(self.fleet, self.routing),
            StateCollector(self.store, self.fleet),
            BreakerStateCollector(self.resilience),
            PreciseCollector(self.routing),
            ProcessCollector(),
        )
        self.health = HealthMonitor(
            self.fleet, self.client, config.health, on_recovered=self._endpoint_recovered
        )
        self.telemetry = TelemetryScraper(
            self.fleet,
            self.client,
            config.routing.scrape_interval,
            config.routing.scrape_timeout,
            self.routing.size_index,
        )
        forward = Forwarder(
            self.transport,
            config.timeouts,
            config.upstream.max_error_body_bytes,
            self.resilience,
            picker=self.picker,
        )
        response_ids_key = signing_key(config.auth.response_id_secret if config.auth else None)
        self.chain = RequestChain(
            stages=[
                AuthStage(self.tenants, self.fleet.home_engine),  # 401 / 403; tenant, cache salt
                # 404 for /v1/responses where no engine serves it; previous_response_id: 404
                # / 503, else pinned to the endpoint that stores it
                ResponsesStage(self.fleet, response_ids_key),
                ClassifyStage(self.classifier),  # Intent: class, deadline, priority
                ModelFallbackStage(self.picker),  # a smaller model when the pool is saturated
                # precise routing: the prompt's token ids, off the event loop where possible
                *([TokenizeStage(precise)] if self.routing.precise is not None else []),
                AdmissionStage(self.admission),  # 429 quotas; waits or 503 when saturated
                PickStage(self.picker),  # the endpoint (prefix/KV aware), or the pinned one
            ],
            forward=forward,
            settle=self._settle,
            tracing=self.tracing,
        )
        # /v1/responses/{id}[/...] (retrieve, cancel): no model, no generation; the id names
        # the one endpoint that can answer (kvgate/chain/stored_responses.py says what else
        # these routes skip, and why).
        self.stored_chain = RequestChain(
            stages=[
                AuthStage(self.tenants),  # 401; tenant
                # 404 / 503; the endpoint
                StoredResponseStage(self.fleet, self.admission, response_ids_key),
            ],
            forward=forward,
            settle=self._settle,
            tracing=self.tracing,
        )

    def _endpoint_recovered(self, endpoint: Endpoint) -> None:
        """The health monitor saw `endpoint` pass its check after failing it."""
        self.resilience.health_recovered(endpoint)
        self.routing.endpoint_recovered(endpoint)

    def _index_mode(self, endpoint: str) -> tuple[str, str] | None:
        """The endpoint's prefix-index mode for the admin API (None: no KV events)."""
        precise = self.routing.precise
        return precise.mode(endpoint) if precise is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.serve_http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = INFERENCE_ROUTES.get(scope["path"])
        if route is None and scope["path"].endswith("/") and scope["path"] != "/":
            # `/v1/chat/completions/`: engines served by FastAPI (vLLM, SGLang) redirect
            # it to the path without the slash, which clients follow; served as that path.
            scope = {**scope, "path": scope["path"].rstrip("/") or "/"}
            route = INFERENCE_ROUTES.get(scope["path"])
        if route is not None:
            await self._inference(route, scope, receive, send)
            return
        named = response_routes.split(scope["path"])
        if named is not None:
            await self._stored_response(scope, receive, send, *named)
            return
        request_id = request_id_from(scope["headers"])
        send = _with_request_id(send, request_id)
        if is_model_route(scope["path"]):
            await self.models(scope, send)
        elif not self.admin_on_public_port and is_admin_route(scope["path"]):
            await self._unknown(request_id, unknown_route(scope), send)
        elif scope["path"].startswith("/admin/"):
            await self.admin(scope, receive, send)
        else:
            await self._operational(scope, send, request_id)

    async def _unknown(self, request_id: str, error: KvgateError, send: Send) -> None:
        """Answer a request for a route the gateway does not serve: counted and logged (route
        `unknown`), as a proxy logs every request, so that scans and misdirected clients show.
        `send` already puts the request id on the answer."""
        await self._answer_refused(UNKNOWN_ROUTE, request_id, error, send, [])

    async def startup(self) -> None:
        if self.config.auth is None:
            log.warning(
                "NO AUTHENTICATION: the config has no 'auth:' section, so every client "
                "is served as the anonymous tenant. Add tenants with API keys, or write "
                "'auth: none' to make an open gateway explicit."
            )
        salted = salted_precise_tenants(self.config)
        if salted:
            assert self.config.auth is not None
            mixed = len(salted) < len(self.config.auth.tenants)
            log.warning(
                "precise routing (kv_events) applies only to requests without a tenant cache "
                "salt: tenants %s use cache_isolation: tenant, so their requests are routed by "
                "the approximate index (set cache_isolation: shared for tenants that may share "
                "cached prefixes; docs/routing.md)%s",
                ", ".join(salted),
                (
                    "; the blocks their requests fill are in the engines' events as anyone's, "
                    "so a shared tenant's prompt may be priced a hit on them that the engine "
                    "will not give it (salted blocks match salted requests only)"
                    if mixed
                    else ""
                ),
            )
        try:
            async with asyncio.timeout(_STARTUP_PROBE_SECONDS):
                await asyncio.gather(self.health.check_once(), self.telemetry.scrape_once())
        except TimeoutError:
            log.warning("initial health probe did not finish in %.0f s", _STARTUP_PROBE_SECONDS)
        self.health.start()
        self.telemetry.start()
        if self.routing.precise is not None:
            self.routing.precise.start()
        self.store.report_load(self._local_load, self._apply_peer_load)
        await self.store.start()
        if self.tracing is not None:
            await self.tracing.open()
        # What exists now lives as long as the gateway: keep the collector from walking it on
        # every full collection (the prefix index alone can hold millions of entries).
        gc.collect()
        gc.freeze()

    def begin_drain(self, grace: float) -> None:
        """The process is going away: from now on /readyz answers 503 and waiting and new
        requests get 503 `draining`; requests still running `grace` seconds from now are
        ended (a stream with an error event as its last). Call on the event loop."""
        if self.draining:
            return
        self.draining = True
        self.admission.drain()
        self._drain_end = asyncio.get_running_loop().call_later(grace, self._end_drain)

    def _end_drain(self) -> None:
        error = Overloaded(
            "This gateway shut down before the answer was complete; retry the request",
            code="drain_timeout",
            retry_after=1,
        )
        ended = self.chain.end_requests(error) + self.stored_chain.end_requests(error)
        if ended:
            log.warning("drain time is up: ended %d request(s) still running", ended)

    async def shutdown(self) -> None:
        if self._drain_end is not None:
            self._drain_end.cancel()
        gc.unfreeze()
        await self.admission.stop()
        await self.store.stop()
        await self.telemetry.stop()
        if self.routing.precise is not None:
            await self.routing.precise.stop()
        await self.health.stop()
        await self.client.aclose()
        await self.transport.aclose()
        if self.tracing is not None:
            # Waits for the exporter process to send what it holds; the event loop still serves.
            await self.tracing.shutdown()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _inference(self, route: str, scope: Scope, receive: Receive, send: Send) -> None:
        # The body and the parsed payload live in the context alone (not in this frame, which
        # lasts as long as the request), so the context can let go of them (release_prompt).
        ctx = await self._ingress(route, scope, receive, send)
        if ctx is not None:
            await self.chain.handle(ctx, scope, receive, send)

    async def _ingress(
        self, route: str, scope: Scope, receive: Receive, send: Send
    ) -> RequestContext | None:
        """Ingress: every client input (method, body, schema, option headers) is checked here,
        before any stage takes quota, a queue place or an engine. None: the request was
        refused (and answered) or its client left."""
        started = time.perf_counter()
        headers = scope["headers"]
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(
                    f"{scope['method']} is not allowed on {scope['path']}; use POST",
                    code="method_not_allowed",
                )
            # The key first: a body is read and parsed (its CPU) only for a client with one.
            key = self._verified_key(headers)
            server = self.config.server
            body = await read_body(headers, receive, server.max_body_bytes, server.body_timeout)
            payload, _, _ = parse_payload(route, body)
            ctx = request_context(
                route,
                payload,
                headers=headers,
                body=body,
                upstream_path=scope["path"],
                chars_per_token=self.config.classification.chars_per_token,
                media_tokens=self.config.classification.media_tokens,
                options=parse_request_options(headers),
                started=started,
            )
            ctx.verified_key = key
        except ClientGone:
            return None
        except KvgateError as error:
            await self._refused(route, headers, error, send, b"POST")
            return None
        return ctx

    async def _stored_response(
        self, scope: Scope, receive: Receive, send: Send, response_id: str, rest: str
    ) -> None:
        """A `/v1/responses/{id}` route (`rest`: its path after the id): its ingress (method,
        body size, option headers; the body is not parsed, it is forwarded as it came), then
        its chain."""
        started = time.perf_counter()
        headers = scope["headers"]
        method = scope["method"]
        route = response_routes.route_of(method, rest)
        try:
            if method not in response_routes.METHODS:
                raise MethodNotAllowed(
                    f"{method} is not allowed on {scope['path']}; use "
                    + ", ".join(response_routes.METHODS),
                    code="method_not_allowed",
                )
            response_routes.check_subpath(rest, scope.get("raw_path"))
            key = self._verified_key(headers)
            server = self.config.server
            body = await read_body(headers, receive, server.max_body_bytes, server.body_timeout)
            ctx = stored_response_context(
                scope,
                body,
                response_id,
                rest,
                route,
                chars_per_token=self.config.classification.chars_per_token,
                started=started,
            )
            ctx.verified_key = key
        except ClientGone:
            return
        except KvgateError as error:
            allowed = ", ".join(response_routes.METHODS).encode()
            await self._refused(route, headers, error, send, allowed)
            return
        await self.stored_chain.handle(ctx, scope, receive, send)

    def _verified_key(self, headers: Headers) -> KeyRecord | None:
        """The client's key, checked (401 / 403 raised) before its body is read; None on an
        open gateway."""
        if self.tenants.open:
            return None
        return self.key_checker.verify(headers)

    async def _refused(
        self, route: str, headers: Headers, error: KvgateError, send: Send, allowed: bytes
    ) -> None:
        """Answer a request refused at ingress; `allowed`: the methods the route takes."""
        request_id = request_id_from(headers)
        extra = [(REQUEST_ID, request_id.encode())]
        if isinstance(error, MethodNotAllowed):
            extra.append((b"allow", allowed))
        await self._answer_refused(route, request_id, error, send, extra)

    async def _answer_refused(
        self, route: str, request_id: str, error: KvgateError, send: Send, extra: Headers
    ) -> None:
        """Send `error` (with the `extra` headers), count it and log it."""
        await send_error(send, error, extra)
        self.metrics.observe_rejected(route, error.status, str(error.code))
        key_id = error.key_id if isinstance(error, RevokedKey) else None
        self.access_log.rejected(request_id, route, error, key_id)

    def _local_load(self) -> dict[str, ReplicaLoad]:
        """This replica's load on each engine, by URL (names are positions in a config; see
        kvgate/routing/shared_index.py). An engine in two pools sums both."""
        loads: dict[str, ReplicaLoad] = {}
        for e in self.fleet.endpoints:
            load = ReplicaLoad(e.inflight, e.prefill_tokens)
            loads[e.url] = loads[e.url] + load if e.url in loads else load
        return loads

    def _apply_peer_load(self, peers: Mapping[str, ReplicaLoad]) -> None:
        none = ReplicaLoad()
        for endpoint in self.fleet.endpoints:
            load = peers.get(endpoint.url, none)
            endpoint.peer_inflight = load.inflight
            endpoint.peer_queued_tokens = load.queued_tokens

    def _settle(self, ctx: RequestContext) -> None:
        self.routing.feedback.observe(ctx)
        cost = self.pricing.cost(ctx)
        self.metrics.observe(ctx, self.fleet, cost)
        self.access_log.finished(ctx, cost)

    async def _operational(self, scope: Scope, send: Send, request_id: str) -> None:
        path = scope["path"]
        if path not in _OPERATIONAL_ROUTES:
            await self._unknown(request_id, unknown_route(scope), send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await send_error(
                send,
                MethodNotAllowed(f"{scope['method']} is not allowed on {path}; use GET"),
                [(b"allow", b"GET")],
            )
            return
        if path == "/healthz":
            await send_bytes(send, 200, b'{"status":"ok"}', JSON)
        elif path == "/readyz":
            unready = self.fleet.unready_pools()
            if self.draining:
                await send_bytes(send, 503, b'{"status":"draining"}', JSON)
            elif unready:
                body = {"status": "unready", "pools_without_healthy_endpoint": unready}
                await send_bytes(send, 503, orjson.dumps(body), JSON)
            elif self.routing.precise is not None:
                # Still ready: an endpoint that lost its events is routed approximately.
                approximate = self.routing.precise.approximate_endpoints()
                body = {"status": "ready", "approximate_endpoints": approximate}
                await send_bytes(send, 200, orjson.dumps(body), JSON)
            else:
                await send_bytes(send, 200, b'{"status":"ready"}', JSON)
        else:
            await send_bytes(send, 200, self.metrics.render(self.views), _PROMETHEUS)


def salted_precise_tenants(config: Config) -> list[str]:
    """Tenants whose requests carry a cache salt when some pool routes on KV events: the
    events carry token ids, not salts, so those requests cannot be routed precisely."""
    if config.auth is None or not any(
        pool.kv_events_of(endpoint) is not None
        for pool in config.pools
        for endpoint in pool.endpoints
    ):
        return []
    return [t.name for t in config.auth.tenants if t.cache_isolation == "tenant"]


def _with_request_id(send: Send, request_id: str) -> Send:
    """`send` with an `x-request-id` on the answer's head, as every inference answer has: the
    client's when it is sane, else a fresh one."""
    header = (REQUEST_ID, request_id.encode())

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), header]}
        await send(message)

    return sending
