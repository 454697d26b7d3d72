"""Config section `routing:`: telemetry scraping, stale policy, prefix index, saturation,
session affinity and who may see routing explanations; and a pool's precise-routing keys
(`kv_events`, `tokenizer`). Validated once at load."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

StalePolicy = Literal["local", "exclude"]
ExplainMode = Literal["admin", "always", "never"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PrefixIndexConfig(_Strict):
    """`block_chars` bytes of prompt text per hashed block (≈ 16 tokens at 64); at most
    `max_blocks` blocks hashed per prompt (2048 x 64 = 128k characters, ≈ 32k tokens: hashing
    all of them once costs ≈ 0.4 ms, within one decision's budget, and past them the index
    cannot tell apart prompts that share a head, such as agents under one long system prompt);
    per endpoint at most
    `default_capacity` blocks until the engine reports its KV size, never more than
    `max_capacity`; entries untouched for `ttl` seconds are dropped."""

    block_chars: int = Field(64, ge=8, le=4096)
    max_blocks: int = Field(2048, ge=1, le=8192)
    default_capacity: int = Field(31_250, ge=1)
    max_capacity: int = Field(1_000_000, ge=1)
    ttl: float = Field(600.0, gt=0)


class SaturationConfig(_Strict):
    """An endpoint is saturated when fresh telemetry shows more than `max_waiting` queued
    requests or KV use above `max_kv_usage` (or its `max_inflight` cap is reached).

    The engine's own queue is the signal: between scrapes the gateway carries the waiting
    count forward by the streams it sees join and leave the queue. KV use cannot be carried
    forward, and a full KV cache is an engine's normal state under load (it queues what does
    not fit, which the waiting count then shows), so by default it saturates nothing (1.0):
    a reading up to a scrape interval old would hold requests in the gateway for up to that
    interval while the engine frees blocks every step. Measured on the routing benchmark's
    azure cell at its capacity (4 engines of 1,400 blocks, 64.9 req/s): at 0.9 the gateway held
    146 and 324 of 600 requests (19 and 76 s of waiting in all) in two runs, and the queue ran
    away in 3 runs of 4 (TTFT p90 0.44 to 1.02 s); off, no request waited and p90 was 0.14 to
    0.16 s in 4 runs of 4 (benchmarks/RESULTS.md). Set it below 1 only with telemetry far
    fresher than one prefill."""

    max_waiting: float = Field(5, ge=0)
    max_kv_usage: float = Field(1.0, gt=0, le=1)


class RoutingConfig(_Strict):
    """`max_candidates`: a decision scores at most this many endpoints of a larger pool (the
    ones holding the deepest part of the prompt, the session's, then a window of the pool at a
    random offset); 0 scores every endpoint."""

    scrape_interval: float = Field(1.0, gt=0)
    scrape_timeout: float = Field(0.5, gt=0)
    stale_after_intervals: float = Field(3.0, ge=1)
    stale_policy: StalePolicy = "local"
    explain: ExplainMode = "admin"
    prefix: PrefixIndexConfig = PrefixIndexConfig()
    saturation: SaturationConfig = SaturationConfig()
    affinity_ttl: float = Field(600.0, gt=0)
    affinity_max_sessions: int = Field(100_000, ge=1)
    max_candidates: int = Field(16, ge=0)

    @property
    def stale_after(self) -> float:
        return self.scrape_interval * self.stale_after_intervals


class EndpointKvEventsConfig(_Strict):
    """Where one engine publishes its KV-cache events (vLLM's `--kv-events-config`): the PUB
    socket `url` (`tcp://host:port`), its `topic`, and the optional replay socket."""

    url: str = Field(pattern=r"^tcp://[^\s/]+:\d+$")
    topic: str = "kv-events"
    replay_url: str | None = Field(None, pattern=r"^tcp://[^\s/]+:\d+$")


class PoolKvEventsConfig(_Strict):
    """Every endpoint of the pool publishes on its own host at its HTTP port + `port_offset`
    and replays at the HTTP port + `replay_port_offset` (null: no replay socket)."""

    port_offset: int = Field(1000, ge=1, le=65535)
    replay_port_offset: int | None = Field(None, ge=1, le=65535)
    topic: str = "kv-events"

    def for_endpoint(self, url: str) -> EndpointKvEventsConfig:
        """The sockets of the engine serving HTTP at `url` (80 / 443 when it names no port)."""
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        replay = self.replay_port_offset
        return EndpointKvEventsConfig(
            url=f"tcp://{host}:{port + self.port_offset}",
            topic=self.topic,
            replay_url=None if replay is None else f"tcp://{host}:{port + replay}",
        )


TokenizerKind = Literal["hf", "sim", "none"]


class TokenizerConfig(_Strict):
    """How the gateway computes the token ids the pool's engines see (precise routing).

    `hf`: a Hugging Face tokenizer directory (`tokenizer.json`, `tokenizer_config.json` with
    its `chat_template`) at `path`; `sim`: the simulator's tokenizer and chat template;
    `none`: no token ids (approximate routing only). `block_size`: the engines' KV block in
    tokens, when set; else what their events and `/metrics` report."""

    kind: TokenizerKind = "none"
    path: str | None = None
    block_size: int | None = Field(None, ge=1, le=4096)

    @model_validator(mode="after")
    def _path_for_hf(self) -> TokenizerConfig:
        if self.kind == "hf" and not self.path:
            raise ValueError("kind 'hf' needs the tokenizer's directory as 'path'")
        if self.kind != "hf" and self.path is not None:
            raise ValueError(f"kind '{self.kind}' takes no 'path'")
        return self
