"""One asyncio task per admitted request: it watches the client's connection, then settles.

`RequestWatch` reads the request's ASGI ``receive`` channel (the body has been read already, so
the next message is ``http.disconnect``) from admission until the request ends. When the client
disconnects it calls `on_gone` at once (the gateway cancels the gRPC streams, so the workers abort,
and interrupts a request still waiting for its first token). When the request ends, `close()`
stops the watch and the same task runs `settle` (refund, lease release), exactly once, to the end
even when whoever called `close()` is cancelled meanwhile.

Why one task: a request used to spawn a watcher task, a server-stop waiter and a settlement task
(and, around the wait for the first token and the non-streamed body, a task for the work itself);
at hundreds of requests per second that task churn was a tenth of the gateway's CPU
(issue #23's profile). Here the handler does the work in its own task and this one task does the
rest. The one exception is a stream's wait for its first token: it runs in a task of its own, so
that the response can begin after the keep-alive grace and send keep-alive comments while the wait
goes on (gateway/keepalive.py); `on_gone` cancels that task too.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from starlette.types import Receive


class RequestWatch:
    """Watches `receive` for a disconnect (None: nothing to watch) and settles once at `close()`.

    on_gone: called once, on the event loop, when the client disconnects (never after `close()`).
    settle: awaited once after the watch ends; its own errors are its business (it should not raise).
    """

    def __init__(self, receive: Receive | None, on_gone: Callable[[], None],
                 settle: Callable[[], Awaitable[None]]) -> None:
        self._receive = receive
        self._on_gone = on_gone
        self._settle = settle
        self._closing = False
        self._ended = asyncio.Event()  # set by close() once the client is gone (the watch no longer reads)
        self._reading = receive is not None
        self.task = asyncio.get_running_loop().create_task(self._run(), name="request-watch")

    async def _run(self) -> None:
        try:
            if self._receive is not None:
                while (await self._receive())["type"] != "http.disconnect":
                    pass
                self._reading = False
                if not self._closing:
                    self._on_gone()
            if not self._closing:
                await self._ended.wait()
        except asyncio.CancelledError:  # close() ended the watch (or the loop is shutting down): settle anyway
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):  # Python >= 3.11 counts cancellations
                task.uncancel()
        try:
            await self._settle()
        finally:
            # the request is over: hold nothing of it (its session holds this watch, so these
            # references made every request a reference cycle, left to the garbage collector)
            self._receive = self._on_gone = self._settle = None

    async def close(self) -> None:
        """End the watch and wait until the request is settled (idempotent; settlement completes even
        when the caller is cancelled, which is then re-raised to it)."""
        if not self._closing:
            self._closing = True
            if self._reading:
                self.task.cancel()  # stop reading the connection: the response is about to be (or was) sent
            else:
                self._ended.set()
        await asyncio.shield(self.task)


__all__ = ["RequestWatch"]
