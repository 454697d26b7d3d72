"""The gateway's side of the trace exporter process: finished request traces go, as `marshal`ed
records, down a pipe to a child process that builds the SDK spans and runs the official
exporters (kvgate/observability/span_export_child.py), so that neither span building nor
protobuf encoding holds this process's GIL while it serves.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import marshal
import os
import sys
from collections.abc import Callable
from contextlib import suppress
from struct import Struct

from kvgate.observability.span_records import TraceRecord

log = logging.getLogger("kvgate.tracing")

# Each record on the pipe: its length (4 bytes, little-endian), then the marshalled record.
FRAME = Struct("<I")
# Records wait this long in the gateway to go down the pipe together (one write, one wake-up
# of the exporter process, per batch rather than per request).
FLUSH_SECONDS = 0.1
# What may wait in the gateway, not yet taken by the pipe: about 6,000 requests of six spans
# (≈ 1.3 KB each), besides what the pipe holds. Beyond it new traces are dropped and counted.
MAX_BUFFERED_BYTES = 8 * 2**20
# The pipe's own buffer (Linux allows up to 1 MiB unprivileged; its default is 64 KiB).
PIPE_BYTES = 2**20
# How long shutdown waits for the exporter process to export what it was sent and exit.
STOP_SECONDS = 30.0
_CHILD = "kvgate.observability.span_export_child"


class ExporterProcess:
    """Sends each finished trace to one exporter child process; `send` never blocks. Traces
    that find the buffer full (the exporter falls behind) or the child gone are dropped and
    their spans counted through `on_dropped`. `settings` is the child's (see
    span_export_child.py); `max_buffered_bytes` bounds what may wait. Start and stop on the
    event loop that calls `send`."""

    def __init__(
        self,
        settings: dict[str, object],
        on_dropped: Callable[[int], None],
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
    ) -> None:
        self.settings = settings
        self._on_dropped = on_dropped
        self._max_buffered = max_buffered_bytes
        self._transport: asyncio.WriteTransport | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._exit_watch: asyncio.Future[int] | None = None
        self._stopping = False
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._pending_spans = 0
        self._flush_at: asyncio.TimerHandle | None = None
        self.dropped = 0

    async def start(self) -> None:
        """Start the child process, its stdin a pipe from this one."""
        # The pipe is made here, not by asyncio: its size can then be set under any event loop.
        read_end, write_end = os.pipe()
        with suppress(OSError):  # a bigger pipe: fewer partial writes; the default still works
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", _CHILD, json.dumps(self.settings), stdin=read_end
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(write_end, "wb", buffering=0)
        self._transport, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, pipe)
        self._exit_watch = asyncio.ensure_future(self._process.wait())
        self._exit_watch.add_done_callback(self._exited)

    @property
    def pid(self) -> int | None:
        """The exporter process's id, once started."""
        return None if self._process is None else self._process.pid

    def _exited(self, wait: asyncio.Future[int]) -> None:
        if not self._stopping and not wait.cancelled():
            assert self._process is not None
            log.error(
                "trace exporter process (pid %d) exited (%s): traces are dropped from now on",
                self._process.pid,
                wait.result(),
            )
            if self._transport is not None:
                self._transport.close()

    def send(self, record: TraceRecord) -> None:
        transport = self._transport
        spans = len(record[3])
        if transport is None or transport.is_closing():
            self._drop(spans)
            return
        data = marshal.dumps(record)
        size = FRAME.size + len(data)
        if self._pending_bytes + transport.get_write_buffer_size() + size > self._max_buffered:
            self._drop(spans)
            return
        self._pending += (FRAME.pack(len(data)), data)
        self._pending_bytes += size
        self._pending_spans += spans
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self._flush)

    def _drop(self, spans: int) -> None:
        self.dropped += spans
        self._on_dropped(spans)

    def _flush(self) -> None:
        self._flush_at = None
        pending, spans = self._pending, self._pending_spans
        self._pending, self._pending_bytes, self._pending_spans = [], 0, 0
        transport = self._transport
        if transport is None or transport.is_closing():
            if spans:
                self._drop(spans)
            return
        transport.writelines(pending)

    async def stop(self) -> None:
        """Send what waits, close the pipe, and wait (up to STOP_SECONDS) for the child to
        export everything it was sent and exit; a child that does not is killed."""
        self._stopping = True
        if self._flush_at is not None:
            self._flush_at.cancel()
        self._flush()
        process = self._process
        if process is None or self._exit_watch is None:
            return
        assert self._transport is not None
        self._transport.close()  # the pipe closes once what is buffered is written
        try:
            await asyncio.wait_for(asyncio.shield(self._exit_watch), STOP_SECONDS)
        except TimeoutError:
            log.error("trace exporter process did not exit in %.0f s: killed", STOP_SECONDS)
            process.kill()
            await self._exit_watch
