"""API keys: their two forms, how new ones are made, and how a presented key is split.

A kvgate key is `<id>.<secret>`: `id` names the key in config and logs (1-64 of `A-Za-z0-9_-`),
the secret is 32 random bytes in URL-safe base64 (43 characters). Config stores only the id and
the SHA-256 (hex) of the secret; the secret is high-entropy, so a fast hash is enough. A key users
already have (`sk-gold-7Hq…`, from another gateway) is configured by the SHA-256 of the whole
key instead. The secret is never logged and never leaves this module except inside the freshly
made key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from kvgate.chain.settings import KEY_ID

_SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class PresentedKey:
    """A presented key split both ways: `key_id` is the text before the first `.` when it has
    the form of a key id (else "", which names no key), `secret_digest` the SHA-256 of what
    follows that `.` (of the whole key when there is none), `whole_digest` the SHA-256 of the
    whole key. Both digests are always computed, so every key costs the same two hashes."""

    key_id: str
    secret_digest: bytes
    whole_digest: bytes


def secret_digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def new_key(key_id: str) -> tuple[str, str]:
    """A fresh key for `key_id`: (the full key to hand out once, the hex SHA-256 for config)."""
    if not KEY_ID.fullmatch(key_id):
        raise ValueError("key id must be 1-64 characters of A-Z a-z 0-9 _ -")
    secret = secrets.token_urlsafe(_SECRET_BYTES)
    return f"{key_id}.{secret}", hashlib.sha256(secret.encode()).hexdigest()


def new_key_id(tenant: str) -> str:
    """A key id that names its tenant and tells keys of one tenant apart: `acme-3f9a1c`."""
    prefix = "".join(c if c.isalnum() or c in "_-" else "-" for c in tenant)[:57]
    return f"{prefix}-{secrets.token_hex(3)}"


def parse_key(raw: bytes) -> PresentedKey:
    """Split a presented key for both lookups; never fails (any bytes may be a whole key)."""
    key_id, dot, secret = raw.partition(b".")
    text_id = ""
    if dot and key_id.isascii():
        candidate = key_id.decode("ascii")
        if KEY_ID.fullmatch(candidate):
            text_id = candidate
    return PresentedKey(text_id, secret_digest(secret if dot else raw), secret_digest(raw))


def digests_match(presented: bytes, stored: bytes) -> bool:
    """Constant-time comparison of two SHA-256 digests."""
    return hmac.compare_digest(presented, stored)
