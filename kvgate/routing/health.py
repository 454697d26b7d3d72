"""Active health checks and model discovery for every endpoint, on a background task."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
import orjson

from kvgate.background import OwnedTask
from kvgate.config import HealthConfig
from kvgate.routing.endpoints import Endpoint, Fleet

log = logging.getLogger("kvgate.health")


class HealthMonitor:
    """Probes each endpoint's health route every `interval` and its `/v1/models` every
    `discovery_interval`; updates `Endpoint.healthy` / `discovered_models` and refreshes the
    fleet's candidate map when anything changed. Never touches in-flight accounting."""

    def __init__(
        self,
        fleet: Fleet,
        client: httpx.AsyncClient,
        config: HealthConfig,
        on_recovered: Callable[[Endpoint], None] | None = None,
    ) -> None:
        self.fleet = fleet
        # Called when an endpoint passes its check after failing it (ends a breaker ejection).
        self.on_recovered = on_recovered
        self.client = client
        self.config = config
        self._task = OwnedTask("health-monitor")

    async def check_once(self, discover: bool = True) -> None:
        results = await asyncio.gather(*(self._probe(e, discover) for e in self.fleet.endpoints))
        if any(results):
            self.fleet.refresh()

    async def _probe(self, endpoint: Endpoint, discover: bool) -> bool:
        """Probe one endpoint; True when its health or model list changed."""
        changed = False
        healthy = await self._get_ok(endpoint, endpoint.health_path) is not None
        if healthy != endpoint.healthy:
            log.warning(
                "endpoint %s is now %s", endpoint.name, "healthy" if healthy else "unhealthy"
            )
            endpoint.healthy = healthy
            if healthy and self.on_recovered is not None:
                self.on_recovered(endpoint)
            changed = True
        if healthy and discover:
            body = await self._get_ok(endpoint, "/v1/models")
            models = _model_ids(body) if body is not None else None
            if models is not None and models != endpoint.discovered_models:
                endpoint.discovered_models = models
                changed = True
        return changed

    async def _get_ok(self, endpoint: Endpoint, path: str) -> bytes | None:
        headers = {"authorization": endpoint.auth_header.decode()} if endpoint.auth_header else {}
        try:
            response = await self.client.get(
                endpoint.url + path, headers=headers, timeout=self.config.timeout
            )
        except httpx.HTTPError:
            return None
        return response.content if response.status_code == 200 else None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_discovery = loop.time() + self.config.discovery_interval
        while True:
            await asyncio.sleep(self.config.interval)
            discover = loop.time() >= next_discovery
            if discover:
                next_discovery = loop.time() + self.config.discovery_interval
            await self.check_once(discover)

    def start(self) -> None:
        self._task.start(self._run())

    async def stop(self) -> None:
        await self._task.stop()


def _model_ids(body: bytes) -> frozenset[str] | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(data, list):
        return None
    return frozenset(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
