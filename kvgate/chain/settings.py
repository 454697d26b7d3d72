"""Config sections of the request chain: `auth`, `tiers`, `classification`, `admission`.

They are pydantic models like the rest of `kvgate/config.py` (unknown keys are errors) and are
validated once at load; `cross_check_chain` checks the references between them (a tenant's tier
exists, key ids and tenant names are unique) with errors naming the YAML path.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvgate.prompt_view import MEDIA_TOKENS

LatencyClass = Literal["interactive", "standard", "batch"]
CacheIsolation = Literal["tenant", "shared"]
RouteName = Literal[
    "chat",
    "completions",
    "embeddings",
    "responses",
    "rerank",
    "score",
    "classify",
    "pooling",
    "tokenize",
    "detokenize",
]

KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class KeyConfig(_Strict):
    """One API key: its public id and the SHA-256 (hex) of its secret part, never the secret."""

    id: str
    sha256: str
    revoked: bool = False

    @field_validator("id")
    @classmethod
    def _key_id(cls, value: str) -> str:
        if not KEY_ID.fullmatch(value):
            raise ValueError("must be 1-64 characters of A-Z a-z 0-9 _ -")
        return value

    @field_validator("sha256")
    @classmethod
    def _digest(cls, value: str) -> str:
        value = value.lower()
        if not _SHA256_HEX.fullmatch(value):
            raise ValueError("must be 64 hex digits (the SHA-256 of the key's secret)")
        return value


class TenantLimits(_Strict):
    """Per-tenant limits; an absent limit is unlimited."""

    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0)
    max_concurrent: int | None = Field(None, gt=0)
    max_queued: int | None = Field(None, ge=0)


class TenantConfig(_Strict):
    name: str = Field(min_length=1, max_length=64)
    tier: str = "silver"
    keys: list[KeyConfig] = Field(default_factory=list)
    limits: TenantLimits = TenantLimits()
    # fnmatch patterns of the models this tenant may use; absent means every model.
    models: list[str] | None = None
    # Jurisdictions (endpoint label `jurisdiction`) the tenant's data may be processed in.
    residency: list[str] | None = None
    cache_isolation: CacheIsolation = "tenant"


class AuthConfig(_Strict):
    """`auth: none` is read as `disabled: true`: no keys, every request is the anonymous
    tenant. A mapping turns on API keys; requests without a valid key get 401."""

    disabled: bool = False
    tenants: list[TenantConfig] = Field(default_factory=list)
    admin_keys: list[KeyConfig] = Field(default_factory=list)
    # HMAC key for per-tenant cache salts; set it (e.g. `${KVGATE_SALT_SECRET}`) so that the
    # salts cannot be derived from tenant names. Every replica must use the same value.
    cache_salt_secret: str | None = None
    # Key of the Responses API ids' tokens (kvgate/routing/response_ids.py); set it so that a
    # response id cannot be made for another tenant's stored response. The same on every
    # replica; changing it retires the ids issued before.
    response_id_secret: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _none_shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value == "none":
                return {"disabled": True}
            raise ValueError("must be 'none' or a mapping with 'tenants'")
        return value


class TierConfig(_Strict):
    """What a tier buys: `priority` (lower is served first among equal classes and shed last),
    `weight` (fair share between tenants of one class), the class used when no rule sets
    one, and the best class a request of this tier may get."""

    priority: int = Field(ge=0, le=99)
    weight: float = Field(gt=0)
    default_class: LatencyClass = "standard"
    best_class: LatencyClass = "interactive"


DEFAULT_TIERS: dict[str, TierConfig] = {
    "gold": TierConfig(priority=0, weight=4, default_class="standard"),
    "silver": TierConfig(priority=1, weight=2, default_class="standard"),
    "bronze": TierConfig(priority=2, weight=1, default_class="standard", best_class="standard"),
}


class ClassConfig(_Strict):
    """Seconds. `deadline`: the whole request must finish within it (the resilience layer
    honours `ctx.deadline`). `max_queue_wait`: longest wait for capacity in the gateway;
    absent means up to the deadline."""

    deadline: float = Field(gt=0)
    max_queue_wait: float | None = Field(None, gt=0)


DEFAULT_CLASSES: dict[LatencyClass, ClassConfig] = {
    "interactive": ClassConfig(deadline=120, max_queue_wait=10),
    "standard": ClassConfig(deadline=600, max_queue_wait=60),
    "batch": ClassConfig(deadline=3600),
}


class RuleMatch(_Strict):
    """Conditions of a rule; all present ones must hold. Strings in `model` are fnmatch
    patterns; `headers` compare exact values (names case-insensitive); `keywords` are
    case-insensitive substrings of the prompt text; `regex` is searched in the prompt text."""

    model: list[str] | None = None
    route: list[RouteName] | None = None
    stream: bool | None = None
    tools: bool | None = None
    headers: dict[str, str] | None = None
    prompt_tokens_at_least: int | None = Field(None, ge=0)
    prompt_tokens_below: int | None = Field(None, gt=0)
    keywords: list[str] | None = None
    regex: str | None = None

    @field_validator("model", "route", "keywords", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"invalid regular expression: {exc}") from None
        return value


class RuleAction(_Strict):
    latency_class: LatencyClass | None = Field(None, alias="class")
    deadline: float | None = Field(None, gt=0)
    residency: list[str] | None = None

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )


class RuleConfig(_Strict):
    name: str = Field(min_length=1)
    when: RuleMatch = RuleMatch()
    then: RuleAction


class ClassificationConfig(_Strict):
    rules: list[RuleConfig] = Field(default_factory=list)
    classes: dict[LatencyClass, ClassConfig] = Field(default_factory=dict)
    # Output tokens reserved against tokens_per_minute when a request sets no max_tokens.
    default_max_tokens: int = Field(512, gt=0)
    # Prompt tokens are estimated as characters / chars_per_token (no tokenizer on the path).
    chars_per_token: float = Field(4.0, gt=0)
    # ... and each image, audio or video part of a message as media_tokens (kvgate/prompt_view.py).
    media_tokens: int = Field(MEDIA_TOKENS, ge=0)


class AdmissionConfig(_Strict):
    """Waiting for capacity in the gateway. `max_queued` bounds all queues together;
    `recheck_interval` is how often waiting requests re-test saturation (telemetry changes
    without any request finishing); `initial_ttft` and `initial_token_time` (seconds per
    output token) seed the per-model predictions of time to first token and to finish;
    `prediction_deviations` is how many mean deviations each predicted time adds to its mean
    (a waiter is refused when its remaining deadline is shorter than the prediction)."""

    enabled: bool = True
    max_queued: int = Field(1024, ge=0)
    # Waiting requests of one tenant and class start shortest uncached prefill first (with
    # aging: none waits longer than its own prefill time beyond arrival order), at the
    # fleet's prefill rate: ≈ 10k tokens/s for an 8B model on one H100 (the simulator's
    # realistic profile is the same, 0.1 ms per token).
    shortest_prefill_first: bool = True
    prefill_tokens_per_second: float = Field(10_000.0, gt=0)
    recheck_interval: float = Field(0.05, gt=0)
    initial_ttft: float = Field(0.5, ge=0)
    initial_token_time: float = Field(0.02, ge=0)
    prediction_deviations: float = Field(4.0, ge=0)
    workflow_step_boost: float = Field(1.0, ge=0)


def cross_check_chain(auth: AuthConfig | None, tiers: dict[str, TierConfig]) -> list[str]:
    """Problems between sections: unknown tiers, duplicate tenants, key ids and key digests
    (two keys with one secret: the last would take the other's place, tenant or admin)."""
    problems: list[str] = []
    if auth is None:
        return problems
    if auth.disabled and (auth.tenants or auth.admin_keys):
        problems.append("auth.disabled: 'auth: none' cannot also list tenants or admin keys")
    known_tiers = {**DEFAULT_TIERS, **tiers}
    tenants: set[str] = set()
    key_ids: dict[str, str] = {}
    digests: dict[str, str] = {}

    def check_key(where: str, key: KeyConfig) -> None:
        if key.id in key_ids:
            problems.append(f"{where}.id: duplicate key id, already in {key_ids[key.id]}")
        key_ids[key.id] = where
        digest = key.sha256.lower()
        if digest in digests:
            problems.append(
                f"{where}.sha256: the same secret as {digests[digest]} (every key needs its own)"
            )
        digests.setdefault(digest, where)

    for i, tenant in enumerate(auth.tenants):
        where = f"auth.tenants[{i}]"
        if tenant.name in tenants:
            problems.append(f"{where}.name: duplicate tenant '{tenant.name}'")
        tenants.add(tenant.name)
        if tenant.tier not in known_tiers:
            problems.append(
                f"{where}.tier: unknown tier '{tenant.tier}' "
                f"(one of: {', '.join(sorted(known_tiers))})"
            )
        for j, key in enumerate(tenant.keys):
            check_key(f"{where}.keys[{j}]", key)
    for j, key in enumerate(auth.admin_keys):
        check_key(f"auth.admin_keys[{j}]", key)
    return problems
