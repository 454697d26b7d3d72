"""The transport's tests run on asyncio's loop and on uvloop (the loop `kvgate serve` uses):
the two differ in how transports write, pause and report errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if not item.path.name.startswith("test_transport"):
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
