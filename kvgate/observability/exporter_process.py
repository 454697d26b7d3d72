"""The gateway's side of the trace exporter process: finished request traces go, `marshal`ed in
batches, down a pipe to a child process that builds the SDK spans and runs the official
exporters (kvgate/observability/span_export_child.py), so that neither span building nor
protobuf encoding holds this process's GIL while it serves. A child that dies is started
again, as service supervisors do, after a wait that grows while it keeps dying.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import marshal
import os
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from struct import Struct

from kvgate.observability.log_format import current_logging
from kvgate.observability.span_records import TraceRecord, span_count

log = logging.getLogger("kvgate.tracing")

# Each batch on the pipe: its length (4 bytes, little-endian), then the marshalled list of
# records.
FRAME = Struct("<I")
# What the exporter process writes back on its second pipe after each batch it handed to the
# exporters: how many spans it has handled since it started (8 bytes, little-endian). Spans
# sent to a process that dies and not acknowledged are the ones it took with it.
ACK = Struct("<QQ")  # spans handled so far, and of those the ones no exporter delivered
# Records wait this long in the gateway to go down the pipe together: one `marshal` call, one
# write and one wake-up of the exporter process per batch rather than per request, and none
# of them on a request's path.
FLUSH_SECONDS = 0.1
# Traces that may wait in the gateway for the next batch, and bytes of batches that may wait
# for the pipe (besides what the pipe holds: the exporter process falls behind, or is being
# restarted). Beyond either, new traces are dropped and counted.
MAX_PENDING_TRACES = 5_000
MAX_BUFFERED_BYTES = 8 * 2**20
# The pipe's own buffer (Linux allows up to 1 MiB unprivileged; its default is 64 KiB).
PIPE_BYTES = 2**20
# How long shutdown waits for the exporter process to export what it was sent and exit.
STOP_SECONDS = 30.0
# A dead exporter process is started again after a wait that doubles with each death in a
# row, from 1 s up to 60 s: one that keeps dying (it cannot start, it runs out of memory)
# costs at most one start a minute. One that lived at least the longest wait starts again
# after the first.
RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 60.0
# The environment variable that hands the child its settings (JSON).
SETTINGS_VARIABLE = "KVGATE_SPAN_EXPORT_SETTINGS"
_CHILD = "kvgate.observability.span_export_child"


class _Acks(asyncio.Protocol):
    """Reads one exporter process's acknowledgements; `spans` is the latest total; spans its
    exporters could not deliver (the collector refused them, or was unreachable) are told to
    `on_failed` as they grow."""

    def __init__(self, on_failed: Callable[[int], None]) -> None:
        self.spans = 0
        self.failed = 0
        self._on_failed = on_failed
        self._partial = b""
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        received = self._partial + data
        whole = len(received) - len(received) % ACK.size
        if whole:
            self.spans, failed = ACK.unpack_from(received, whole - ACK.size)
            if failed > self.failed:
                self._on_failed(failed - self.failed)
                self.failed = failed
        self._partial = received[whole:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class ExporterProcess:
    """Sends each finished trace to an exporter child process and keeps one running; `send`
    never blocks. `settings` is the child's (see span_export_child.py).

    Dropped, their spans counted through `on_dropped`: traces that find `max_pending_traces`
    waiting for the next batch, or more than `max_buffered_bytes` of batches waiting for the
    pipe (the exporter falls behind, or is being restarted), the spans a child that died had
    been sent and had not acknowledged, and the spans a child's exporters could not deliver
    (the collector refused them or could not be reached). A child that dies is started again
    after a wait of `backoff[0]` seconds, doubled with each death in a row up to `backoff[1]`
    (a child that lived at least `backoff[1]` counts as a first death); the traces that wait
    meanwhile go to the new child, and `on_restarted` is told of each start after the first.
    Start and stop on the event loop that calls `send`."""

    def __init__(
        self,
        settings: dict[str, object],
        on_dropped: Callable[[int], None],
        on_restarted: Callable[[], None] = lambda: None,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
        max_pending_traces: int = MAX_PENDING_TRACES,
        backoff: tuple[float, float] = (RESTART_FIRST_SECONDS, RESTART_MAX_SECONDS),
    ) -> None:
        self.settings = settings
        self._on_dropped = on_dropped
        self._on_restarted = on_restarted
        self._max_buffered = max_buffered_bytes
        self._max_pending = max_pending_traces
        self._backoff = backoff
        self._transport: asyncio.WriteTransport | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._acks: _Acks | None = None
        self._started_at = 0.0
        self._sent_spans = 0  # to the current child
        self._supervisor: asyncio.Task[None] | None = None
        self._stop_requested = asyncio.Event()
        self._pending: list[TraceRecord] = []
        self._pending_spans = 0
        self._flush_at: asyncio.TimerHandle | None = None
        self.dropped = 0
        self.restarts = 0

    async def start(self) -> None:
        """Start the child process, and keep one running until `stop`."""
        await self._spawn()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def _spawn(self) -> None:
        # The pipe is made here, not by asyncio: its size can then be set under any event loop.
        read_end, write_end = os.pipe()
        with suppress(OSError):  # a bigger pipe: fewer partial writes; the default still works
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        ack_read, ack_write = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                _CHILD,
                str(ack_write),
                stdin=read_end,
                pass_fds=(ack_write,),
                # Not on the command line, which `ps` shows every user: the OTLP endpoint
                # may carry credentials.
                env={**os.environ, SETTINGS_VARIABLE: json.dumps(self._child_settings())},
            )
        except BaseException:
            os.close(write_end)
            os.close(ack_read)
            raise
        finally:
            os.close(read_end)
            os.close(ack_write)
        self._process = process
        self._sent_spans = 0
        self._started_at = time.monotonic()
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(write_end, "wb", buffering=0)
        self._transport, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, pipe)
        _, self._acks = await loop.connect_read_pipe(
            lambda: _Acks(self._drop), os.fdopen(ack_read, "rb", buffering=0)
        )

    def _child_settings(self) -> dict[str, object]:
        """`settings`, and how this process logs (the child logs alike)."""
        return {**self.settings, "logging": current_logging()}

    @property
    def pid(self) -> int | None:
        """The exporter process's id, once started."""
        return None if self._process is None else self._process.pid

    async def _supervise(self) -> None:
        """Wait for the child to end; unless stopping, start another after the backoff."""
        first, longest = self._backoff
        delay = 0.0
        while True:
            lived, code, lost = await self._until_the_child_ends()
            if self._stop_requested.is_set():
                return
            delay = first if not delay or lived >= longest else min(2 * delay, longest)
            assert self._process is not None
            log.error(
                "trace exporter process (pid %d) exited (%s), %d spans it held dropped: "
                "restart %d in %g s",
                self._process.pid,
                code,
                lost,
                self.restarts + 1,
                delay,
            )
            started_after = await self._respawn(delay, longest)
            if started_after is None:
                return
            delay = started_after
            self.restarts += 1
            self._on_restarted()
            self._flush()
            if self._stop_requested.is_set():  # `stop` came while it was starting
                self._close_input()

    async def _respawn(self, delay: float, longest: float) -> float | None:
        """Start a child after `delay`, doubling the wait (up to `longest`) while starting
        fails; the last wait, or None when `stop` came first."""
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._stop_requested.wait(), delay)
            if self._stop_requested.is_set():
                return None
            try:
                await self._spawn()
                return delay
            except OSError as error:
                delay = min(2 * delay, longest)
                log.error("trace exporter process not started (%s): next in %g s", error, delay)

    async def _until_the_child_ends(self) -> tuple[float, int, int]:
        """The child's exit: how long it ran, its exit code, and how many spans it was sent
        and did not acknowledge (dropped)."""
        assert self._process is not None and self._acks is not None
        code = await self._process.wait()
        await self._acks.closed  # every acknowledgement it wrote has been read
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        lost = self._sent_spans - self._acks.spans
        if lost > 0:
            self._drop(lost)
        return time.monotonic() - self._started_at, code, lost

    def send(self, record: TraceRecord) -> None:
        spans = span_count(record)
        transport = self._transport
        if (
            self._stop_requested.is_set()
            or len(self._pending) >= self._max_pending
            or (transport is not None and transport.get_write_buffer_size() > self._max_buffered)
        ):
            self._drop(spans)
            return
        self._pending.append(record)
        self._pending_spans += spans
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self._flush)

    def _drop(self, spans: int) -> None:
        self.dropped += spans
        self._on_dropped(spans)

    def _flush(self) -> None:
        """Hand what waits to the child's pipe; with no child to take it (one is being
        restarted), it waits for the next."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        transport = self._transport
        if not self._pending or transport is None or transport.is_closing():
            return
        batch = marshal.dumps(self._pending)
        transport.writelines((FRAME.pack(len(batch)), batch))
        self._sent_spans += self._pending_spans
        self._pending, self._pending_spans = [], 0

    def _close_input(self) -> None:
        """Send what waits and close the pipe: the child exports it all and exits."""
        self._flush()
        if self._transport is not None:
            self._transport.close()  # the pipe closes once what is buffered is written

    async def stop(self) -> None:
        """Send what waits, close the pipe, and wait (up to STOP_SECONDS) for the child to
        export everything it was sent and exit; a child that does not is killed. Stopped while
        waiting to restart a child, it drops (and counts) what waits."""
        self._stop_requested.set()
        supervisor = self._supervisor
        if supervisor is None:
            return
        self._close_input()
        try:
            await asyncio.wait_for(asyncio.shield(supervisor), STOP_SECONDS)
        except TimeoutError:
            log.error("trace exporter process did not exit in %.0f s: killed", STOP_SECONDS)
            if self._process is not None and self._process.returncode is None:
                self._process.kill()
            await supervisor
        if self._pending_spans:
            self._drop(self._pending_spans)
            self._pending, self._pending_spans = [], 0
