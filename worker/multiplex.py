"""GenerateMany: many generations on one gRPC stream, each run by the servicer's own ``Generate``.

A ``grpc.aio`` call costs the gateway about 0.4-0.5 ms of CPU on its own (the call object, its
metadata, its deadline, one completion-queue batch per operation), more than the rest of a
short request. So the gateway keeps one ``GenerateMany`` stream open per worker
(gateway/worker_stream.py) and sends every request on it: a ``GenerateOpen`` carries the request
with what the call's metadata and deadline would have carried, and the answers come back as
``GenerateEvent`` s tagged with its request id, every event ready at one moment in one message.

What a generation does has one home, the servicer's ``Generate``: `serve_generate_many` runs it
once per open, with a `StreamContext` in place of the call's context, so authentication, draining,
grammar refusal, coalescing and cancellation behave on this path exactly as on a ``Generate`` call.
A ``context.abort`` ends that one generation (a `GenerateEnd` with its code, details and trailing
metadata), not the stream. A ``cancel`` from the gateway cancels that generation's task, as
cancelling its call would. When the stream ends (the gateway went away, the server stops), every
generation still on it is cancelled.

Servicers take the method by inheriting `GenerateManyMixin` (reference worker, SGLang worker, the
bench's echo worker). No torch, no engine import here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Callable

import grpc

from fairshare.contract import DEADLINE_DETAILS as _DEADLINE_DETAILS
from fairshare.contract import STREAM_MESSAGE_BYTES, fitting
from fairshare.v1 import worker_pb2 as pb

log = logging.getLogger("fairshare.worker.multiplex")

MAX_MESSAGE_BYTES = STREAM_MESSAGE_BYTES  # events per GenerateManyOut message, in bytes


class StreamAbort(grpc.aio.AbortError):
    """`StreamContext.abort`: ends one generation of a GenerateMany stream with `code` / `details`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class StreamContext:
    """The part of a ``grpc.aio.ServicerContext`` a ``Generate`` handler uses, for one generation
    on a GenerateMany stream.

    metadata: the open's metadata (what the call's invocation metadata would have been).
    timeout_s: its deadline in seconds from now (0: none). peer: the stream's peer.
    """

    def __init__(self, metadata: dict[str, str], timeout_s: float, peer: str) -> None:
        self._metadata = tuple(metadata.items())
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        self._peer = peer
        self.trailing: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The open's metadata as (key, value) pairs."""
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        """Metadata sent with this generation's end (`GenerateEnd.trailing_metadata`)."""
        self.trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        """End this generation with `code` / `details`. Raises StreamAbort (always)."""
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise StreamAbort(code, details)

    def time_remaining(self) -> float | None:
        """Seconds left before the open's deadline (None: no deadline)."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def peer(self) -> str:
        return self._peer




async def serve_generate_many(generate: Callable, requests: AsyncIterator[pb.GenerateManyIn],
                              context, ending: asyncio.Event | None = None) -> AsyncIterator[pb.GenerateManyOut]:
    """The GenerateMany handler over `generate` (a servicer's bound ``Generate``: request, context ->
    async iterator of GenerateResponse).

    requests: the stream's incoming GenerateManyIn messages. Yields GenerateManyOut messages, each with
    every event ready since the previous one (up to `MAX_MESSAGE_BYTES`: more go in the next ones);
    a generation's events in order, its end last. Returns
    once the gateway has closed its side and every generation has ended; when the stream is
    cancelled, every generation on it is cancelled first. ending: once set (the worker drains, its
    own requests done), the stream ends as soon as nothing runs on it, so that the server's stop
    does not wait out its grace on an idle stream (an open that crosses the end is failed
    UNAVAILABLE by the gateway, which retries it elsewhere).
    """
    ready: list[pb.GenerateEvent] = []
    wake = asyncio.Event()
    running: dict[str, asyncio.Task] = {}
    peer = context.peer()

    def push(event: pb.GenerateEvent) -> None:
        ready.append(event)
        wake.set()

    async def run(rid: str, open_: pb.GenerateOpen) -> None:
        ctx = StreamContext(dict(open_.metadata), open_.timeout_s, peer)
        end = pb.GenerateEnd()
        try:
            async with asyncio.timeout(open_.timeout_s if open_.timeout_s > 0 else None):
                async for msg in generate(open_.request, ctx):
                    push(pb.GenerateEvent(request_id=rid, response=msg))
        except StreamAbort as e:
            end.code, end.details = e.code.value[0], e.details
        except TimeoutError:
            end.code, end.details = grpc.StatusCode.DEADLINE_EXCEEDED.value[0], _DEADLINE_DETAILS
        except Exception as e:  # what grpc.aio makes of an exception a handler lets out
            log.exception("Generate of %s failed", rid)
            end.code, end.details = grpc.StatusCode.UNKNOWN.value[0], f"Unexpected {type(e).__name__}: {e}"
        end.trailing_metadata.update(ctx.trailing)
        push(pb.GenerateEvent(request_id=rid, end=end))

    def forget(rid: str, task: asyncio.Task) -> None:
        if running.get(rid) is task:
            del running[rid]
        wake.set()

    async def read() -> None:
        async for msg in requests:
            for open_ in msg.open:
                rid = open_.request.request_id
                if not rid or rid in running:
                    why = "request_id is required" if not rid else f"duplicate request id {rid!r}"
                    push(pb.GenerateEvent(request_id=rid, end=pb.GenerateEnd(
                        code=grpc.StatusCode.INVALID_ARGUMENT.value[0], details=why)))
                    continue
                task = asyncio.create_task(run(rid, open_), name=f"generate-many:{rid}")
                running[rid] = task
                # forgotten when the task is done, also when it was cancelled before it first ran (an
                # open and its cancel in one message), so nothing of it stays for the stream's life
                task.add_done_callback(lambda t, rid=rid: forget(rid, t))
            for rid in msg.cancel:
                task = running.get(rid)
                if task is not None:
                    task.cancel()

    reader = asyncio.create_task(read(), name="generate-many:read")
    reader.add_done_callback(lambda _: wake.set())
    watcher = None
    if ending is not None:
        watcher = asyncio.create_task(ending.wait(), name="generate-many:ending")
        watcher.add_done_callback(lambda _: wake.set())
    try:
        while True:
            await wake.wait()
            wake.clear()
            while ready:  # (a slow reader lets events pile up: one message each MAX_MESSAGE_BYTES)
                n = fitting((event.ByteSize() for event in ready), MAX_MESSAGE_BYTES)
                out = pb.GenerateManyOut(events=ready[:n])
                del ready[:n]
                yield out
            if not running and not ready and (reader.done() or (ending is not None and ending.is_set())):
                break
        if reader.done():
            reader.result()  # a failed read ends the stream with its error
    finally:
        if watcher is not None:
            watcher.cancel()
        reader.cancel()
        tasks = list(running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(reader, *tasks, return_exceptions=True)


class GenerateManyMixin:
    """Gives a Worker servicer ``GenerateMany`` over its own ``Generate`` (put it before the
    generated ``WorkerServicer`` in the bases). `end_generate_many` ends its idle streams (drain)."""

    _generate_many_ending: asyncio.Event | None = None

    async def GenerateMany(self, request_iterator, context):
        if self._generate_many_ending is None:
            self._generate_many_ending = asyncio.Event()
        async for out in serve_generate_many(self.Generate, request_iterator, context, self._generate_many_ending):
            yield out

    def end_generate_many(self) -> None:
        """From now on each GenerateMany stream ends once nothing runs on it (call it when draining,
        after the worker's own requests are done, before stopping the server)."""
        if self._generate_many_ending is None:
            self._generate_many_ending = asyncio.Event()
        self._generate_many_ending.set()


__all__ = ["GenerateManyMixin", "StreamAbort", "StreamContext", "serve_generate_many"]
