"""One endpoint's KV-event subscriber: applies the engine's batches in sequence order to a
sink and says whether the sink's view of the engine's cache is exact.

Modes:
- `precise`: every batch since a known-empty cache (a fresh publisher's sequence 0, or an
  `AllBlocksCleared`) reached the sink, in order;
- `approximate`, with a reason: `starting` (nothing heard yet), `joined_late` (the first
  batch heard is not 0 and the replay buffer no longer reaches back to 0), `gap_unfilled`
  (batches missing and not replayable), `malformed_batch` (a batch that would not decode),
  `publisher_restart` (the sequence went backwards and the new stream's start is missing),
  `stalled` (no batch for `stall_after` seconds after `note_traffic()`), `engine_back` (the
  engine passed its health checks again after failing them, `engine_back()`: restarted
  empty, or kept its cache), `subscriber_failed`.

A missing batch is asked for on the replay socket; a stall ends with the next batch, and so
does `engine_back` (a batch that continues the sequence: the cache was kept; one that starts
it again: a restart, handled as below). The other losses end with `AllBlocksCleared` or a
restarted publisher heard from sequence 0. A
restart (a sequence number at or below the last one applied, with other contents) first
calls `sink.cleared`: the engine's hashes are salted per process and its cache is gone.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import zmq
import zmq.asyncio

from .decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecodeError,
    decode_batch,
    split_message,
)
from .replay import fetch_replay

logger = logging.getLogger(__name__)

Mode = Literal["precise", "approximate"]
PRECISE: Mode = "precise"
APPROXIMATE: Mode = "approximate"

STARTING = "starting"
JOINED_LATE = "joined_late"
GAP_UNFILLED = "gap_unfilled"
MALFORMED_BATCH = "malformed_batch"
PUBLISHER_RESTART = "publisher_restart"
STALLED = "stalled"
SUBSCRIBER_FAILED = "subscriber_failed"
FRESH_START = "fresh_start"
CLEARED = "cleared"
RESUMED = "resumed"
ENGINE_BACK = "engine_back"

_Batches = list[tuple[int, bytes]]


class KvEventSink(Protocol):
    """Receives one endpoint's events in the engine's order. An exception ends the
    subscriber (logged; mode `approximate`, reason `subscriber_failed`).

    Key blocks by token ids: the hashes are salted per engine process and serve only to
    resolve later `BlockRemoved` events (a block's parent may be unknown, for example
    after `AllBlocksCleared` while a request was running).
    """

    def stored(self, endpoint: str, event: BlockStored) -> None:
        """Full blocks were cached."""

    def removed(self, endpoint: str, event: BlockRemoved) -> None:
        """Blocks were evicted."""

    def cleared(self, endpoint: str) -> None:
        """Every block of the endpoint is gone (reset, or a restarted publisher)."""


@dataclass
class SubscriberCounters:
    """Monotonic counters, plus the lag of the newest batch applied (wall clock now minus
    the batch's `ts`, so it includes any clock offset between the hosts)."""

    batches_applied: int = 0
    events_applied: int = 0
    gaps_filled: int = 0
    gaps_unfilled: int = 0
    malformed_dropped: int = 0
    restarts: int = 0
    stalls: int = 0
    mode_changes: int = 0
    last_event_lag_seconds: float | None = None


ModeListener = Callable[[str, Mode, str], None]


class KvEventSubscriber:
    """Subscribes to `url` (ZMQ PUB, `topic`) for `endpoint` and feeds `sink`.

    `start()` runs it as a task on the running loop; `stop()` cancels it and closes its
    sockets. `on_mode_change(endpoint, mode, reason)` is called on every mode change.
    """

    def __init__(
        self,
        endpoint: str,
        url: str,
        sink: KvEventSink,
        *,
        topic: str = "kv-events",
        replay_url: str | None = None,
        stall_after: float = 15.0,
        replay_timeout: float = 2.0,
        context: zmq.asyncio.Context | None = None,
        on_mode_change: ModeListener | None = None,
    ) -> None:
        if stall_after <= 0 or replay_timeout <= 0:
            raise ValueError("stall_after and replay_timeout must be positive")
        self.endpoint = endpoint
        self.counters = SubscriberCounters()
        self._url = url
        self._sink = sink
        self._topic = topic
        self._replay_url = replay_url
        self._stall_after = stall_after
        self._replay_timeout = replay_timeout
        self._own_context = context is None
        self._context = context if context is not None else zmq.asyncio.Context()
        self._on_mode_change = on_mode_change
        self._task: asyncio.Task[None] | None = None
        self._last_seq: int | None = None  # -1: a publisher known to have sent nothing yet
        self._lost_reason: str | None = STARTING
        self._stalled = False
        self._awaiting_since: float | None = None
        self._awaiting = 0  # decisions sent since the last batch that expect one
        self._other_topic: str | None = None  # a topic heard that is not ours (logged once)
        self._replayed: dict[int, int] = {}  # seq -> hash(payload) of the initial replay
        self._mode: Mode = APPROXIMATE
        self._reason = STARTING

    @property
    def mode(self) -> Mode:
        """`precise` when the sink's view is exact, else `approximate`."""
        return self._mode

    @property
    def reason(self) -> str:
        """Why the subscriber is in its mode (see the module docstring)."""
        return self._reason

    def note_traffic(self) -> None:
        """Tell the subscriber a request that fills at least one block was sent to the
        endpoint: no batch within `stall_after` seconds from now means a stalled stream."""
        self._awaiting += 1
        if self._awaiting_since is None:
            self._awaiting_since = time.monotonic()

    def traffic_refused(self) -> None:
        """A request `note_traffic` announced was refused by the engine (it stores nothing):
        when no other is awaited, no batch is owed."""
        if self._awaiting:
            self._awaiting -= 1
            if not self._awaiting:
                self._awaiting_since = None

    def engine_back(self) -> None:
        """The engine passed its health checks again after failing them: it may have
        restarted with an empty cache (its next batch starts the sequence again) or kept it
        (its next batch continues the sequence). Approximate until that batch tells."""
        if self._lost_reason is None:
            self._lose(ENGINE_BACK)

    def start(self) -> None:
        """Run the subscription as a task on the running loop."""
        if self._task is not None:
            raise RuntimeError("subscriber already started")
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv-events {self.endpoint}"
        )
        self._task.add_done_callback(self._on_task_done)

    async def stop(self) -> None:
        """Cancel the task, close its sockets (and the context, if it made its own)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # a failure was logged when the task ended
        if self._own_context:
            self._context.term()

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        logger.error("kv events %s: subscriber failed", self.endpoint, exc_info=task.exception())
        self._lose(SUBSCRIBER_FAILED)

    # --- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic.encode())
        poll_ms = max(10, int(min(self._stall_after / 4, 1.0) * 1000))
        try:
            sub.connect(self._url)
            await self._initial_sync()
            while True:
                if await sub.poll(poll_ms):
                    await self._on_frames(await sub.recv_multipart())
                self._check_stall()
        finally:
            sub.close(linger=0)

    async def _initial_sync(self) -> None:
        """Learn what the publisher sent before we connected from its replay buffer."""
        if self._replay_url is None:
            return
        batches = await self._replay(0)
        if batches is None:
            return
        if not batches:
            self._last_seq = -1
            self._resync(FRESH_START)
            return
        available = _select(batches, 0, None)
        if available[0][0] == 0:
            self._resync(FRESH_START)
        self._apply_range(available, 0, available[-1][0] + 1, JOINED_LATE)
        self._replayed = {seq: hash(payload) for seq, payload in available}

    async def _on_frames(self, frames: list[bytes]) -> None:
        try:
            message = split_message(frames)
        except KvEventDecodeError:
            self.counters.malformed_dropped += 1
            return
        if message.topic != self._topic:
            # Subscriptions match by prefix: `kv` hears `kv-events`. Not ours, and no sign of
            # life of the stream we wait for (a wrong topic ends in `stalled`).
            if self._other_topic != message.topic:
                self._other_topic = message.topic
                logger.warning(
                    "kv events %s: ignoring messages on topic %r (configured: %r)",
                    self.endpoint,
                    message.topic,
                    self._topic,
                )
            return
        self._awaiting_since, self._awaiting = None, 0
        seq, payload = message.seq, message.payload
        if seq < 0:
            self.counters.malformed_dropped += 1
            return
        reason = JOINED_LATE
        if self._last_seq is not None and seq <= self._last_seq:
            if self._replayed.get(seq) == hash(payload):
                return  # already applied from the initial replay
            self._restarted()
            reason = PUBLISHER_RESTART
        self._replayed.clear()
        if self._last_seq is None:
            await self._sync_start(seq, reason)
        elif seq > self._last_seq + 1:
            await self._fill_gap(self._last_seq + 1, seq)
        self._apply(seq, payload)
        if self._lost_reason == ENGINE_BACK:  # the sequence went on: the cache was kept
            self._resync(RESUMED)
        if self._stalled:
            self._stalled = False
            self._refresh(RESUMED)

    def _check_stall(self) -> None:
        since = self._awaiting_since
        if since is None or self._stalled or time.monotonic() - since < self._stall_after:
            return
        self._stalled = True
        self.counters.stalls += 1
        self._refresh(STALLED)

    def _restarted(self) -> None:
        self.counters.restarts += 1
        self._last_seq = None
        self._lose(PUBLISHER_RESTART)
        self._sink.cleared(self.endpoint)

    async def _sync_start(self, seq: int, reason: str) -> None:
        """Before applying `seq`, the first batch of a stream heard: replay 0..seq-1."""
        available = _select(await self._replay(0) or [], 0, seq) if seq > 0 else []
        if seq == 0 or (available and available[0][0] == 0):
            self._resync(FRESH_START)
        self._apply_range(available, 0, seq, reason)

    async def _fill_gap(self, start: int, end: int) -> None:
        """Replay the missing batches start..end-1 and apply those that came."""
        available = _select(await self._replay(start) or [], start, end)
        if self._apply_range(available, start, end, GAP_UNFILLED):
            self.counters.gaps_filled += 1
        else:
            self.counters.gaps_unfilled += 1

    async def _replay(self, start: int) -> _Batches | None:
        if self._replay_url is None:
            return None
        try:
            return await fetch_replay(self._context, self._replay_url, start, self._replay_timeout)
        except KvEventDecodeError:
            self.counters.malformed_dropped += 1
            return None

    def _apply_range(self, available: _Batches, start: int, end: int, reason: str) -> bool:
        """Apply `available` (sorted, within start..end-1); a hole loses precision with
        `reason` where it occurs, so a later `AllBlocksCleared` still restores it. True if
        nothing was missing and everything decoded."""
        expected, complete = start, True
        for seq, payload in available:
            if seq != expected:
                complete = False
                self._lose(reason)
            complete = self._apply(seq, payload) and complete
            expected = seq + 1
        if expected != end:
            complete = False
            self._lose(reason)
        return complete

    def _apply(self, seq: int, payload: bytes) -> bool:
        self._last_seq = seq
        try:
            batch = decode_batch(payload)
        except KvEventDecodeError:
            self.counters.malformed_dropped += 1
            self._lose(MALFORMED_BATCH)
            return False
        sink, endpoint = self._sink, self.endpoint
        for event in batch.events:
            if isinstance(event, BlockStored):
                sink.stored(endpoint, event)
            elif isinstance(event, BlockRemoved):
                sink.removed(endpoint, event)
            else:
                assert isinstance(event, AllBlocksCleared)
                sink.cleared(endpoint)
                self._resync(CLEARED)
        counters = self.counters
        counters.batches_applied += 1
        counters.events_applied += len(batch.events)
        counters.last_event_lag_seconds = max(0.0, time.time() - batch.ts)
        return True

    # --- mode ------------------------------------------------------------------------

    def _lose(self, reason: str) -> None:
        self._lost_reason = reason
        self._refresh(reason)

    def _resync(self, reason: str) -> None:
        self._lost_reason = None
        self._refresh(reason)

    def _refresh(self, precise_reason: str) -> None:
        if self._lost_reason is not None:
            mode, reason = APPROXIMATE, self._lost_reason
        elif self._stalled:
            mode, reason = APPROXIMATE, STALLED
        else:
            mode, reason = PRECISE, precise_reason
        changed = mode != self._mode
        if not changed and (mode == PRECISE or reason == self._reason):
            return
        self._reason = reason
        logger.info("kv events %s: %s (%s)", self.endpoint, mode, reason)
        if not changed:  # another reason to stay approximate
            return
        self._mode = mode
        self.counters.mode_changes += 1
        if self._on_mode_change is not None:
            self._on_mode_change(self.endpoint, mode, reason)


def _select(batches: _Batches, start: int, end: int | None) -> _Batches:
    """The batches with start <= seq < end (no end: all from start), sorted, one per seq."""
    chosen = {
        seq: payload for seq, payload in batches if seq >= start and (end is None or seq < end)
    }
    return sorted(chosen.items())
