"""Background tasks with an owner: started by the object that needs them, cancelled and awaited
when it stops, so no task outlives its owner or is left for the garbage collector."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class OwnedTask:
    """One named background task. `start` runs a coroutine unless one is already running;
    `stop` cancels it and waits for it to end (idempotent)."""

    __slots__ = ("_task", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, coroutine: Coroutine[Any, Any, None]) -> None:
        if self.running:
            coroutine.close()
            return
        self._task = asyncio.get_running_loop().create_task(coroutine, name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
