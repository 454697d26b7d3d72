"""Tenants as the running gateway sees them, and the directory that finds one from a key id.

Built once from config. The anonymous tenant stands for every request when auth is off, so the
later stages (classification, quotas, queues) work the same with or without keys.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from kvgate.chain.settings import (
    DEFAULT_TIERS,
    AuthConfig,
    LatencyClass,
    TenantConfig,
    TenantLimits,
    TierConfig,
)
from kvgate.globs import compile_globs
from kvgate.state.quotas import QuotaLimits

ANONYMOUS = "anonymous"
ANONYMOUS_TIER = "silver"
# Used when no `auth.cache_salt_secret` is set: salts still differ per tenant, they are just
# derivable from the tenant name. Isolation holds because no tenant can send a salt of its
# choosing: an isolated tenant's is replaced, a shared tenant's namespaced (`Tenant.own_salt`).
_DEFAULT_SALT_KEY = b"kvgate-cache-salt-v1"


@dataclass(frozen=True, slots=True, eq=False)
class Tenant:
    name: str
    tier: str
    tier_priority: int
    weight: float
    default_class: LatencyClass
    best_class: LatencyClass
    limits: TenantLimits
    quota: QuotaLimits
    residency: frozenset[str] | None
    cache_salt: str | None
    _models: re.Pattern[str] | None
    _salt_secret: str | None = None

    def may_use(self, model: str) -> bool:
        return self._models is None or self._models.fullmatch(model) is not None

    def own_salt(self, given: str) -> str:
        """The salt a shared tenant's request sends for the `cache_salt` it gave: one of its
        own, which no other tenant's salt (nor another tenant's `given`) can equal, so a
        tenant that knows or guesses another's salt cannot read that tenant's cache."""
        return cache_salt_for(f"{self.name}\x00{given}", self._salt_secret)


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A configured key: its tenant (None for an admin key), secret digest and state."""

    key_id: str
    tenant: Tenant | None
    digest: bytes
    revoked: bool


def cache_salt_for(tenant: str, secret: str | None) -> str:
    key = secret.encode() if secret else _DEFAULT_SALT_KEY
    return hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()[:32]


def build_tenant(config: TenantConfig, tier: TierConfig, salt_secret: str | None) -> Tenant:
    models = compile_globs(config.models) if config.models is not None else None
    return Tenant(
        name=config.name,
        tier=config.tier,
        tier_priority=tier.priority,
        weight=tier.weight,
        default_class=tier.default_class,
        best_class=tier.best_class,
        limits=config.limits,
        quota=QuotaLimits(config.limits.requests_per_minute, config.limits.tokens_per_minute),
        residency=frozenset(config.residency) if config.residency is not None else None,
        cache_salt=(
            cache_salt_for(config.name, salt_secret) if config.cache_isolation == "tenant" else None
        ),
        _models=models,
        _salt_secret=salt_secret,
    )


class TenantDirectory:
    """Every tenant and key from config. `open` is True when requests need no key."""

    def __init__(self, auth: AuthConfig | None, tiers: dict[str, TierConfig]) -> None:
        self.tiers = {**DEFAULT_TIERS, **tiers}
        self.open = auth is None or auth.disabled
        self.anonymous = build_tenant(
            TenantConfig(name=ANONYMOUS, tier=ANONYMOUS_TIER, cache_isolation="shared"),
            self.tiers[ANONYMOUS_TIER],
            None,
        )
        self.tenants: dict[str, Tenant] = {}
        self.keys: dict[str, KeyRecord] = {}
        # Every key by its configured digest (of the secret, or of a whole key users already
        # have): how the authenticator finds keys of both forms with the same work.
        self.keys_by_digest: dict[bytes, KeyRecord] = {}
        if auth is None:
            return
        for config in auth.tenants:
            tenant = build_tenant(config, self.tiers[config.tier], auth.cache_salt_secret)
            self.tenants[tenant.name] = tenant
            for key in config.keys:
                self.keys[key.id] = KeyRecord(
                    key.id, tenant, bytes.fromhex(key.sha256), key.revoked
                )
        for key in auth.admin_keys:
            self.keys[key.id] = KeyRecord(key.id, None, bytes.fromhex(key.sha256), key.revoked)
        self.keys_by_digest = {record.digest: record for record in self.keys.values()}
