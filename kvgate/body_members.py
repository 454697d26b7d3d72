"""Members the gateway adds to a request body, and takes out again, without serialising the
whole body (a long prompt) a second time: the client's bytes reach the engine as sent.

A tenant's `cache_salt` (vLLM's field, set by the auth stage) is taken out again for an
`engine: openai` endpoint: OpenAI's API answers 400 to a parameter it does not know, and a
request may reach such an endpoint through a pool of its own or a fallback.
"""

from __future__ import annotations


def with_member(body: bytes, member: bytes) -> bytes:
    """`body`, one JSON object with at least one member and without `member`'s key, with
    `member` (`"key":value`) added before its closing brace."""
    return body.rstrip()[:-1] + b"," + member + b"}"


def salt_member(salt: str) -> bytes:
    """The `cache_salt` member the auth stage adds, as orjson writes it."""
    return b'"cache_salt":"' + salt.encode() + b'"'


def unsalted(body: bytes, salt: str) -> bytes:
    """`body` without the `cache_salt` member the auth stage set to `salt`.

    The member is found by its exact bytes: orjson wrote it, and the salt is 128 bits of an
    HMAC no client knows, so those bytes appear nowhere else in the body."""
    member = salt_member(salt)
    for found in (b"," + member, member + b",", member):
        if found in body:
            return body.replace(found, b"", 1)
    return body
