"""The `auth` stage: who is asking, whether they may use this model, and tenant cache isolation.

A key is found two ways (kvgate/chain/keys.py): by its `<id>.` prefix when that names a
configured key id, else by the SHA-256 of the whole key. 401 for a missing, unknown, wrong or
revoked key — unknown, malformed and wrong keys get the same answer after the same work (a dummy
digest comparison where nothing matched), so response timing does not reveal which keys exist.
403 for a valid key not allowed the requested model, or a tenant key on an admin route. Only
configured key ids are logged.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import orjson

from kvgate.body_members import salt_member, with_member
from kvgate.chain.keys import digests_match, parse_key
from kvgate.chain.tenants import KeyRecord, TenantDirectory
from kvgate.config import EngineKind
from kvgate.errors import AuthenticationFailed, PermissionDenied
from kvgate.request_options import ADMIN_KEY
from kvgate.types import Headers, RequestContext

log = logging.getLogger("kvgate.auth")

_BEARER = b"bearer "
# Routes whose engines take vLLM's `cache_salt`; embeddings do not cache prefixes.
_SALTED_ROUTES = frozenset({"chat", "completions", "responses"})


def _bearer_token(headers: Headers) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            if value[:7].lower() == _BEARER:
                return value[7:].strip()
            return b""
    return None


class RevokedKey(AuthenticationFailed):
    """A configured key that was revoked: 401, and its id for the access log (a key rotation
    is when an operator reads those lines)."""

    def __init__(self, key_id: str) -> None:
        super().__init__("This API key has been revoked", code="revoked_api_key")
        self.key_id = key_id


class Authenticator:
    """Checks a presented key against the directory; the only place secrets are compared."""

    def __init__(self, directory: TenantDirectory) -> None:
        self.directory = directory
        # What an unknown key is compared against: a digest nobody knows a preimage of.
        self._no_key = KeyRecord("(unknown)", None, secrets.token_bytes(32), False)

    def verify(self, headers: Headers) -> KeyRecord:
        """The key record of a valid, unrevoked key, or AuthenticationFailed."""
        return self.verify_token(_bearer_token(headers))

    def verify_token(self, token: bytes | None) -> KeyRecord:
        """`verify` for a key already taken from its header (None: no key was sent)."""
        if token is None:
            raise AuthenticationFailed(
                "No API key provided: send 'Authorization: Bearer <key>'", code="missing_api_key"
            )
        # Every configured key is found by its digest, so a wrong secret and an unknown key do
        # the same work: two hashes, two dict misses, one constant-time compare against a
        # digest nobody knows a preimage of (tests/chain/test_auth.py times both).
        presented = parse_key(token)
        no_key = self._no_key
        by_secret = self.directory.keys_by_digest.get(presented.secret_digest, no_key)
        by_whole = self.directory.keys_by_digest.get(presented.whole_digest, no_key)
        # `<id>.<secret>` when the secret is that id's; else the whole key, chosen by indexing
        # rather than a branch so both outcomes run the same bytecode.
        record, digest = (
            (by_whole, presented.whole_digest),
            (by_secret, presented.secret_digest),
        )[by_secret.key_id == presented.key_id]
        if not digests_match(digest, record.digest) or record is no_key:
            # Only a configured id is logged: text a client sent may be a whole secret key.
            log.info("rejected API key id %s", record.key_id)
            raise AuthenticationFailed("Incorrect API key provided", code="invalid_api_key")
        if record is by_whole and self.directory.keys.get(presented.key_id, record) is not record:
            # A key whose `<id>.` prefix names another configured key is that key's to check.
            log.info("rejected API key id %s", presented.key_id)
            raise AuthenticationFailed("Incorrect API key provided", code="invalid_api_key")
        if record.revoked:
            log.info("rejected revoked API key id %s", record.key_id)
            raise RevokedKey(record.key_id)
        return record

    def verify_admin(self, headers: Headers) -> KeyRecord:
        """Like `verify`, and the key must be an admin key (403 otherwise)."""
        record = self.verify(headers)
        if record.tenant is not None:
            raise PermissionDenied("This route needs an admin key", code="admin_key_required")
        return record


def _urgent_priority(value: object, higher_first: bool) -> bool:
    """Whether `value`, read as the engine reads a `priority` (pydantic's lax int: a whole
    float, a boolean as 0 or 1, or a numeric string with spaces around it), runs ahead of the
    default 0: below 0 on vLLM, above 0 on SGLang (`higher_first`, its default order). A value
    the engine cannot read as a number is left for it to refuse."""
    if not isinstance(value, int | float | str):  # a bool is an int: `true` is 1
        return False
    try:
        number = float(value.strip()) if isinstance(value, str) else float(value)
    except (ValueError, OverflowError):
        return False
    return number > 0 if higher_first else number < 0


class AuthStage:
    """Sets `ctx.tenant` and `ctx.key_id`; for tenants with cache isolation, overwrites the
    body's `cache_salt` with the tenant's salt (taken out again for `engine: openai`
    endpoints, `kvgate.body_members.unsalted`), for shared tenants replaces a `cache_salt` they
    give with one in their own namespace (`Tenant.own_salt`), and sets `ctx.cache_salt` for the
    prefix index; brings a tenant's `priority` that would run ahead of every request that
    sets none, other tenants' included, back to 0 (`_urgent_priority`). Either re-serialises
    the payload once into `ctx.body`.

    `home_engine(model)`: the engine kind of the model's home pool, which says which way
    `priority` runs (vLLM: lower first; SGLang: higher first)."""

    def __init__(
        self,
        directory: TenantDirectory,
        home_engine: Callable[[str], EngineKind | None] = lambda model: None,
    ) -> None:
        self.directory = directory
        self.authenticator = Authenticator(directory)
        self.home_engine = home_engine

    async def __call__(self, ctx: RequestContext) -> None:
        if ctx.options.explain:
            ctx.explain = self._operator(ctx.options.admin_key)
        if self.directory.open:
            ctx.tenant = self.directory.anonymous
            return
        record = ctx.verified_key
        if record is None:
            try:
                record = self.authenticator.verify(ctx.client_headers)
            except RevokedKey as revoked:
                ctx.key_id = revoked.key_id
                raise
        tenant = record.tenant
        if tenant is None:
            raise PermissionDenied(
                "Admin keys cannot be used for inference", code="admin_key_not_for_inference"
            )
        ctx.tenant = tenant
        ctx.key_id = record.key_id
        # The `/v1/responses/{id}` routes name no model: the id is the tenant's own (its
        # suffix is issued per tenant, kvgate/routing/response_ids.py).
        if ctx.response_id is None and not tenant.may_use(ctx.model):
            raise PermissionDenied(
                f"This API key may not use the model '{ctx.model}'",
                param="model",
                code="model_not_allowed",
            )
        changed = False
        added: bytes | None = None  # a member added to the client's bytes as they are
        salt = tenant.cache_salt
        given = ctx.payload.get("cache_salt")
        if salt is None and isinstance(given, str):
            salt = tenant.own_salt(given)  # a shared tenant's own salt, in its namespace
        if salt is not None and ctx.route in _SALTED_ROUTES:
            if "cache_salt" in ctx.payload:  # the client's own, overwritten in place
                changed = True
            else:
                added = salt_member(salt)
            ctx.payload["cache_salt"] = salt
            ctx.cache_salt = salt
        priority = ctx.payload.get("priority")
        if priority is not None and _urgent_priority(
            priority, higher_first=self.home_engine(ctx.model) == "sglang"
        ):
            ctx.payload["priority"] = 0  # no more urgent than a request that sets none
            changed = True
        if changed:
            ctx.body = orjson.dumps(ctx.payload)
        elif added is not None:  # the client's bytes reach the engine as sent, plus the salt
            ctx.body = with_member(ctx.body, added)

    def _operator(self, admin_key: bytes | None) -> bool:
        """Whether the request may see routing explanations: on an open gateway anyone may;
        otherwise it must carry an admin key in `x-kvgate-admin-key` (401 if that key is
        wrong: a credential that was sent is always checked)."""
        if self.directory.open:
            return True
        if admin_key is None:
            return False
        try:
            record = self.authenticator.verify_token(admin_key)
        except AuthenticationFailed as refused:
            refused.param = ADMIN_KEY.decode()  # the header whose key was refused
            raise
        if record.tenant is not None:
            raise PermissionDenied(
                f"{ADMIN_KEY.decode()} needs an admin key",
                param=ADMIN_KEY.decode(),
                code="admin_key_required",
            )
        return True
