"""Config section `resilience:`: retries, the retry budget, circuit breakers, adaptive
throttling and resumes (docs/resilience.md). Validated once at load."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RetryConfig(_Strict):
    """Attempts per request (first one included) and full-jitter back-off, in seconds."""

    max_attempts: int = Field(3, ge=1, le=10)
    backoff_base: float = Field(0.025, ge=0)
    backoff_cap: float = Field(0.25, ge=0)


class RetryBudgetConfig(_Strict):
    """Per pool. Concurrency form (Envoy): retries in flight ≤ max(min_concurrency,
    percent_of_active % of active requests). Rate form (Finagle): retries over `window` s ≤
    percent_of_requests % of requests + min_per_second x window. `null` disables a form."""

    percent_of_active: float | None = Field(20.0, ge=0)
    min_concurrency: int = Field(3, ge=0)
    percent_of_requests: float | None = Field(20.0, ge=0)
    min_per_second: float = Field(10.0, ge=0)
    window: float = Field(10.0, gt=0)


class BreakerConfig(_Strict):
    """Per endpoint circuit breaker / outlier ejection; durations in seconds."""

    consecutive_failures: int = Field(5, ge=1)
    failure_rate: float = Field(0.5, gt=0, le=1)
    failure_rate_min_requests: int = Field(20, ge=1)
    window: float = Field(10.0, gt=0)
    base_ejection: float = Field(30.0, gt=0)
    max_ejection: float = Field(300.0, gt=0)
    max_ejected_fraction: float = Field(0.5, ge=0, le=1)
    half_open_probes: int = Field(2, ge=1)
    probe_timeout: float = Field(10.0, gt=0)
    max_hold: float = Field(30.0, ge=0)


class ThrottleConfig(_Strict):
    """Client-side adaptive throttling per pool (Google SRE): p = max(0, (requests - k x
    accepts) / (requests + 1)) over `window` s, once `min_requests` were attempted."""

    enabled: bool = True
    k: float = Field(2.0, ge=1)
    window: float = Field(30.0, gt=0)
    min_requests: int = Field(20, ge=0)
    retry_after: float = Field(1.0, gt=0)


class ResilienceConfig(_Strict):
    """Retries, retry budget, breakers, throttling, resume (docs/resilience.md)."""

    retries: RetryConfig = RetryConfig()
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()
    breaker: BreakerConfig = BreakerConfig()
    throttle: ThrottleConfig = ThrottleConfig()
    max_resumes: int = Field(1, ge=1, le=3)
