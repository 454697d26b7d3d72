"""Config section `routing:`: telemetry scraping, stale policy, prefix index, saturation,
session affinity and who may see routing explanations. Validated once at load."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

StalePolicy = Literal["local", "exclude"]
ExplainMode = Literal["admin", "always", "never"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefixIndexConfig(_Strict):
    """`block_chars` bytes of prompt text per hashed block (≈ 16 tokens at 64); at most
    `max_blocks` blocks hashed per prompt (256 x 64 = 16k characters); per endpoint at most
    `default_capacity` blocks until the engine reports its KV size, never more than
    `max_capacity`; entries untouched for `ttl` seconds are dropped."""

    block_chars: int = Field(64, ge=8, le=4096)
    max_blocks: int = Field(256, ge=1, le=8192)
    default_capacity: int = Field(31_250, ge=1)
    max_capacity: int = Field(1_000_000, ge=1)
    ttl: float = Field(600.0, gt=0)


class SaturationConfig(_Strict):
    """An endpoint is saturated when fresh telemetry shows more than `max_waiting` queued
    requests or KV use above `max_kv_usage` (or its `max_inflight` cap is reached)."""

    max_waiting: float = Field(5, ge=0)
    max_kv_usage: float = Field(0.9, gt=0, le=1)


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
