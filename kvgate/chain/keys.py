"""API keys: their format, how new ones are made, and the one way a presented key is checked.

A key is `<id>.<secret>`: `id` names the key in config and logs (1-64 of `A-Za-z0-9_-`), the
secret is 32 random bytes in URL-safe base64 (43 characters). Config stores only the id and the
SHA-256 (hex) of the secret; the secret is high-entropy, so a fast hash is enough. The secret is
never logged and never leaves this module except inside the freshly made key.
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
    key_id: str
    secret: bytes


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


def parse_key(raw: bytes) -> PresentedKey | None:
    """Split `<id>.<secret>`; None when the value cannot be a kvgate key."""
    key_id, dot, secret = raw.partition(b".")
    if not dot or not secret or len(secret) > 512:
        return None
    try:
        text_id = key_id.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not KEY_ID.fullmatch(text_id):
        return None
    return PresentedKey(text_id, secret)


def digests_match(presented: bytes, stored: bytes) -> bool:
    """Constant-time comparison of two SHA-256 digests."""
    return hmac.compare_digest(presented, stored)
