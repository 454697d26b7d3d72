"""Per-connection control the ASGI interface does not offer: aborting, watching for hang-ups.

`abort_connection` reaches through uvicorn's `send` callable to the TCP transport (uvicorn's
httptools and h11 request cycles both expose it as `.transport`); faults need this to drop a
connection with no response at all, which an ASGI app cannot otherwise do.
"""

import asyncio
from collections.abc import Callable

from .asgi_types import Receive, Send


def abort_connection(send: Send) -> None:
    """Reset the client's TCP connection immediately, discarding anything unsent."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise RuntimeError("aborting a connection needs uvicorn's h11 or httptools protocol")
    transport.abort()


class DisconnectWatch:
    """Listens for the client hanging up while a response is produced.

    Use as an async context manager after the request body has been read; `on_disconnect`
    runs once, promptly, when the client goes away. The listener task is cancelled on exit.
    """

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        self._receive = receive
        self._on_disconnect = on_disconnect
        self.disconnected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "DisconnectWatch":
        self._task = asyncio.get_running_loop().create_task(self._listen())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.disconnected.set()
        self._on_disconnect()

    async def sleep(self, seconds: float | None, closing: asyncio.Event) -> bool:
        """Sleep up to `seconds` (None: no limit); return False early if the client left or
        the engine closes, True if the full time passed."""
        waiters = [
            asyncio.ensure_future(self.disconnected.wait()),
            asyncio.ensure_future(closing.wait()),
        ]
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        return not done
