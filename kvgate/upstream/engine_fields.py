"""Fields the gateway added to a body that an engine of another kind would refuse.

A tenant's `cache_salt` (vLLM's field, set by the auth stage) is taken out again for an
`engine: openai` endpoint: OpenAI's API answers 400 to a parameter it does not know, and a
request may reach such an endpoint through a pool of its own or a fallback.
"""

from __future__ import annotations


def unsalted(body: bytes, salt: str) -> bytes:
    """`body` without the `cache_salt` member the auth stage set to `salt`.

    The member is found by its exact bytes: orjson wrote it, and the salt is 128 bits of an
    HMAC no client knows, so those bytes appear nowhere else in the body."""
    member = b'"cache_salt":"' + salt.encode() + b'"'
    for found in (b"," + member, member + b",", member):
        if found in body:
            return body.replace(found, b"", 1)
    return body
