"""MovingDeadline (the stream relay's first-token and stall deadline) behaves as
`asyncio.timeout_at` with `reschedule`, on uvloop as the gateway runs it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from kvgate.upstream.moving_deadline import MovingDeadline


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    uvloop.run(scenario())


def test_it_expires_at_its_deadline_as_a_timeout() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            async with MovingDeadline(start + 0.05):
                await asyncio.sleep(5)
        assert 0.04 <= loop.time() - start < 2.0
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    run(scenario)


def test_moved_later_on_every_chunk_it_lets_a_steady_stream_run_past_the_first_deadline() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        chunks = 0
        with pytest.raises(TimeoutError):
            async with MovingDeadline(start + 0.1) as deadline:
                for _ in range(8):  # a chunk every 0.03 s: 0.24 s in all, each gap < 0.1
                    await asyncio.sleep(0.03)
                    chunks += 1
                    deadline.move_to(loop.time() + 0.1)
                await asyncio.sleep(5)  # the stream stalls
        assert chunks == 8, "no chunk gap reached the stall limit"
        assert loop.time() - start >= 0.24 + 0.09

    run(scenario)


def test_moved_earlier_it_expires_at_the_earlier_time() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            async with MovingDeadline(start + 30) as deadline:
                deadline.move_to(start + 0.05)
                await asyncio.sleep(5)
        assert loop.time() - start < 2.0

    run(scenario)


def test_a_block_that_ends_in_time_leaves_no_timer_and_no_cancellation() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with MovingDeadline(loop.time() + 0.05) as deadline:
            deadline.move_to(loop.time() + 0.06)
        await asyncio.sleep(0.15)  # past both: nothing fires into this task
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        assert deadline._handle is None

    run(scenario)


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        async def relay() -> None:
            async with MovingDeadline(loop.time() + 30):
                await asyncio.sleep(5)

        task = loop.create_task(relay())
        await asyncio.sleep(0.02)
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario)


def test_an_error_inside_the_block_passes_through_and_disarms_it() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(ValueError):
            async with MovingDeadline(loop.time() + 0.05):
                raise ValueError("engine sent garbage")
        await asyncio.sleep(0.1)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    run(scenario)


def test_a_block_that_swallows_the_expiry_ends_as_it_chose() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with MovingDeadline(loop.time() + 0.02):
            # As with asyncio.timeout_at: no TimeoutError without the cancellation.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(5)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    run(scenario)
