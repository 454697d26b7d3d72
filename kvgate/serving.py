"""How kvgate runs uvicorn: the server options shared by `serve` (one process or several),
the admin listener and the demo."""

from __future__ import annotations

import math
from typing import Any

from kvgate.config import KEEPALIVE_SECONDS
from kvgate.http_server import HeaderDeadlineProtocol
from kvgate.observability.log_format import logging_config

_ENDING_SECONDS = 1


def uvicorn_options(
    host: str,
    port: int,
    log_level: str,
    log_format: str,
    keepalive: float = KEEPALIVE_SECONDS,
    drain_seconds: float = 5,
) -> dict[str, Any]:
    """The server options of every way kvgate runs uvicorn (one process or several);
    `keepalive`: seconds before an idle keep-alive connection is closed. Requests' headers
    have a deadline too (`kvgate/http_server.py`, `use_header_limits`)."""
    return {
        "timeout_keep_alive": keepalive,
        "http": HeaderDeadlineProtocol,
        "host": host,
        "port": port,
        "loop": "uvloop",
        "lifespan": "on",
        "access_log": False,
        "log_level": log_level,
        # Every process uvicorn starts logs like this one (workers included).
        "log_config": logging_config(log_level, log_format),
        "server_header": False,
        # uvicorn takes whole seconds; round up so a grace is never shortened. The gateway ends
        # what still runs at `drain_seconds` itself (an error event to each stream); the extra
        # second lets those events go out before uvicorn cancels whatever is left.
        "timeout_graceful_shutdown": math.ceil(drain_seconds) + _ENDING_SECONDS,
        "proxy_headers": False,  # kvgate reads no client address
    }
