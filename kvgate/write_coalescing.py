"""One socket write for what an HTTP server protocol writes within one pass of the event loop.

uvicorn's httptools protocol calls `transport.write` once for a response's head and again for
each body message, and uvloop sends at once when its buffer is empty: a non-streaming answer
costs two send system calls (and two loopback TCP segments), a stream's head and first event
two as well. `CoalescingTransport` stands between the protocol and the real transport and
hands the real one, at the end of the pass that wrote them, everything written during it.
"""

from __future__ import annotations

import asyncio
from typing import Any

# Queued bytes at which a write goes out at once: the real transport's default high-water mark,
# so a body written in a loop that never yields still fills that buffer and pauses its writer.
FLUSH_AT = 64 * 1024


class CoalescingTransport(asyncio.Transport):
    """A stream transport that queues what is written and passes it to `transport` in one
    `write` (one chunk) or `writelines` (several) from a callback scheduled with
    `loop.call_soon` at the first write of a pass, or at once when `FLUSH_AT` bytes are queued.
    Contracts kept:

    - order: bytes reach `transport` in the order they were written;
    - `close()`, `write_eof()` and `abort()` first pass on what is queued, so a response
      written and closed in the same pass goes out whole (and an abort drops no more than the
      real transport's own buffer, as it did when every write went straight through);
    - flow control is the real transport's: it calls the protocol's `pause_writing` /
      `resume_writing` when its buffer crosses its limits; at most one pass's writes, and
      under `FLUSH_AT` bytes, wait here, and `get_write_buffer_size()` counts them;
    - what is queued when the connection is lost is dropped, as the real transport drops
      writes to a lost connection;
    - everything else (`get_extra_info`, reading, `is_closing`, limits) is the real
      transport's.
    """

    __slots__ = ("_eof", "_loop", "_queued", "_queued_size", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._queued: list[bytes] = []
        self._queued_size = 0
        self._eof = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        if type(data) is not bytes:
            data = bytes(memoryview(data))  # the caller may reuse its buffer before the flush
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.append(data)
        self._queued_size += len(data)
        if self._queued_size >= FLUSH_AT:
            self._flush()

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        queued = self._queued
        if not queued:
            return  # already passed on by close(), write_eof() or abort()
        self._queued = []
        self._queued_size = 0
        if self._transport.is_closing():
            return  # the connection is gone or going: the real transport would drop these
        if len(queued) == 1:
            self._transport.write(queued[0])
        else:
            self._transport.writelines(queued)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._eof = True
        self._transport.write_eof()

    def abort(self) -> None:
        self._flush()
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._queued_size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()
