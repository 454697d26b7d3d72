"""One simulated engine served by uvicorn (on 127.0.0.1 unless told otherwise), with a
listener that can be shut.

`SimEngine` is the per-engine handle: `url`, `port`, `stats()`, `responses` (its Responses
API store), `set_fault()` and `clear_fault()`; with KV events on, `kv_events` (its `url`,
`replay_url`) and `set_kv_event_fault()`. Fault changes may be made from any thread; they
take effect before the call returns (a `refuse` fault has closed the listening socket;
clearing it has bound the same port again, so connections queue in its backlog until the
accept loop resumes).
"""

import asyncio
import concurrent.futures
import contextlib
import functools
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import uvicorn

from .engine_app import EngineApp
from .engine_core import EngineCore
from .faults import REFUSE, Fault, FaultInjector
from .kv_event_publisher import KvEventFault, KvEventPublisher
from .options import EngineOptions
from .response_store import ResponseStore
from .stats import EngineCounters

HOST = "127.0.0.1"
_Result = TypeVar("_Result")


def _listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class SimEngine:
    """A simulated engine: start with `await start()`, stop with `await stop()`. It listens
    on the IPv4 address `host` (0.0.0.0: every interface, e.g. to serve other containers)."""

    def __init__(self, index: int, options: EngineOptions, port: int = 0, host: str = HOST) -> None:
        self.index = index
        self.options = options
        self.host = host
        self.port = port
        self.counters = EngineCounters()
        self._faults = FaultInjector(seed=options.seed * 1_000_003 + index)
        self._core: EngineCore | None = None
        self._app: EngineApp | None = None
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener_tasks: set[asyncio.Task[None]] = set()
        self.kv_events: KvEventPublisher | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:40123` (the port is known once started)."""
        return f"http://{self.host}:{self.port}"

    @property
    def responses(self) -> ResponseStore:
        """The Responses API store (empty unless `options.responses_store`); only valid
        between start and stop."""
        assert self._app is not None, "engine not started"
        return self._app.responses

    @property
    def core(self) -> EngineCore:
        """The engine core (queues, KV pool); only valid between start and stop."""
        assert self._core is not None, "engine not started"
        return self._core

    async def start(self) -> None:
        """Bind the port, start uvicorn and the engine core on the running loop."""
        self._loop = asyncio.get_running_loop()
        if self.options.kv_events:
            self.kv_events = self._bind_kv_events()
        self._core = EngineCore(self.options, self.counters, self.kv_events)
        self._app = EngineApp(
            self.options,
            self._core,
            self.counters,
            self._faults.draw,
            self._apply_fault,
            self._describe_faults,
            lambda: self._faults.health_hangs,
            self.kv_events,
        )
        config = uvicorn.Config(
            self._app,
            lifespan="off",
            http="httptools",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=2,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        try:
            sock = _listening_socket(self.host, self.port)
        except OSError:
            if self.kv_events is not None:
                await self.kv_events.close()
            raise
        self.port = sock.getsockname()[1]
        await server.startup(sockets=[sock])
        self._server = server
        self._core.start()
        if self.kv_events is not None:
            self.kv_events.start()
        if self.options.fault is not None:
            self._apply_fault(Fault.from_json(self.options.fault))

    async def stop(self) -> None:
        """Abort in-flight work, close every connection and the listener."""
        assert self._server is not None and self._app is not None and self._core is not None
        self._app.closing.set()
        for task in list(self._listener_tasks):
            with contextlib.suppress(OSError):
                await task
        await self._core.close()
        await self._server.shutdown()
        if self.kv_events is not None:
            await self.kv_events.close()

    def _bind_kv_events(self) -> KvEventPublisher:
        """PUB and replay on the HTTP port + their offsets; both ephemeral when the HTTP port
        is (an offset from an arbitrary port may be taken or out of range)."""
        options = self.options
        publisher = KvEventPublisher(
            options.kv_events_encoding, options.block_size, options.kv_events_replay_batches
        )
        offsets = (options.kv_events_port_offset, options.kv_events_replay_port_offset)
        publisher.bind(self.host, *(self.port + offset if self.port else 0 for offset in offsets))
        return publisher

    # --- observation and faults (callable from any thread) ---------------------------

    def stats(self) -> dict[str, Any]:
        """The `/sim/stats` counters, plus live queue lengths and KV usage."""
        core = self.core
        return {
            **self.counters.as_json(),
            "num_running": len(core.running),
            "num_waiting": len(core.waiting),
            "kv_cache_usage": core.pool.usage,
            "responses_stored": len(self.responses),
        }

    @property
    def fault(self) -> Fault | None:
        """The fault in force, if any."""
        return self._faults.current

    def set_fault(self, fault: Fault | dict[str, Any]) -> None:
        """Set a fault (a `Fault` or its JSON form), replacing any other."""
        if not isinstance(fault, Fault):
            fault = Fault.from_json(fault)
        self._in_loop(self._apply_fault, fault)

    def clear_fault(self) -> None:
        """Clear the fault; a refusing engine accepts connections on its port again."""
        self._in_loop(self._apply_fault, None)

    def set_kv_event_fault(self, fault: KvEventFault | dict[str, Any] | None) -> None:
        """Set (a `KvEventFault` or its JSON form) or clear (None) an event-stream fault;
        `restart` acts at once. Only for engines started with KV events."""
        if isinstance(fault, dict):
            fault = KvEventFault.from_json(fault)
        self._in_loop(self.core.set_kv_event_fault, fault)

    def _in_loop(self, function: Callable[..., _Result], *args: Any) -> _Result:
        assert self._loop is not None, "engine not started"
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return function(*args)
        future: concurrent.futures.Future[_Result] = concurrent.futures.Future()

        def call() -> None:
            try:
                future.set_result(function(*args))
            except BaseException as error:  # handed to the calling thread
                future.set_exception(error)

        self._loop.call_soon_threadsafe(call)
        return future.result(timeout=10)

    def _describe_faults(self) -> dict[str, Any]:
        fault = self._faults.current
        return {"fault": fault.as_json() if fault else None, "remaining": self._faults.remaining}

    def _apply_fault(self, fault: Fault | None) -> None:
        was_refusing = self._faults.current is not None and self._faults.current.mode == REFUSE
        if fault is None:
            self._faults.clear()
        else:
            self._faults.set(fault)
        refusing = fault is not None and fault.mode == REFUSE
        if refusing and not was_refusing:
            self._stop_listening()
        elif was_refusing and not refusing:
            self._start_listening()

    def _stop_listening(self) -> None:
        """Close the listener and drop every connection, as a dead engine would."""
        assert self._server is not None
        for server in self._server.servers:
            server.close()
        self._server.servers = []
        for connection in list(self._server.server_state.connections):
            # uvicorn's HTTP protocols (h11, httptools) keep the request in `cycle`.
            cycle = getattr(connection, "cycle", None)
            if cycle is None or cycle.response_complete:
                connection.transport.close()  # idle: let buffered bytes out first
            else:
                connection.transport.abort()

    def _start_listening(self) -> None:
        assert self._server is not None and self._loop is not None
        sock = _listening_socket(self.host, self.port)
        server = self._server
        loop = self._loop
        # uvicorn's HTTP protocol classes take these keywords (typed as plain asyncio ones).
        protocol_class: Any = server.config.http_protocol_class
        protocol_factory: Callable[[], asyncio.Protocol] = functools.partial(
            protocol_class,
            config=server.config,
            server_state=server.server_state,
            app_state=server.lifespan.state,
        )

        async def accept() -> None:
            server.servers.append(await loop.create_server(protocol_factory, sock=sock))

        task = self._loop.create_task(accept())
        self._listener_tasks.add(task)
        task.add_done_callback(self._listener_tasks.discard)
