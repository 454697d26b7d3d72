"""Publishes one simulated engine's KV-cache changes as vLLM does with `--kv-events-config`.

The engine core records events as its block pool changes (`stored`, `removed`, `cleared`)
and calls `flush()` once per scheduler step: the step's events leave as one batch with the
next sequence number, on a ZMQ PUB socket with a non-blocking send (a slow or absent
subscriber loses messages, the engine never waits), and are kept in a bounded buffer that a
ROUTER socket replays on request:

    request  (DEALER -> ROUTER): [b"", start_seq as 8 big-endian bytes]
    answers:                     [b"", seq (8 bytes), payload] per buffered batch >= start_seq
    end:                         [b"", -1 as 8 signed big-endian bytes, b""]

Block hashes are the pool's hashes mixed with a random salt drawn per publisher (and per
restart), as vLLM's differ between processes with a random PYTHONHASHSEED: a consumer must
key blocks by token ids. Event-stream faults (`KvEventFault`) drop sequence numbers or stop
the PUB side; `restart()` starts a new sequence at 0 with a new salt.
"""

import asyncio
import contextlib
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import zmq
import zmq.asyncio

from kvgate.sim_tokenizer import token_ids

from .kv_event_wire import (
    Event,
    KvEventEncoding,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
    sequence_bytes,
)

TOPIC = "kv-events"
_END_OF_REPLAY = sequence_bytes(-1)
_HASH_MASK = (1 << 64) - 1

KvEventFaultMode = Literal["drop", "stop", "restart"]
KV_EVENT_FAULT_MODES: tuple[KvEventFaultMode, ...] = ("drop", "stop", "restart")


@dataclass(frozen=True)
class KvEventFault:
    """An event-stream fault.

    `drop`: batches `from_seq`..`to_seq` (inclusive) are not sent on the PUB socket; with
    `replay=False` they are also missing from the replay buffer (an unfillable gap).
    `stop`: nothing is sent on the PUB socket (batches are still numbered and buffered).
    `restart`: an action, not a state: new sequence from 0, new salt, cleared cache.
    """

    mode: KvEventFaultMode
    from_seq: int = 0
    to_seq: int = 0
    replay: bool = True

    @classmethod
    def from_json(cls, spec: Any) -> "KvEventFault":
        """Validate a JSON spec such as `{"mode": "drop", "from_seq": 3, "to_seq": 5}`."""
        if not isinstance(spec, dict) or spec.get("mode") not in KV_EVENT_FAULT_MODES:
            raise ValueError(f"kv-events fault needs a mode among {list(KV_EVENT_FAULT_MODES)}")
        unknown = set(spec) - {"mode", "from_seq", "to_seq", "replay"}
        if unknown:
            raise ValueError(f"unknown kv-events fault keys {sorted(unknown)}")
        from_seq, to_seq = spec.get("from_seq"), spec.get("to_seq")
        replay = spec.get("replay", True)
        if spec["mode"] == "drop" and not (
            type(from_seq) is int and type(to_seq) is int and 0 <= from_seq <= to_seq
        ):
            raise ValueError("drop needs the range it drops: integers 0 <= from_seq <= to_seq")
        if spec["mode"] != "drop" and (from_seq is not None or to_seq is not None):
            raise ValueError("from_seq and to_seq are for drop only")
        if not isinstance(replay, bool):
            raise ValueError("replay must be true or false")
        return cls(spec["mode"], from_seq or 0, to_seq or 0, replay)

    def as_json(self) -> dict[str, Any]:
        """The JSON form `from_json` accepts."""
        if self.mode == "drop":
            return {
                "mode": "drop",
                "from_seq": self.from_seq,
                "to_seq": self.to_seq,
                "replay": self.replay,
            }
        return {"mode": self.mode}

    def drops(self, seq: int) -> bool:
        """True if batch `seq` must not be sent on the PUB socket."""
        return self.mode == "stop" or (self.mode == "drop" and self.from_seq <= seq <= self.to_seq)


class KvEventPublisher:
    """The PUB and replay sockets of one engine; all methods run on the engine's loop."""

    def __init__(self, encoding: KvEventEncoding, block_size: int, replay_batches: int) -> None:
        if replay_batches < 1:
            raise ValueError("the replay buffer must hold at least one batch")
        self._encoding = encoding
        self._block_size = block_size
        self._context = zmq.asyncio.Context()
        # A plain socket: a non-blocking send returns at once whatever the subscribers do.
        self._pub = zmq.Socket(self._context, zmq.PUB)
        self._router = self._context.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        self._pending: list[Event] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._next_seq = 0
        self._salt = secrets.randbits(64)
        self._replay_task: asyncio.Task[None] | None = None
        self.fault: KvEventFault | None = None
        self.url = ""
        self.replay_url = ""
        self.batches_published = 0
        self.batches_dropped = 0

    def bind(self, host: str, port: int, replay_port: int) -> None:
        """Bind PUB on `host:port` and replay on `host:replay_port` (0: an ephemeral port)."""
        try:
            if port:
                self._pub.bind(f"tcp://{host}:{port}")
            else:
                port = self._pub.bind_to_random_port(f"tcp://{host}")
            if replay_port:
                self._router.bind(f"tcp://{host}:{replay_port}")
            else:
                replay_port = self._router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as error:
            self._close_sockets()
            raise OSError(f"kv events: cannot bind port {port} or {replay_port}: {error}") from None
        self.url = f"tcp://{host}:{port}"
        self.replay_url = f"tcp://{host}:{replay_port}"

    def start(self) -> None:
        """Start answering replay requests on the running loop."""
        self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def close(self) -> None:
        """Stop the replay task and close both sockets."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._context.term()

    # --- recording (called by the block pool and the engine core) --------------------

    def stored(
        self, block_hashes: Sequence[int], parent: int | None, tokens: Sequence[str]
    ) -> None:
        """Full blocks `block_hashes` (chained after `parent`) now cache `tokens`."""
        self._pending.append(
            block_stored(
                [self._published(h) for h in block_hashes],
                None if parent is None else self._published(parent),
                token_ids(tokens),
                self._block_size,
            )
        )

    def removed(self, block_hashes: list[int]) -> None:
        """`block_hashes` were evicted."""
        self._pending.append(block_removed([self._published(h) for h in block_hashes]))

    def cleared(self) -> None:
        """The prefix cache was reset."""
        self._pending.append(all_blocks_cleared())

    def _published(self, block_hash: int) -> int:
        return hash((self._salt, block_hash)) & _HASH_MASK

    # --- publishing ------------------------------------------------------------------

    def flush(self) -> None:
        """Publish the events recorded since the last flush as one batch (none: nothing)."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(time.time(), events, self._encoding)
        fault = self.fault
        if fault is None or not fault.drops(seq) or fault.replay:
            self._buffer.append((seq, payload))
        if fault is not None and fault.drops(seq):
            self.batches_dropped += 1
            return
        try:
            self._pub.send_multipart(
                [TOPIC.encode(), sequence_bytes(seq), payload], flags=zmq.NOBLOCK
            )
        except zmq.Again:  # high-water mark reached: PUB semantics, the batch is lost
            self.batches_dropped += 1
            return
        self.batches_published += 1

    def restart(self) -> None:
        """Behave as a restarted engine's publisher: sequence from 0, new salt, no history
        (the caller clears the cache first; events recorded until now are discarded)."""
        self._pending.clear()
        self._buffer.clear()
        self._next_seq = 0
        self._salt = secrets.randbits(64)
        self.fault = None

    def describe(self) -> dict[str, Any]:
        """State for `GET /sim/kv-events/faults`."""
        return {
            "fault": self.fault.as_json() if self.fault else None,
            "next_seq": self._next_seq,
            "url": self.url,
            "replay_url": self.replay_url,
            "batches_published": self.batches_published,
            "batches_dropped": self.batches_dropped,
        }

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            identity, *request = frames
            # DEALER clients send an empty delimiter frame first (as vLLM's do); echo it.
            envelope = [identity, b""] if len(request) == 2 and request[0] == b"" else [identity]
            start = request[-1] if request else b""
            if len(start) == 8:
                first = int.from_bytes(start, "big", signed=True)
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        await self._router.send_multipart([*envelope, sequence_bytes(seq), payload])
            await self._router.send_multipart([*envelope, _END_OF_REPLAY, b""])
