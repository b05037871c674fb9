"""One pipeline per event-loop iteration for the Redis commands of concurrent requests.

Every completion request makes two Redis calls (admission and settlement, gateway/redis_buckets.py).
Sent one by one, each costs the gateway ~90 us of CPU in redis-py (taking a connection from the
pool, its timeout, the retry wrapper, packing, the read) and a round trip of its own. Requests that
arrive together issue their calls in the same event-loop iteration; `CommandBatcher` collects them
and sends them in one pipeline (one connection, one write, one read of all the answers; ~25 us a
command measured at 32 a pipeline), then hands each caller its own answer. A lone request pays one
``loop.call_soon`` more and nothing else: it is sent in the iteration after it was issued.

A pipeline is not a transaction (MULTI/EXEC): each command runs on its own, as it would have sent
alone, so one command's error (NOSCRIPT, a script error) is raised to its caller only. An error of
the connection (Redis down, a timeout) is raised to every caller of that pipeline, as each of their
calls would have failed alone. A caller cancelled while waiting is answered nothing; its command may
have run, as with a call cancelled in flight.

Only a single Redis server (``redis.asyncio.Redis``) is batched: on Redis Cluster the calls go
out one by one (`CommandBatcher.direct`), since a cluster pipeline splits by hash slot anyway.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError


class CommandBatcher:
    """Sends the commands `execute` is given within one event-loop iteration as one pipeline.

    redis: the client (``redis.asyncio.Redis``; a cluster client is called directly, command by
    command). max_batch: most commands in one pipeline (a longer burst is cut into several).
    `batches` and `commands` count what was sent (pipelines or lone commands, and commands in them).
    """

    def __init__(self, redis, max_batch: int = 256) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self.direct = not isinstance(redis, Redis)
        self.batches = 0
        self.commands = 0
        self._pending: list[tuple[tuple, asyncio.Future]] = []
        self._flushing: set[asyncio.Task] = set()

    async def execute(self, *args: Any) -> Any:
        """Run the Redis command `args` (e.g. ``"EVALSHA", sha, 2, k1, k2, a1``) and return its
        answer. Raises what redis-py raises for it (``redis.exceptions.NoScriptError``,
        ``ResponseError``, ``ConnectionError``, ``TimeoutError``, ...)."""
        if self.direct:
            return await self.redis.execute_command(*args)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((args, fut))
        return await fut

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        for i in range(0, len(batch), self.max_batch):
            task = asyncio.ensure_future(self._send(batch[i:i + self.max_batch]))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _send(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        self.batches += 1
        self.commands += len(batch)
        try:
            if len(batch) == 1:  # no pipeline object for a lone command
                answers = [await _answer(self.redis.execute_command(*batch[0][0]))]
            else:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for args, _ in batch:
                        pipe.execute_command(*args)
                    answers = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:
            _fail(batch, RedisConnectionError("the gateway stopped before Redis answered"))
            raise
        except Exception as e:  # the connection failed: every command of the pipeline fails with it
            _fail(batch, e)
            return
        for (_, fut), answer in zip(batch, answers):
            if fut.done():
                continue
            if isinstance(answer, BaseException):
                fut.set_exception(answer)
            else:
                fut.set_result(answer)

    async def aclose(self) -> None:
        """Wait for the pipelines in flight (their callers get their answers or errors)."""
        if self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)


async def _answer(coro) -> Any:
    """`coro`'s result, or the ResponseError it raised (the error of the command, not of the
    connection: returned, as ``pipe.execute(raise_on_error=False)`` returns it)."""
    try:
        return await coro
    except ResponseError as e:
        return e


def _fail(batch: list[tuple[tuple, asyncio.Future]], err: BaseException) -> None:
    for _, fut in batch:
        if not fut.done():
            fut.set_exception(err)
