from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvgate.app import GatewayApp
from kvgate.config import parse_config
from kvgate.http_server import HeaderDeadlineProtocol
from kvgate.sim import EngineOptions, SimFleet
from tests.sdk_clients import close_sdk_clients
from tests.servers import ServerThread
from tests.upstreams import ScriptedUpstream


@pytest.fixture(autouse=True)
def _close_sdk_clients() -> Iterator[None]:
    """Every OpenAI SDK client a test made with `sdk_client` is closed when it ends."""
    yield
    close_sdk_clients()


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """A test that runs `kvgate.cli.main` configures the process's logging: its root handler
    writes to that test's captured stderr, which pytest closes when the test ends. Later tests
    would log into the closed stream (logging prints a traceback instead of the line), so the
    root logger's handlers and level are put back after every test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture
def upstream() -> Iterator[tuple[ScriptedUpstream, ServerThread]]:
    app = ScriptedUpstream()
    with ServerThread(app) as server:
        yield app, server


def gateway_config(urls: list[str], **overrides: Any) -> dict[str, Any]:
    pool: dict[str, Any] = {
        "name": "default",
        "engine": "vllm",
        "endpoints": [{"url": u} for u in urls],
    }
    pool.update(overrides.pop("pool", {}))
    config: dict[str, Any] = {"server": {"access_log": False}, "pools": [pool]}
    config.update(overrides)
    return config


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., tuple[GatewayApp, ServerThread]]]:
    """Start a gateway on `config`, served as `kvgate serve` serves it (kvgate's HTTP protocol)
    unless `options` say otherwise (uvicorn.Config keywords)."""
    started: list[ServerThread] = []

    def start(config: dict[str, Any], **options: Any) -> tuple[GatewayApp, ServerThread]:
        app = GatewayApp(parse_config(config))
        server = ServerThread(app, **{"http": HeaderDeadlineProtocol, **options}).__enter__()
        started.append(server)
        return app, server

    yield start
    for server in started:
        server.__exit__(None, None, None)


@pytest.fixture
def gateway(
    upstream: tuple[ScriptedUpstream, ServerThread],
    start_gateway: Callable[..., tuple[GatewayApp, ServerThread]],
) -> tuple[GatewayApp, ServerThread]:
    return start_gateway(gateway_config([upstream[1].url]))


@pytest.fixture(scope="module")
def store_fleet() -> Iterator[SimFleet]:
    """Two fast simulated engines with the Responses API store on (one per test module)."""
    options = EngineOptions(profile="fast", responses_store=True)
    with SimFleet.in_thread(engines=2, options=options) as sim:
        yield sim
