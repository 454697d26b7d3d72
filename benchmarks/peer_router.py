"""The peer column: sglang-router (PyPI `sglang-router`, the `bench` extra) in front of a fleet.

Launched as its documentation launches it, `python -m sglang_router.launch_router --worker-urls
URL... --policy cache_aware`, with its routing defaults. Only what a benchmark on a shared
machine needs differs from its defaults: it binds 127.0.0.1 on a free port (its Prometheus
listener too, which defaults to 0.0.0.0:29000), and logs at `warn` (its default logs two lines
per request, CPU the gateway's column does not spend: kvgate runs without an access log). Its
log goes to a file whose tail is shown if it fails to start.

What it asks of a worker (seen in its log and on the wire against `kvgate sim`): `GET /health`,
then an HTTP/2 connection preface (its gRPC probe; the simulator's uvicorn logs "Invalid HTTP
request received." for each, twice per worker), then HTTP: `/server_info` falling back to
`/get_server_info`, and `/model_info` falling back to `/get_model_info`, for metadata. The
simulator serves none of those four, so the router names the workers' model "unknown" and still
routes every request to them with the `--policy` given, which is what this column measures.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from services import PYTHON, free_port, stop

NAME = "sglang"
READY_SECONDS = 30.0


class PeerUnavailable(RuntimeError):
    """The peer router cannot run here; the message says why (printed in its column)."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("sglang-router")
    except PackageNotFoundError:
        return "not installed"


def _tail(log: Path, lines: int = 15) -> str:
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_until_ready(
    proc: subprocess.Popen[bytes], ready: Callable[[], bool], log: Path, name: str, seconds: float
) -> None:
    """Poll `ready` until it holds; PeerUnavailable, with the tail of `log`, if the peer exits
    or is not ready in `seconds`."""
    deadline = time.monotonic() + seconds
    while not ready():
        if proc.poll() is not None:
            raise PeerUnavailable(f"{name} exited ({proc.returncode}): {_tail(log)}")
        if time.monotonic() > deadline:
            raise PeerUnavailable(f"{name} not ready in {seconds:g} s: {_tail(log)}")
        time.sleep(0.1)


def _ready(base: str, workers: int) -> bool:
    try:
        listing = httpx.get(base + "/workers", timeout=1.0).json()
    except (httpx.HTTPError, ValueError):
        return False
    found = listing.get("workers") or []
    return len(found) == workers and all(w.get("is_healthy") for w in found)


@contextlib.contextmanager
def sglang_router(
    worker_urls: list[str], workdir: Path, policy: str = "cache_aware"
) -> Iterator[str]:
    """Run sglang-router over `worker_urls` until the block exits; yields its base URL once
    every worker is registered and healthy. Raises PeerUnavailable if it cannot start."""
    with running_router(worker_urls, workdir, policy) as (base, _):
        yield base


@contextlib.contextmanager
def running_router(worker_urls: list[str], workdir: Path, policy: str) -> Iterator[tuple[str, int]]:
    """`sglang_router`, yielding its base URL and its process id (for its CPU time and RSS)."""
    if importlib.util.find_spec("sglang_router") is None:
        raise PeerUnavailable("sglang-router not installed (pip install -e '.[bench]')")
    port, metrics_port = free_port(), free_port()
    log = workdir / "sglang-router.log"
    command = [
        PYTHON,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink)
    base = f"http://127.0.0.1:{port}"
    try:
        ready = functools.partial(_ready, base, len(worker_urls))
        wait_until_ready(proc, ready, log, "sglang-router", READY_SECONDS)
        yield base, proc.pid
    finally:
        stop(proc)
