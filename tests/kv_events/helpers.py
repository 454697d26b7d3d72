"""Shared pieces of the KV-event tests: a scripted publisher on real ZMQ sockets, batch
payloads written with msgpack directly, a recording sink and a polling wait."""

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvgate.routing.kv_events import BlockRemoved, BlockStored

TOPIC = b"kv-events"
END = (-1).to_bytes(8, "big", signed=True)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def stored(tokens: list[int], block_hashes: list[int], parent: int | None = None) -> list[Any]:
    """A BlockStored event (array form) of blocks of 2 tokens."""
    return ["BlockStored", block_hashes, parent, tokens, 2, None, "GPU"]


def removed(block_hashes: list[int]) -> list[Any]:
    return ["BlockRemoved", block_hashes, "GPU"]


def cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def batch(*events: list[Any], ts: float | None = None) -> bytes:
    """An array-encoded EventBatch payload."""
    return msgpack.packb([time.time() if ts is None else ts, list(events), 0])


def block(token: int) -> bytes:
    """A batch storing one block whose tokens are [token, token] (hash = token)."""
    return batch(stored([token, token], [token]))


class ScriptedPublisher:
    """An XPUB socket (a PUB that reports subscriptions, so a test can wait for its
    subscriber) and a ROUTER answering replay requests from `replay`, on loopback ports."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self._pub = context.socket(zmq.XPUB)
        self._router = context.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not just the first
        self.url = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_url = f"tcp://127.0.0.1:{port}"
        self.replay: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "ScriptedPublisher":
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._pub.close(linger=0)
        self._router.close(linger=0)

    async def wait_for_subscriber(self) -> None:
        """Return once a SUB socket subscribed to the topic."""
        async with asyncio.timeout(5):
            assert await self._pub.recv() == b"\x01" + TOPIC

    async def send(self, seq: int, payload: bytes, *, replayable: bool = True) -> None:
        """Publish a batch (and keep it for replay unless `replayable` is false)."""
        if replayable:
            self.replay[seq] = payload
        await self._pub.send_multipart([TOPIC, seq_frame(seq), payload])

    async def send_frames(self, frames: list[bytes]) -> None:
        await self._pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            identity, delimiter, start = await self._router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            self.replay_requests.append(first)
            for seq in sorted(self.replay):
                if seq >= first:
                    await self._router.send_multipart(
                        [identity, delimiter, seq_frame(seq), self.replay[seq]]
                    )
            await self._router.send_multipart([identity, delimiter, END, b""])


class RecordingSink:
    """A KvEventSink that records its calls as tuples."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.stored_events: list[BlockStored] = []

    def stored(self, endpoint: str, event: BlockStored) -> None:
        self.calls.append(("stored", endpoint, event.token_ids))
        self.stored_events.append(event)

    def removed(self, endpoint: str, event: BlockRemoved) -> None:
        self.calls.append(("removed", endpoint, event.block_hashes))

    def cleared(self, endpoint: str) -> None:
        self.calls.append(("cleared", endpoint))

    def tokens(self) -> list[tuple[int, ...]]:
        """The token ids of every stored event, in order."""
        return [call[2] for call in self.calls if call[0] == "stored"]


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Poll `condition` every 10 ms; fail if it is still false after `seconds`."""
    async with asyncio.timeout(seconds):
        # Polling: the conditions read state that changes without an event to wait on.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
