"""Real servers on loopback for tests: any ASGI app served by uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import uvicorn


class _PromptlyStoppedServer(uvicorn.Server):
    """uvicorn's server, whose main loop wakes as soon as `stop()` is called instead of at its
    next 0.1 s tick: every test's teardown stops two or three servers."""

    _stop: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._stop = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.1)

    def stop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.should_exit = True
        if loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(self._stop.set)


class ServerThread:
    """Serve `app` with uvicorn (httptools, lifespan on) on 127.0.0.1 and a free port, in a
    thread with its own event loop. `url` is ready once the context manager is entered."""

    def __init__(self, app: Any, lifespan: str = "on", **options: Any) -> None:
        """`options`: uvicorn.Config keyword arguments over the defaults here."""
        self.app = app
        defaults: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "loop": "asyncio",
            "http": "httptools",
            "lifespan": lifespan,
            "access_log": False,
            "log_level": "warning",
            "timeout_graceful_shutdown": 0.5,
        }
        self.server = _PromptlyStoppedServer(uvicorn.Config(app, **{**defaults, **options}))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self._error = exc

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro: Any) -> Any:
        """Run a coroutine on the server's loop (to inspect or change its state safely)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start within 10 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(self.loop)
        self._thread.join(timeout=10)


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port(count: int, offsets: tuple[int, ...] = (0,)) -> int:
    """A port P such that P + offset + i is free for every offset and every i < count (for a
    fleet of simulated engines on consecutive ports, with their event sockets at offsets)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        wanted = [base + offset + i for offset in offsets for i in range(count)]
        if max(wanted) < 65000 and all(port_is_free(port) for port in wanted):
            return base
    raise RuntimeError("no free port range")
