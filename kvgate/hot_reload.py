"""`kvgate serve`'s ASGI application: the gateway built from a config file, rebuilt in place on
SIGHUP or `POST /admin/reload`, and marked as draining on SIGTERM (docs/observability.md).

A reload builds and starts a new `GatewayApp` from the file and swaps it in for new requests in
one assignment; requests already inside the old app finish there, and the old app is shut down
when the last of them ends. A file that does not load is refused with `kvgate check-config`'s
messages and the running app keeps serving. The process's metric instruments carry over, so
counters never reset on reload, and so does the state of the endpoints and tenants that remain
(prefix index, breakers, quotas, drained flags: `kvgate/reload_carryover.py`).

Drain (SIGTERM): every app still serving requests stops taking new ones and ends what still
runs after `server.drain_seconds` (`GatewayApp.begin_drain`), before the server's own grace
(one second longer: `kvgate/serving.py`) cancels whatever is left.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

import orjson
from uvicorn.config import STARTUP_FAILURE

from kvgate.app import GatewayApp
from kvgate.asgi import JSON, Receive, Scope, Send, send_bytes, send_error
from kvgate.config import (
    Config,
    ConfigError,
    load_config,
    server_in_effect,
    with_server_in_effect,
)
from kvgate.errors import KvgateError, MethodNotAllowed
from kvgate.http_server import use_header_limits
from kvgate.reload_carryover import carry_over
from kvgate.routing.endpoints import Endpoint
from kvgate.routing.policy_catalog import load_policies

log = logging.getLogger("kvgate")

CONFIG_ENV = "KVGATE_CONFIG"
# The start-only `server` values of a `--workers N` supervisor's start, for its workers (JSON:
# `ReloadableGateway`'s `started`).
SERVER_IN_EFFECT_ENV = "KVGATE_SERVER_IN_EFFECT"
RELOAD_ROUTE = "/admin/reload"


class ReloadableGateway:
    """Serves the `GatewayApp` built from the config file at `path`.

    `supervised` is for a worker of `kvgate serve --workers N`: there `POST /admin/reload`
    checks the file and asks the supervising process (SIGHUP to the parent) to have every
    worker reload it in place, since one worker cannot reach its siblings.

    `started`: the start-only `server` values when `kvgate serve` started, as the file said
    them (`file`) and as the process serves with them after its flags and environment
    variables (`in_effect`); by default this file's, now. Every config this process serves
    carries the values in effect, so `/admin/config` says what is served, and a config whose
    file changed them since the start (a reload, or a worker that a reload replaced) logs that
    they wait for a restart."""

    def __init__(
        self, path: Path, supervised: bool = False, started: dict[str, Any] | None = None
    ) -> None:
        self.path = path
        self.supervised = supervised
        config = load_config(path)
        if started is None:
            from_file = server_in_effect(config)
            started = {"file": from_file, "in_effect": from_file}
        self.file_at_start: dict[str, Any] = started["file"]
        self.in_effect: dict[str, Any] = started["in_effect"]
        self._warn_start_only(config)
        self.current = GatewayApp(with_server_in_effect(config, self.in_effect))
        self.current.fleet.earlier_inflight = self._earlier_inflight
        # Read at start, as the server's own grace is (docs/config.md).
        self.drain_seconds = self.current.config.server.drain_seconds
        self._drain_deadline: float | None = None
        self._inflight: dict[GatewayApp, int] = {}
        self._retired: set[GatewayApp] = set()
        self._tasks: set[asyncio.Task[object]] = set()
        self._reload_lock = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["path"] == RELOAD_ROUTE and self.current.admin_on_public_port:
                await self._admin_reload(scope, send)
                return
            app = self.current
            self._inflight[app] = self._inflight.get(app, 0) + 1
            try:
                await app.serve_http(scope, receive, send)
            finally:
                self._left(app)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def admin_routes(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`/admin/*` for the admin listener (`server.admin_port`): reload, and the serving
        app's admin routes."""
        if scope["path"] == RELOAD_ROUTE:
            await self._admin_reload(scope, send)
        else:
            await self.current.admin(scope, receive, send)

    def render_metrics(self) -> bytes:
        """`/metrics` for the admin listener: the serving app's."""
        return self.current.metrics.render(self.current.views)

    async def reload(self) -> list[str]:
        """Re-read the config file and every policy file: [] once the new app serves new
        requests, else the problems found (the running app keeps serving)."""
        async with self._reload_lock:
            try:
                config = load_config(self.path)
                app = GatewayApp(
                    with_server_in_effect(config, self.in_effect), self.current.metrics
                )
            except ConfigError as exc:
                problems = [f"{exc.source}: {problem}" for problem in exc.problems]
                log.error("config reload refused, the running config keeps serving: %s", problems)
                return problems
            self._warn_start_only(config)
            try:
                await app.startup()
            except BaseException:
                await app.shutdown()
                raise
            carry_over(self.current, app)
            app.fleet.earlier_inflight = self._earlier_inflight
            if self._drain_deadline is not None:
                app.begin_drain(self._drain_deadline - asyncio.get_running_loop().time())
            old, self.current = self.current, app
            log.info("config reloaded from %s", self.path)
            if not self._inflight.get(old):
                self._retire(old)
            else:
                self._retired.add(old)
            return []

    def _warn_start_only(self, config: Config) -> None:
        """Log the start-only `server` keys whose value in the file changed since the start."""
        now = server_in_effect(config)
        changed = [key for key, value in now.items() if value != self.file_at_start.get(key)]
        if changed:
            log.warning(
                "config: %s changed in the file since the start and take effect at the next "
                "restart (read at start); the running values stay",
                ", ".join(f"server.{key}" for key in changed),
            )

    def _earlier_inflight(self, endpoint: Endpoint) -> int:
        """Requests still running on `endpoint` (its pool and URL: names are positions in a
        config, and a reload may move them) in the apps a reload replaced."""
        return sum(
            earlier.inflight
            for app in self._retired
            for earlier in app.fleet.endpoints
            if earlier.url == endpoint.url and earlier.pool == endpoint.pool
        )

    def _left(self, app: GatewayApp) -> None:
        remaining = self._inflight[app] - 1
        if remaining:
            self._inflight[app] = remaining
            return
        del self._inflight[app]
        if app in self._retired:
            self._retired.discard(app)
            self._retire(app)

    def _retire(self, app: GatewayApp) -> None:
        self._spawn(self._shut_down(app))

    async def _shut_down(self, app: GatewayApp) -> None:
        await app.shutdown()
        # Let the collector free the old app (this frame is its last holder), then freeze what
        # the serving app holds again (the old app's shutdown unfroze the heap).
        del app
        gc.collect()
        gc.freeze()

    def _spawn(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("config reload failed", exc_info=task.exception())

    async def _admin_reload(self, scope: Scope, send: Send) -> None:
        try:
            admin = self.current.admin.authorize(scope["headers"])
            if scope["method"] != "POST":
                raise MethodNotAllowed(
                    f"{scope['method']} is not allowed on {RELOAD_ROUTE}; use POST",
                    code="method_not_allowed",
                )
        except KvgateError as error:
            await send_error(send, error)
            return
        log.info(
            "config reload asked by %s",
            "an admin (open gateway)" if admin is None else f"admin key {admin}",
        )
        problems = self._check() if self.supervised else await self.reload()
        if problems:
            refused = {
                "message": "The config file was refused; the running config keeps serving.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_config",
                "problems": problems,
            }
            await send_bytes(send, 400, orjson.dumps({"error": refused}), JSON)
            return
        if self.supervised:
            # The supervisor passes SIGHUP on to every worker (kvgate/worker_supervisor.py).
            os.kill(os.getppid(), signal.SIGHUP)
            await send_bytes(send, 202, b'{"status":"reloading_workers"}', JSON)
        else:
            await send_bytes(send, 200, b'{"status":"reloaded"}', JSON)

    def _check(self) -> list[str]:
        try:
            load_policies(load_config(self.path))
        except ConfigError as exc:
            return [f"{exc.source}: {problem}" for problem in exc.problems]
        return []

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.current.startup()
                self._install_signal_handlers()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                # Apps still retiring: uvicorn has waited for (or cancelled) their requests.
                retired, self._retired = self._retired, set()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                for app in (*retired, self.current):
                    await app.shutdown()
                self.current.metrics.process_exited()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _install_signal_handlers(self) -> None:
        """SIGHUP reloads; SIGTERM and SIGINT first mark the app as draining (/readyz 503),
        then reach the server's own handler, which stops accepting and waits for requests up
        to `server.drain_seconds`. Signals reach the main thread only."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()

        def on_hup(signum: int, frame: FrameType | None) -> None:
            loop.call_soon_threadsafe(self._spawn, self.reload())

        signal.signal(signal.SIGHUP, on_hup)
        for signum in (signal.SIGTERM, signal.SIGINT):
            server_handler = signal.getsignal(signum)
            if callable(server_handler):
                signal.signal(signum, functools.partial(self._drain, loop, server_handler))

    def _drain(
        self,
        loop: asyncio.AbstractEventLoop,
        server_handler: Callable[[int, FrameType | None], object],
        signum: int,
        frame: FrameType | None,
    ) -> None:
        loop.call_soon_threadsafe(self.begin_drain)
        server_handler(signum, frame)

    def begin_drain(self) -> None:
        """The process is going away: /readyz answers 503, queued and new requests get 503
        `draining`, and requests still running after `server.drain_seconds` are ended, a
        stream with an error event (`GatewayApp.begin_drain`). Call on the event loop."""
        if self._drain_deadline is not None:
            return
        self._drain_deadline = asyncio.get_running_loop().time() + self.drain_seconds
        for app in {self.current, *self._inflight}:
            app.begin_drain(self.drain_seconds)
        log.info(
            "draining: /readyz answers 503; requests in flight get up to %g s to finish",
            self.drain_seconds,
        )


def app_from_env() -> ReloadableGateway:
    """Factory for `kvgate serve --workers N`: each worker process loads the config file named
    by $KVGATE_CONFIG and is a full replica with its own local state. A worker whose config
    does not load logs the problems and exits before serving, which makes uvicorn's supervisor
    keep the workers it has (a reload) or stop (at start)."""
    started = os.environ.get(SERVER_IN_EFFECT_ENV)
    try:
        gateway = ReloadableGateway(
            Path(os.environ[CONFIG_ENV]),
            supervised=True,
            started=orjson.loads(started) if started else None,
        )
    except ConfigError as exc:
        for problem in exc.problems:
            log.error("config refused, this worker does not start: %s: %s", exc.source, problem)
        raise SystemExit(STARTUP_FAILURE) from None
    server = gateway.current.config.server
    use_header_limits(server.header_timeout, server.max_header_bytes)
    return gateway
