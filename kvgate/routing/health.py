"""Active health checks and model discovery for every endpoint, on a background task."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import orjson

from kvgate.background import OwnedTask
from kvgate.config import HealthConfig
from kvgate.routing.endpoints import MODEL_CARD_FIELDS, Endpoint, Fleet

log = logging.getLogger("kvgate.health")


@dataclass(slots=True)
class _Streak:
    """Consecutive probe results of one endpoint."""

    failures: int = 0
    successes: int = 0
    probed: bool = False
    judged_at: float | None = None  # when the previous probe's result was counted


class HealthMonitor:
    """Probes each endpoint's health route every `interval` and its `/v1/models` every
    `discovery_interval`; updates `Endpoint.healthy` / `discovered_models` and refreshes the
    fleet's candidate map when anything changed. Never touches in-flight accounting.

    As Envoy: an endpoint turns unhealthy after `unhealthy_threshold` failed probes in a row
    and healthy after `healthy_threshold` good ones; the first probe of an endpoint decides
    alone. Passive evidence wins: an endpoint where an attempt succeeded since the previous
    probe's result, or within the last probe interval plus the probe timeout when that reaches
    further back, is not marked unhealthy, however its probes fare."""

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
        self._streaks: dict[str, _Streak] = {}

    async def check_once(self, discover: bool = True) -> None:
        results = await asyncio.gather(*(self._probe(e, discover) for e in self.fleet.endpoints))
        if any(results):
            self.fleet.refresh()

    async def _probe(self, endpoint: Endpoint, discover: bool) -> bool:
        """Probe one endpoint; True when its health or model list changed."""
        ok = await self._get_ok(endpoint, endpoint.health_path) is not None
        changed = self.judge(endpoint, ok)
        if ok and discover:
            body = await self._get_ok(endpoint, "/v1/models")
            cards = _model_cards(body) if body is not None else None
            if cards is not None:
                endpoint.model_cards = cards
                models = frozenset(cards)
                if models != endpoint.discovered_models:
                    endpoint.discovered_models = models
                    changed = True
        return changed

    def judge(self, endpoint: Endpoint, ok: bool, now: float | None = None) -> bool:
        """Count one probe result of `endpoint` and apply the thresholds; True when
        `endpoint.healthy` changed."""
        streak = self._streaks.setdefault(endpoint.name, _Streak())
        first = not streak.probed
        streak.probed = True
        now = time.monotonic() if now is None else now
        previous, streak.judged_at = streak.judged_at, now
        if not ok and not endpoint.healthy and not first and self._serving(endpoint, now, previous):
            # Passive evidence counts both ways: an endpoint routed in panic whose answers
            # succeed is serving, whatever its health route says (a /health that hangs while
            # the engine works would otherwise keep it, and /readyz, out for good).
            ok = True
        if ok:
            streak.successes, streak.failures = streak.successes + 1, 0
        else:
            streak.failures, streak.successes = streak.failures + 1, 0
        if endpoint.healthy:
            if ok or (not first and streak.failures < self.config.unhealthy_threshold):
                return False
            if self._serving(endpoint, now, previous):
                return False
        elif not ok or (not first and streak.successes < self.config.healthy_threshold):
            return False
        endpoint.healthy = ok
        log.warning(
            "endpoint %s is now %s (%d %s probe(s) in a row)",
            endpoint.name,
            "healthy" if ok else "unhealthy",
            streak.successes if ok else streak.failures,
            "good" if ok else "failed",
        )
        if ok and self.on_recovered is not None:
            self.on_recovered(endpoint)
        return True

    def _serving(self, endpoint: Endpoint, now: float, previous: float | None) -> bool:
        """Passive evidence: an attempt succeeded there since about the previous probe. A
        gateway too busy to probe on time (its event loop starved of CPU) probes less often
        than `interval`; counting from the previous result keeps its own delay from being
        taken for the engine's silence."""
        since = now - self.config.interval - self.config.timeout
        if previous is not None:
            since = min(since, previous)
        return endpoint.last_success > since

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


def _model_cards(body: bytes) -> dict[str, dict[str, object]] | None:
    """The models of a `/v1/models` answer, each with the fields clients read
    (`MODEL_CARD_FIELDS`); None when the answer is not a model list."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(data, list):
        return None
    return {
        m["id"]: {k: m[k] for k in MODEL_CARD_FIELDS if m.get(k) is not None}
        for m in data
        if isinstance(m, dict) and isinstance(m.get("id"), str)
    }
