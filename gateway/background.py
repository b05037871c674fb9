"""The gateway's background loops: each a named asyncio task its owner starts and stops.

`Background` holds one such task; `every` is the loop most of them run (a step, then a pause);
`cancel_and_wait` stops a task.
Used by admission control (lease renewal, Redis probes), the worker pool (health polls), discovery,
the pool-board reader and the replica heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

log = logging.getLogger("fairshare.gateway")


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` (if any) and wait until it has finished; its result or error is discarded."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


class Background:
    """Runs ``run()`` in a task named `name` from `start` (on the running loop; a second call does
    nothing) until `stop` (cancels it and waits until it has finished)."""

    def __init__(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.run = run
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the task on the running loop (nothing when it runs already)."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait until it has finished (nothing when it does not run)."""
        await cancel_and_wait(self.task)
        self.task = None


async def every(interval_s: Callable[[], float], step: Callable[[], Awaitable[object]], what: str) -> None:
    """Await ``step()`` forever, ``interval_s()`` seconds apart (read again each round). An unexpected
    error is logged as "`what` failed" and the loop goes on; cancel the task to stop it."""
    while True:
        try:
            await step()
        except Exception:
            log.exception("%s failed", what)
        await asyncio.sleep(interval_s())


__all__ = ["Background", "cancel_and_wait", "every"]
