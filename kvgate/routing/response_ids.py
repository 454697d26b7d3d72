"""Response ids that name the endpoint storing the response.

vLLM (with `VLLM_ENABLE_RESPONSES_API_STORE=1`) keeps a stored response in the memory of the
one engine process that made it: retrieving it, cancelling it and continuing it
(`previous_response_id`) work on that engine only. kvgate keeps no table of where each
response went (nothing to share between replicas, nothing to lose on a restart, no lookup on
the request path): the id the client gets says it. The engine's id `E` reaches the client as

    E + "_kvg" + T     T: 16 hex digits, the 64-bit BLAKE2b of (tenant name, endpoint URL, E),
                       keyed by `auth.response_id_secret` when it is set

e.g. `resp_7f3a…e1_kvg5d41402abc4b2a76`, still starting as the engine's does. On the way in the
suffix is taken off and the endpoint is the one of the current fleet (matched by URL, so the
id survives a reload that renames or reorders endpoints, and serves on every replica with the
same engines) whose token of `E` for the requesting tenant is `T`.

The tenant is hashed in, so an id serves only the tenant it was issued to: another tenant's
request finds no endpoint, and neither does a suffix moved from one's own response onto
another engine id (`E` is hashed in too). Without `auth.response_id_secret` the hash is not
keyed: someone who knew an engine's URL and another tenant's engine id `E` (engine ids are
random, vLLM's a UUID, and leave the gateway only inside the issued id, so: someone who saw
another tenant's response id) could make a token for it under their own key. With the secret
(the same on every replica) nobody can make a token without it. Setting or changing the secret
retires the ids issued before: they answer 404 `response_not_found`.

Errors (answered before anything is taken or sent): an id without the suffix, or whose engine
part is not made as engines make theirs (letters, digits and `_.:+=~-`, starting with a letter
or digit: never a path step such as `..`), 404 `unknown_response_id`; a suffix no endpoint of
the fleet matches (its engine left the fleet, or the id is another tenant's), 404
`response_not_found`; an endpoint that matches but is not taking requests now (failing health
checks, held out by its breaker, or, for a request that generates, drained), 503
`stored_response_unavailable` with Retry-After, as the response may well be there once it is
back.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import orjson

from kvgate.errors import NotFound, Overloaded, PermissionDenied
from kvgate.routing.endpoints import Endpoint, Fleet

MARK = "_kvg"
TOKEN_DIGITS = 16
_TOKEN = re.compile(r"[0-9a-f]{16}")
# What an engine's response id is made of (vLLM's `resp_` and a UUID's hex): it goes into the
# path of the routes under the id, where a `..` or a `/` (an unkeyed token can be made for any
# id) would reach another engine route once a hop normalises the path.
_ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:+=~-]*")
_PERSON = b"kvgate-resp-id"


@dataclass(slots=True)
class ResponseIds:
    """How the response ids of one Responses API request are relayed: `tenant`'s, with the
    ids the request itself named (engine id → the client's id for it)."""

    tenant: str
    named: dict[str, str] = field(default_factory=dict)
    key: bytes = b""  # `signing_key(auth.response_id_secret)`


def signing_key(secret: str | None) -> bytes:
    """The BLAKE2b key of the tokens for `auth.response_id_secret` (b"": unkeyed)."""
    if not secret:
        return b""
    return hashlib.blake2b(secret.encode(), digest_size=32, person=_PERSON).digest()


def token(tenant: str, url: str, engine_id: str, key: bytes = b"") -> str:
    digest = hashlib.blake2b(
        orjson.dumps([tenant, url, engine_id]), digest_size=8, key=key, person=_PERSON
    )
    return digest.hexdigest()


def client_id(engine_id: str, tenant: str, url: str, key: bytes = b"") -> str:
    """The id the client gets for the response `engine_id` stored at `url`."""
    return engine_id + MARK + token(tenant, url, engine_id, key)


def stored_at(
    fleet: Fleet, tenant: str, response_id: str, param: str, key: bytes = b""
) -> tuple[Endpoint, str]:
    """The endpoint storing the response `response_id` names for `tenant`, and the engine's
    own id for it. `param` is the request's field (or path parameter) that named it; `key` the
    tokens' signing key."""
    engine_id, mark, given = (
        response_id[: -len(MARK) - TOKEN_DIGITS],
        response_id[-len(MARK) - TOKEN_DIGITS : -TOKEN_DIGITS],
        response_id[-TOKEN_DIGITS:],
    )
    if mark != MARK or _TOKEN.fullmatch(given) is None or _ENGINE_ID.fullmatch(engine_id) is None:
        raise NotFound(
            f"Response with id '{response_id}' not found: this gateway did not issue that id "
            f"(its response ids end in '{MARK}' and {TOKEN_DIGITS} hexadecimal digits)",
            param=param,
            code="unknown_response_id",
        )
    for endpoint in fleet.endpoints:
        if token(tenant, endpoint.url, engine_id, key) == given:
            return endpoint, engine_id
    raise NotFound(
        f"Response with id '{response_id}' not found: no engine of this gateway's fleet stores "
        "it for this API key (the engine that made it has left the fleet, or the id was issued "
        "to another tenant)",
        param=param,
        code="response_not_found",
    )


def check_available(endpoint: Endpoint, generates: bool) -> None:
    """Raise 503 unless `endpoint` takes requests now: in rotation (healthy, or its pool in
    panic), admitted by its breaker, and, for a request that `generates`, not drained (a drain
    lets what runs there finish; reading or cancelling a stored response is part of that)."""
    if not endpoint.in_rotation:
        reason = "failing its health checks"
    elif not endpoint.breaker.admits():
        reason = "held out of rotation after failed requests"
    elif generates and endpoint.drained:
        reason = "drained by an operator"
    else:
        return
    raise Overloaded(
        f"The stored response is on endpoint {endpoint.name}, which is {reason}; only that "
        "engine holds it: retry later",
        code="stored_response_unavailable",
        retry_after=1,
    )


def check_residency(endpoint: Endpoint, allowed: frozenset[str] | None) -> None:
    """Raise 403 when the request may not be served where its stored conversation is (a
    classification rule narrowed its residency since the conversation began)."""
    if allowed is None:
        return
    where = endpoint.labels.get("jurisdiction")
    if where in allowed:
        return
    raise PermissionDenied(
        f"This request may only be served in {', '.join(sorted(allowed))}, and the stored "
        f"response it continues is on endpoint {endpoint.name} "
        f"({where or 'no jurisdiction'}): start a new conversation instead",
        param="previous_response_id",
        code="residency_conflict",
    )
