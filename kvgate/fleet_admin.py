"""Admin routes over the fleet and the config, for operators holding an admin key.

    GET  /admin/endpoints                  every endpoint: pool, URL, state, drained flag,
                                           telemetry, breaker, requests in flight, prefix index
    POST /admin/endpoints/{name}/drain     no new request goes to the endpoint; those in flight
                                           finish (until undrained or the process restarts;
                                           a reload keeps the flag)
    POST /admin/endpoints/{name}/undrain   it takes new requests again
    GET  /admin/config                     the effective config as JSON, every secret redacted

Every other `/admin/*` route goes to the request chain's admin routes (`kvgate/chain/admin.py`),
which also own the admin key check; `POST /admin/reload` is the reloading server's
(`kvgate/hot_reload.py`). Answers are small JSON bodies built at request time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from kvgate.asgi import JSON, Receive, Scope, Send, send_bytes, send_error
from kvgate.chain.admin import AdminRoutes
from kvgate.config import Config
from kvgate.errors import KvgateError, MethodNotAllowed, NotFound
from kvgate.routing.endpoints import Endpoint, Fleet
from kvgate.routing.prefix_index import PrefixIndex
from kvgate.types import Headers
from kvgate.upstream.breaker import BreakerState
from kvgate.upstream.resilience import Resilience
from kvgate.yaml_source import is_secret_name, without_credentials

log = logging.getLogger("kvgate.admin")

_ENDPOINTS = "/admin/endpoints"
_CONFIG = "/admin/config"
_ACTIONS = {"drain": True, "undrain": False}
REDACTED = "***"


class FleetAdminRoutes:
    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        resilience: Resilience,
        index: PrefixIndex,
        chain_routes: AdminRoutes,
        index_mode: Callable[[str], tuple[str, str] | None],
    ) -> None:
        """`index_mode(name)`: (`precise` | `approximate`, reason) for an endpoint with KV
        events configured, None for one routed by the approximate index by configuration."""
        self.config = config
        self.fleet = fleet
        self.resilience = resilience
        self.index = index
        self.chain_routes = chain_routes
        self.index_mode = index_mode

    def authorize(self, headers: Headers) -> str | None:
        """Raises (401/403) unless the headers carry an admin key or auth is open; the key's
        id (None on an open gateway)."""
        return self.chain_routes.authorize(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path != _CONFIG and path != _ENDPOINTS and not path.startswith(_ENDPOINTS + "/"):
            await self.chain_routes(scope, receive, send)
            return
        try:
            admin = self.authorize(scope["headers"])
            if path == _CONFIG:
                _only(method, "GET", path)
                body: object = {
                    "source": self.config.source,
                    "config": redacted_config(self.config),
                }
            elif path == _ENDPOINTS:
                _only(method, "GET", path)
                body = {"object": "list", "data": [self.describe(e) for e in self.fleet.endpoints]}
            else:
                body = self._drain_route(method, path, admin)
        except KvgateError as error:
            await send_error(send, error)
            return
        await send_bytes(send, 200, orjson.dumps(body), JSON)

    def _drain_route(self, method: str, path: str, admin: str | None) -> dict[str, object]:
        """`POST /admin/endpoints/{name}/drain` or `/undrain`: the endpoint's view after it;
        `admin`: the admin key's id, named in the log line (None: an open gateway)."""
        name, _, action = path[len(_ENDPOINTS) + 1 :].partition("/")
        if action not in _ACTIONS or not name:
            raise NotFound(f"Unknown route {method} {path}", code="unknown_url")
        _only(method, "POST", path)
        endpoint = self.fleet.endpoint(name)
        if endpoint is None:
            raise NotFound(
                f"No endpoint named '{name}' (GET {_ENDPOINTS} lists them)",
                param="name",
                code="unknown_endpoint",
            )
        drained = _ACTIONS[action]
        if endpoint.drained != drained:
            endpoint.drained = drained
            log.warning(
                "endpoint %s %s by %s",
                name,
                "drained" if drained else "undrained",
                "an admin (open gateway)" if admin is None else f"admin key {admin}",
            )
        return self.describe(endpoint)

    def describe(self, endpoint: Endpoint) -> dict[str, object]:
        """One endpoint as `GET /admin/endpoints` shows it."""
        now = time.monotonic()
        breaker = self.resilience.breakers[endpoint]
        breaker_state = breaker.refresh()
        telemetry = endpoint.telemetry
        mode = self.index_mode(endpoint.name)
        return {
            "name": endpoint.name,
            "pool": endpoint.pool,
            "url": without_credentials(endpoint.url),
            "engine": endpoint.engine,
            "models": sorted(endpoint.models),
            "state": _state(endpoint),
            "healthy": endpoint.healthy,
            "drained": endpoint.drained,
            "in_flight": endpoint.inflight + self.fleet.earlier_inflight(endpoint),
            "peer_in_flight": endpoint.peer_inflight,
            "telemetry": None
            if telemetry is None
            else {
                "running": telemetry.running,
                "waiting": telemetry.waiting,
                "kv_usage": telemetry.kv_usage,
                "age_seconds": round(now - telemetry.scraped_at, 3),
                "stale": endpoint.stale,
            },
            "breaker": {
                "state": breaker_state.value,
                "consecutive_failures": breaker.consecutive_failures,
                "ejections": breaker.ejections,
                "open_seconds_left": round(max(0.0, breaker.open_until - now), 3)
                if breaker_state is BreakerState.OPEN
                else 0.0,
                "held_seconds_left": round(max(0.0, breaker.held_until - now), 3),
            },
            "prefix_index": {
                "mode": mode[0] if mode is not None else "approximate",
                "mode_reason": mode[1] if mode is not None else "no kv_events configured",
                "blocks": self.index.entries(endpoint.name),
                "capacity": self.index.capacity(endpoint.name),
            },
        }


def _only(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise MethodNotAllowed(f"{method} is not allowed on {path}; use {allowed}")


def _state(endpoint: Endpoint) -> str:
    """`serving` when new requests may go there, else the first reason they do not."""
    if endpoint.drained:
        return "drained"
    if not endpoint.in_rotation:
        return "unhealthy"
    if not endpoint.breaker.admits():
        return "ejected"
    if not endpoint.routable:
        return "stale"
    return "serving"


def redacted_config(config: Config) -> dict[str, Any]:
    """The config as JSON with every secret replaced by `***`: strings under secret-like keys
    (API keys, key digests, the cache salt secret, passwords, tokens), every value of a
    `headers` mapping, and passwords and secret-like query parameters inside URLs."""
    dumped = _redacted(config.model_dump(mode="json"), "")
    assert isinstance(dumped, dict)
    return dumped


def _redacted(node: object, name: str) -> object:
    if isinstance(node, dict):
        if name == "headers":
            return dict.fromkeys(node, REDACTED)
        return {key: _redacted(value, str(key)) for key, value in node.items()}
    if isinstance(node, list):
        return [_redacted(value, name) for value in node]
    if isinstance(node, str):
        if node and is_secret_name(name):
            return REDACTED
        return without_credentials(node)
    return node
