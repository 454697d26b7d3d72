"""A deadline that moves on every relayed chunk, for what a timer per move would cost.

`asyncio.timeout_at(...).reschedule(when)` cancels the loop's timer and makes a new one each
time: about 2-3 µs on uvloop, paid for every chunk of every stream while a stream's stall limit
follows its chunks. `MovingDeadline` keeps one timer. Moving the deadline later is an
assignment (`move_to`); the timer, when it fires before the deadline as it now stands, arms
itself again for it. Moving it earlier re-arms at once. Expiry is `asyncio.timeout_at`'s: the
task is cancelled, and leaving the block turns that cancellation into `TimeoutError` (a
cancellation from elsewhere, a client that left or a drain, stays a cancellation).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

# uvloop's timers count whole milliseconds: one may fire up to this much before its time.
TIMER_RESOLUTION = 0.001


class MovingDeadline:
    """`async with MovingDeadline(when) as deadline:` ... `deadline.move_to(later)`; `when` is
    in the loop's clock (`loop.time()`)."""

    __slots__ = ("_armed_at", "_cancelling", "_expired", "_handle", "_loop", "_task", "when")

    def __init__(self, when: float) -> None:
        self.when = when
        self._armed_at = when
        self._expired = False
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> MovingDeadline:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "MovingDeadline runs inside a task"
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = self._loop.call_at(self.when, self._fire)
        return self

    def move_to(self, when: float) -> None:
        """The deadline is `when` from now on (no timer work unless it is earlier than the
        timer is armed for: a deadline moved later and back costs nothing)."""
        if when < self._armed_at and self._handle is not None:
            self._handle.cancel()
            self._handle = self._loop.call_at(when, self._fire)
            self._armed_at = when
        self.when = when

    def _fire(self) -> None:
        if self.when - self._loop.time() > TIMER_RESOLUTION:  # moved later since armed
            self._handle = self._loop.call_at(self.when, self._fire)
            self._armed_at = self.when
            return
        self._handle = None
        self._expired = True
        self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc
