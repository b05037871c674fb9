"""Stopping the gateway's background tasks (health polls, the pool board reader, the replica heartbeat,
the Redis outage probe): `cancel_and_wait`."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` (if any) and wait until it has finished; its result or error is discarded."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
