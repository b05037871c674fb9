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


RECANCEL_INTERVAL_S = 0.5  # how long cancel_and_wait waits before it cancels a task again


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` (if any) and wait until it has finished; its result or error is discarded.

    A task can swallow one cancellation: a loop that catches a library's error raised in place of
    the ``CancelledError`` (grpc.aio's unary call, cancelled just as it fails, raises ``AioRpcError``)
    goes round again. So the task is cancelled again every `RECANCEL_INTERVAL_S` seconds until it
    has finished; a task that would never end otherwise (and the shutdown waiting on it) ends.
    Cancelling the caller while it waits raises ``CancelledError`` as usual.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_INTERVAL_S)
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


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


__all__ = ["Background", "RECANCEL_INTERVAL_S", "cancel_and_wait", "every"]
