"""Shared pieces of the resilience e2e tests: a simulated pool of 4 and answer classification."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from kvgate.sim import SimFleet
from tests.conftest import gateway_config

MODEL = "sim-model"


def chat(content: str = "Tell me about rivers.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def pool_config(
    fleet: SimFleet,
    resilience: dict[str, Any] | None = None,
    pool: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """A gateway config over the fleet: round robin, resilience scaled to seconds; `pool`
    adds pool keys, `top` top-level sections."""
    scaled = {
        "breaker": {"base_ejection": 2, "max_ejection": 10, "probe_timeout": 2},
        "throttle": {"window": 3, "min_requests": 10},
        **(resilience or {}),
    }
    return gateway_config(
        fleet.urls,
        pool={"models": [MODEL], "policy": "round_robin", **(pool or {})},
        resilience=scaled,
        auth="none",
        **top,
    )


def received(fleet: SimFleet) -> int:
    return sum(e.stats()["requests_received"] for e in fleet.engines)


def stream_outcome(raw: bytes) -> tuple[str, str]:
    """("complete" | "error" | "lost", text) of a relayed SSE body. Lost: neither a complete
    answer ([DONE], no error) nor a well-formed error event at the end; any event that is not
    JSON also makes it lost (the client could not parse it)."""
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    text: list[str] = []
    for index, event in enumerate(events):
        assert event.startswith(b"data: "), event
        data = event[6:]
        if data == b"[DONE]":
            return ("complete" if index == len(events) - 1 else "lost"), "".join(text)
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "lost", "".join(text)
        if "error" in chunk:
            well_formed = set(chunk["error"]) == {"message", "type", "param", "code"}
            last = index == len(events) - 1
            return ("error" if well_formed and last else "lost"), "".join(text)
        for choice in chunk.get("choices") or []:
            piece = (
                (choice.get("delta") or {}).get("content")
                if "delta" in choice
                else choice.get("text")
            )
            text.append(piece or "")
    return "lost", "".join(text)


def stream(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 20
) -> tuple[httpx.Response, str, str]:
    response = httpx.post(
        url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=timeout,
    )
    if response.status_code != 200:
        return response, "error", ""
    outcome, text = stream_outcome(response.content)
    return response, outcome, text


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
