"""The gateway's side of GenerateMany: every generation on a worker shares one gRPC stream.

One ``grpc.aio`` call per request costs the gateway about 0.4-0.5 ms of CPU (0.37-0.50 ms at 32
concurrent, measured in docs/architecture.md, "What a request costs the gateway"). `GenerateStream`
keeps one ``GenerateMany`` stream (worker/multiplex.py) open per worker instead: `GenerateStream.generate`
sends a request as a ``GenerateOpen`` (what the call's metadata and deadline would carry, inside the
message; the opens and cancels of one event-loop iteration in one message) and returns a
`StreamedGenerate`, which behaves as the ``grpc.aio`` Generate call the rest of the gateway reads:
iterate it for GenerateResponse messages, ``cancel()`` it, ask ``done()`` / ``cancelled()``. A
generation that ends with a status raises ``grpc.aio.AioRpcError`` with that code, details and
trailing metadata, exactly as its call would, so the retry and error paths (gateway/routing.py) are
the same on both.

When the stream fails (the worker went away), every generation sent on it fails with the stream's
status (UNAVAILABLE for a worker that is gone; also when grpc reports the failure as an INTERNAL
error of a message it could not send) and the next request opens a new stream. The gateway uses
the stream with the workers whose ModelInfo says ``generate_many`` (gateway/routing.py), and one
Generate call per request with the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import grpc

from fairshare.contract import DEADLINE_DETAILS as _DEADLINE_DETAILS
from fairshare.contract import STREAM_MESSAGE_BYTES, fitting
from fairshare.v1 import worker_pb2 as pb

log = logging.getLogger("fairshare.gateway.worker_stream")

_CODES = {c.value[0]: c for c in grpc.StatusCode}
_END = object()  # `_final` of a generation that ended OK (each read past it raises a new StopAsyncIteration)
MAX_MESSAGE_BYTES = STREAM_MESSAGE_BYTES  # opens per GenerateManyIn message, in bytes


def _rpc_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class StreamedGenerate:
    """One generation on a `GenerateStream`; the ``grpc.aio`` UnaryStreamCall interface the gateway
    uses (async iteration of GenerateResponse, cancel, done, cancelled).

    Iterating raises grpc.aio.AioRpcError when the generation ended with a status other than OK (its
    code, details and trailing metadata) or the stream failed, and asyncio.CancelledError once
    cancelled.
    """

    def __init__(self, stream: "GenerateStream", open_: pb.GenerateOpen, timeout: float | None) -> None:
        self._stream = stream
        self.request_id = open_.request.request_id
        self.open: pb.GenerateOpen | None = open_  # until it is taken for sending
        self.sent = False  # its open went into a message: the worker may be running it
        self._messages: deque[pb.GenerateResponse] = deque()
        self._final: object | None = None  # _END, an AioRpcError or CancelledError once ended
        self._waiter: asyncio.Future | None = None
        self._timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, self._expire)

    # --- the call interface -------------------------------------------------------------------
    def __aiter__(self) -> "StreamedGenerate":
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        while True:
            if self._messages:
                return self._messages.popleft()
            if self._final is _END:
                # a new instance each time: a shared one would collect every raise's traceback (and
                # the frames it holds) for the life of the process
                raise StopAsyncIteration
            if self._final is not None:
                raise self._final
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def cancel(self) -> bool:
        """Stop the generation (the worker aborts it). False when it had already ended."""
        if self._final is not None:
            return False
        self._end(asyncio.CancelledError())
        self._stream._cancel(self)
        return True

    def done(self) -> bool:
        return self._final is not None

    def cancelled(self) -> bool:
        return isinstance(self._final, asyncio.CancelledError)

    # --- fed by the stream --------------------------------------------------------------------
    def _deliver(self, event: pb.GenerateEvent) -> None:
        if event.HasField("response"):
            self._messages.append(event.response)
            self._wake()
            return
        end = event.end
        if end.code == 0:
            self._end(_END)
        else:
            code = _CODES.get(end.code, grpc.StatusCode.UNKNOWN)
            self._end(_rpc_error(code, end.details, tuple(end.trailing_metadata.items())))

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        """The stream failed: end with its status."""
        if self._final is None:
            self._end(_rpc_error(error.code(), error.details() or ""))

    def _expire(self) -> None:
        if self._final is None:
            self._end(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, _DEADLINE_DETAILS))
            self._stream._cancel(self)

    def _end(self, final: object) -> None:
        self._final = final
        if self._timer is not None:
            self._timer.cancel()
        self._stream._forget(self)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class GenerateStream:
    """The one GenerateMany stream of a worker's channel, opened on first use and reopened after a
    failure. stub: the worker's ``WorkerStub``.

    Not thread-safe: one event loop (the gateway's)."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self._call = None
        self._calls: dict[str, StreamedGenerate] = {}
        self._opens: list[StreamedGenerate] = []  # generations whose open waits to be sent
        self._cancels: list[str] = []
        self._writer: asyncio.Task | None = None
        self._send_failed: object | None = None  # the stream a message could not be sent on
        self._tasks: set[asyncio.Task] = set()

    def generate(self, request: pb.GenerateRequest, metadata=None, timeout: float | None = None) -> StreamedGenerate:
        """Start `request` on the worker's stream. metadata: (key, value) pairs as for a Generate
        call; timeout: its deadline in seconds from now (None: none)."""
        open_ = pb.GenerateOpen(request=request, timeout_s=timeout or 0.0)
        if metadata:
            open_.metadata.update(metadata)
        call = StreamedGenerate(self, open_, timeout)
        if call.request_id in self._calls:  # the worker would refuse it too; don't lose the first
            call._end(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"duplicate request id {call.request_id!r}"))
            return call
        self._calls[call.request_id] = call
        self._opens.append(call)
        self._schedule_flush()
        return call

    async def close(self) -> None:
        """Cancel the stream (its generations fail with CANCELLED) and wait for its tasks."""
        if self._call is not None:
            self._call.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- internals ----------------------------------------------------------------------------
    def _cancel(self, call: StreamedGenerate) -> None:
        """Tell the worker to stop `call` (ended here already). Only once its open was sent: an
        unsent open is simply not sent (`_forget`), and a cancel always follows its open."""
        if call.sent and self._call is not None:
            self._cancels.append(call.request_id)
            self._schedule_flush()

    def _forget(self, call: StreamedGenerate) -> None:
        """`call` ended: stop routing events to it, and drop its open if it was never sent."""
        if self._calls.get(call.request_id) is call:  # not a refused duplicate's namesake
            del self._calls[call.request_id]
        if not call.sent and call.open is not None:
            try:
                self._opens.remove(call)
            except ValueError:  # a refused duplicate: never queued
                pass
            call.open = None

    def _schedule_flush(self) -> None:
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_all())
            self._tasks.add(self._writer)
            self._writer.add_done_callback(self._tasks.discard)

    async def _write_all(self) -> None:
        """Send what is queued, in one message per write (opening the stream if needed): the opens
        and cancels queued while a write is in flight go together in the next one (grpc.aio takes
        one write at a time)."""
        try:
            while self._opens or self._cancels:
                if self._call is None:
                    if not self._opens:  # the stream they were for has ended: nothing to cancel
                        self._cancels.clear()
                        break
                    self._call = self.stub.GenerateMany()
                    reader = asyncio.get_running_loop().create_task(self._read(self._call))
                    self._tasks.add(reader)
                    reader.add_done_callback(self._tasks.discard)
                call = self._call
                msg = pb.GenerateManyIn(open=self._take_opens(), cancel=self._cancels)
                self._cancels.clear()
                try:
                    await call.write(msg)
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                    self._send_failed = call  # the stream failed: its reader ends the generations on it
        finally:
            self._writer = None

    def _take_opens(self) -> list[pb.GenerateOpen]:
        """The queued opens that fit in one message of at most MAX_MESSAGE_BYTES (at least one; the
        rest wait for the next write), so that a burst of long prompts never meets the channel's
        message limit; their generations count as sent from here on."""
        n = fitting((call.open.ByteSize() for call in self._opens), MAX_MESSAGE_BYTES)
        taken = [call.open for call in self._opens[:n]]
        for call in self._opens[:n]:
            call.sent, call.open = True, None
        del self._opens[:n]
        return taken

    async def _read(self, call) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for out in call:
                for event in out.events:
                    target = self._calls.get(event.request_id)
                    if target is not None:
                        target._deliver(event)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the worker's stream")
        if self._call is call:
            self._call = None
        if error is None:
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker ended its GenerateMany stream")
        elif error.code() == grpc.StatusCode.INTERNAL and self._send_failed is call:
            # grpc turns a message it could not send into INTERNAL on the whole call: the stream broke
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE, f"the worker's GenerateMany stream broke ({error.details()})")
        if self._send_failed is call:
            self._send_failed = None
        on_it = [target for target in self._calls.values() if target.sent]
        if on_it:
            log.info("GenerateMany stream ended with %d generation(s) on it: %s %s", len(on_it),
                     error.code().name, error.details())
        self._cancels.clear()  # for generations of the stream that just ended
        for target in on_it:
            target._fail(error)
        if self._opens:  # opens not yet sent were never on it: they go on the next stream
            self._schedule_flush()


__all__ = ["GenerateStream", "StreamedGenerate"]
