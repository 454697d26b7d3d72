"""OpenAI SDK clients for tests, closed when the test ends.

A client left open keeps its sockets until a garbage collection finalizes it — often much later
(an exception a test inspects holds the test's frame, and so the client, in a reference cycle),
and then the ResourceWarning lands in whichever test runs at that moment, for instance when a
gateway starts (its startup runs a full collection)."""

from __future__ import annotations

from typing import Any

import openai

_open: list[openai.OpenAI] = []


def sdk_client(**kwargs: Any) -> openai.OpenAI:
    """`openai.OpenAI(**kwargs)`, closed after the test by the `close_sdk_clients` fixture."""
    client = openai.OpenAI(**kwargs)
    _open.append(client)
    return client


def close_sdk_clients() -> None:
    while _open:
        _open.pop().close()
