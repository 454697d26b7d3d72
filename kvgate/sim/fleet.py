"""A fleet of simulated engines on consecutive (or ephemeral) ports of one address
(127.0.0.1 unless told otherwise).

    async with SimFleet(engines=2, options=EngineOptions()) as fleet:
        fleet.urls
    with SimFleet.in_thread(engines=2, options=EngineOptions()) as fleet:  # blocking callers
        fleet.urls

The async form runs on the caller's event loop (it may already be serving other things);
`in_thread` runs the fleet on its own event loop in a daemon thread.
"""

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from types import TracebackType

from .engine_server import HOST, SimEngine
from .options import EngineOptions


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


class SimFleet:
    """`engines` engines sharing `options`; engine i listens on `host`:`base_port + i`
    (every engine on its own ephemeral port when `base_port` is 0)."""

    def __init__(
        self,
        engines: int = 1,
        base_port: int = 0,
        options: EngineOptions | None = None,
        host: str = HOST,
    ) -> None:
        if engines < 1:
            raise ValueError("a fleet needs at least one engine")
        self.options = options if options is not None else EngineOptions()
        self.engines = [
            SimEngine(index, self.options, base_port + index if base_port else 0, host)
            for index in range(engines)
        ]

    @property
    def urls(self) -> list[str]:
        """Base URLs of the engines, in index order."""
        return [engine.url for engine in self.engines]

    async def start(self) -> None:
        """Start every engine; if one fails, stop those already started and re-raise."""
        started = []
        try:
            for engine in self.engines:
                await engine.start()
                started.append(engine)
        except BaseException:
            await asyncio.gather(*(engine.stop() for engine in started))
            raise

    async def stop(self) -> None:
        """Stop every engine."""
        await asyncio.gather(*(engine.stop() for engine in self.engines))

    async def __aenter__(self) -> "SimFleet":
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    @classmethod
    @contextlib.contextmanager
    def in_thread(
        cls, engines: int = 1, base_port: int = 0, options: EngineOptions | None = None
    ) -> Iterator["SimFleet"]:
        """Run a fleet on a private event loop in a background thread for blocking code."""
        fleet = cls(engines, base_port, options)
        ready = threading.Event()
        failure: list[BaseException] = []
        holder: dict[str, asyncio.AbstractEventLoop | asyncio.Event] = {}

        async def serve() -> None:
            release = asyncio.Event()
            holder["loop"] = asyncio.get_running_loop()
            holder["release"] = release
            try:
                await fleet.start()
            except BaseException as error:
                failure.append(error)
                ready.set()
                return
            ready.set()
            await release.wait()
            await fleet.stop()

        def run() -> None:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(serve())

        thread = threading.Thread(target=run, name="sim-fleet", daemon=True)
        thread.start()
        ready.wait()
        if failure:
            thread.join()
            raise failure[0]
        try:
            yield fleet
        finally:
            loop, release = holder["loop"], holder["release"]
            assert isinstance(loop, asyncio.AbstractEventLoop)
            assert isinstance(release, asyncio.Event)
            loop.call_soon_threadsafe(release.set)
            thread.join()
