"""Live engine telemetry: scrape `/metrics` of vLLM and SGLang engines and keep a small view.

Parsing reads Prometheus text exposition line by line and keeps only the few families routing
needs, under every name vLLM and SGLang have used for them (docs/routing.md lists them):
counters with or without `_total`; with data parallelism one series per `engine` (or rank)
label, which are summed (KV use is averaged: it is a fraction). Block size and pool size come
from `cache_config_info` labels.

Stale policy: telemetry older than `stale_after` seconds (3 missed scrapes by default) is not
used. What the gateway then does is `routing.stale_policy`: `local` routes on its own in-flight
accounting alone (the endpoint stays routable), `exclude` stops routing to the endpoint until a
scrape succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvgate.background import OwnedTask
from kvgate.routing.endpoints import Endpoint, Fleet

log = logging.getLogger("kvgate.telemetry")

# Family name (without `_total`) → signal.
_SIGNALS: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "sglang:num_running_reqs": "running",
    "vllm:num_requests_waiting": "waiting",
    "sglang:num_queue_reqs": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "sglang:token_usage": "kv_usage",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:gpu_prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:gpu_prefix_cache_hits": "prefix_hits",
    "sglang:cached_tokens": "prefix_hits",
    "vllm:prompt_tokens": "prompt_tokens",
    "sglang:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "sglang:generation_tokens": "generation_tokens",
    "vllm:cache_config_info": "cache_config",
    "sglang:cache_config_info": "cache_config",
}
_AVERAGED = frozenset({"kv_usage"})
_BLOCK_SIZE_LABELS = ("block_size", "page_size")
_BLOCK_COUNT_LABELS = ("num_gpu_blocks", "num_pages")


@dataclass(slots=True, frozen=True)
class EngineTelemetry:
    """One successful scrape. `prefix_queries` is None when the engine does not report it
    (SGLang: use `prompt_tokens` as the denominator of `prefix_hits`)."""

    scraped_at: float
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float | None = None
    prefix_hits: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None

    @property
    def kv_tokens(self) -> int | None:
        """KV cache capacity in tokens, when `cache_config_info` gave it."""
        if self.block_size is None or self.num_blocks is None:
            return None
        return self.block_size * self.num_blocks


class TelemetryParseError(ValueError):
    """The body is not engine metrics (no family routing knows)."""


def _labels(text: str) -> dict[str, str]:
    """Parse `a="x",b="y"` (escapes `\\"`, `\\\\`, `\\n` allowed in values)."""
    labels: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip().lstrip(",").strip()
        j = eq + 1
        if j >= n or text[j] != '"':
            break
        j += 1
        value: list[str] = []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                j += 1
                value.append("\n" if text[j] == "n" else text[j])
            else:
                value.append(text[j])
            j += 1
        labels[key] = "".join(value)
        i = j + 1
    return labels


def parse_metrics(text: str, scraped_at: float) -> EngineTelemetry:
    """Read the routing signals out of a Prometheus text exposition."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    block_size = num_blocks = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            label_text, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            name, label_text, rest = line[:space], "", line[space:]
        signal = _SIGNALS.get(name.removesuffix("_total"))
        if signal is None:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if signal == "cache_config":
            labels = _labels(label_text)
            size = next((labels[k] for k in _BLOCK_SIZE_LABELS if k in labels), None)
            blocks = next((labels[k] for k in _BLOCK_COUNT_LABELS if k in labels), None)
            if size is not None and size.isdigit():
                block_size = int(size)
            if blocks is not None and blocks.isdigit():
                num_blocks = (num_blocks or 0) + int(blocks)
            counts[signal] = counts.get(signal, 0) + 1
            continue
        if value != value:  # NaN
            continue
        sums[signal] = sums.get(signal, 0.0) + value
        counts[signal] = counts.get(signal, 0) + 1
    if not counts:
        raise TelemetryParseError("no vLLM or SGLang metric family in the body")
    for signal in _AVERAGED:
        if signal in sums:
            sums[signal] /= counts[signal]
    return EngineTelemetry(
        scraped_at=scraped_at,
        running=sums.get("running", 0.0),
        waiting=sums.get("waiting", 0.0),
        kv_usage=min(1.0, max(0.0, sums.get("kv_usage", 0.0))),
        prefix_queries=sums.get("prefix_queries"),
        prefix_hits=sums.get("prefix_hits", 0.0),
        prompt_tokens=sums.get("prompt_tokens", 0.0),
        generation_tokens=sums.get("generation_tokens", 0.0),
        block_size=block_size,
        num_blocks=num_blocks,
    )


class TelemetryScraper:
    """Scrapes every vLLM/SGLang endpoint's `/metrics` every `interval` on one background task
    and stores the result on `Endpoint.telemetry`. A failed scrape keeps the previous view,
    which turns stale on its own. `on_cache_config(endpoint, telemetry)` is called when an
    engine's KV size is first learnt or changes (the prefix index sizes itself from it)."""

    def __init__(
        self,
        fleet: Fleet,
        client: httpx.AsyncClient,
        interval: float,
        timeout: float,
        on_cache_config: Callable[[Endpoint, EngineTelemetry], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.on_cache_config = on_cache_config
        self.failures: dict[str, int] = {}
        self._task = OwnedTask("telemetry")

    @property
    def endpoints(self) -> list[Endpoint]:
        return [e for e in self.fleet.endpoints if e.engine in ("vllm", "sglang")]

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(e) for e in self.endpoints))

    async def _scrape(self, endpoint: Endpoint) -> None:
        headers = {"authorization": endpoint.auth_header.decode()} if endpoint.auth_header else {}
        try:
            response = await self.client.get(
                endpoint.url + "/metrics", headers=headers, timeout=self.timeout
            )
            if response.status_code != 200:
                raise TelemetryParseError(f"HTTP {response.status_code}")
            telemetry = parse_metrics(response.text, time.monotonic())
        except (httpx.HTTPError, TelemetryParseError) as exc:
            count = self.failures.get(endpoint.name, 0) + 1
            self.failures[endpoint.name] = count
            if count == 3:
                log.warning(
                    "metrics of %s unavailable (%s): telemetry goes stale",
                    endpoint.name,
                    type(exc).__name__,
                )
            return
        previous = endpoint.telemetry
        self.failures[endpoint.name] = 0
        endpoint.observe_telemetry(telemetry)
        changed = previous is None or (previous.kv_tokens != telemetry.kv_tokens)
        if changed and telemetry.kv_tokens is not None and self.on_cache_config is not None:
            self.on_cache_config(endpoint, telemetry)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape_once()

    def start(self) -> None:
        self._task.start(self._run())

    async def stop(self) -> None:
        await self._task.stop()
