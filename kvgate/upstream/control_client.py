"""The control-plane HTTP client (httpx): health checks, model discovery, telemetry scrapes.

The data path (inference requests) uses its own client, `kvgate/upstream/transport.py`."""

from __future__ import annotations

import httpx

from kvgate.config import TimeoutsConfig, UpstreamConfig


def build_control_client(upstream: UpstreamConfig, timeouts: TimeoutsConfig) -> httpx.AsyncClient:
    """Keep-alive pool with bounded size; only the connect phase is timed here (callers bound
    their own calls). `trust_env=False` so that proxy variables of the host never reroute
    engine traffic."""
    return httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=upstream.max_connections,
            max_keepalive_connections=upstream.max_keepalive_connections,
            keepalive_expiry=upstream.keepalive_expiry,
        ),
        timeout=httpx.Timeout(
            connect=timeouts.connect, read=None, write=timeouts.connect, pool=timeouts.connect
        ),
        follow_redirects=False,
        trust_env=False,
    )
