"""A response's head and the body that follows it in one socket write.

uvicorn's httptools protocol calls `transport.write` once for a response's head and again for
each body message, and uvloop sends at once when its buffer is empty: a non-streaming answer
costs two send system calls (and two loopback TCP segments), a stream's head and first event
two as well. `CoalescingTransport` stands between the protocol and the real transport, holds
each head back until the next write, and hands both to the real transport in one call.
"""

from __future__ import annotations

import asyncio
from typing import Any

# Every HTTP/1.x response (interim ones included) starts with its status line.
_HEAD_START = b"HTTP/"


class CoalescingTransport(asyncio.Transport):
    """A stream transport that holds a write beginning with `HTTP/` (a response's head) and
    passes it to `transport` together with the next write, in one `writelines`, or on its own
    from a `loop.call_soon` callback at the end of the event loop's pass when nothing follows
    in that pass. Every other write goes straight through, so a stream's later events are
    sent exactly when they were before. Contracts kept:

    - order: bytes reach `transport` in the order they were written;
    - `close()`, `write_eof()` and `abort()` first pass on a held head, so a response written
      and closed in the same pass goes out whole (and an abort drops no more than the real
      transport's own buffer, as when every write went straight through);
    - flow control is the real transport's: it calls the protocol's `pause_writing` /
      `resume_writing` when its buffer crosses its limits; at most one head waits here,
      and `get_write_buffer_size()` counts it;
    - a head still held when the connection is lost is dropped, as the real transport drops
      writes to a lost connection;
    - everything else (`get_extra_info`, reading, `is_closing`, limits) is the real
      transport's.
    """

    __slots__ = ("_eof", "_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self._eof = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.writelines((head, data))
        elif data[:5] == _HEAD_START and not self._eof:
            self._head = bytes(data)  # a copy: the caller may reuse its buffer meanwhile
            self._loop.call_soon(self._release_head)
        else:
            self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _release_head(self) -> None:
        head = self._head
        if head is None:
            return  # gone out with the write that followed it
        self._head = None
        if not self._transport.is_closing():  # else the connection is gone: drop, as it would
            self._transport.write(head)

    def close(self) -> None:
        self._release_head()
        self._transport.close()

    def write_eof(self) -> None:
        self._release_head()
        self._eof = True
        self._transport.write_eof()

    def abort(self) -> None:
        self._release_head()
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def get_write_buffer_size(self) -> int:
        held = 0 if self._head is None else len(self._head)
        return self._transport.get_write_buffer_size() + held

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
