"""Shared pieces for request-chain tests: keys, tenant configs, raw HTTP calls."""

from __future__ import annotations

from typing import Any

import httpx

from kvgate.chain.keys import new_key


def make_key(key_id: str) -> tuple[str, dict[str, str]]:
    """A fresh key and its config entry."""
    key, digest = new_key(key_id)
    return key, {"id": key_id, "sha256": digest}


def tenant(name: str, tier: str, key_entries: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"name": name, "tier": tier, "keys": key_entries, **extra}


def chat(
    url: str,
    key: str | None,
    model: str = "m1",
    headers: dict[str, str] | None = None,
    timeout: float = 10,
    **body: Any,
) -> httpx.Response:
    sent = dict(headers or {})
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    payload = {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=sent, timeout=timeout)


def admission_state(app: Any, server: Any) -> dict[str, Any]:
    """Active requests, queue entries and open reservations, read on the gateway's loop."""

    async def read() -> dict[str, Any]:
        admission = app.admission
        return {
            "active": sum(admission.active.values()),
            "queued": len(admission.queue),
            "queued_by_tenant": sum(admission.queued.values()),
            "reservations": admission.quotas.outstanding(),
        }

    return server.call(read())


IDLE = {"active": 0, "queued": 0, "queued_by_tenant": 0, "reservations": (0, 0)}
