"""Streamed answers: the SSE body of a chat or text completion, as OpenAI streams them.

`chat_stream` / `text_stream` give the body of an admitted, started session: keep-alive comments
until the first token (when the response began before it), then one write per worker message (all
its tokens; the opening chunks go with the first), the usage chunk (``stream_options.include_usage``)
with ``[DONE]`` (and with the chunks of the message that finished the last choice: the stream ends
with one write). Stop strings are held back by the worker, so text that may still turn out to start
a stop string never reaches a chunk. A failure after the first token becomes an OpenAI error event.
The body settles the session in every case, after its last event (``[DONE]``, or the error event):
the client does not wait for the release's Redis round trip (docs/architecture.md, "Settlement
after the answer").
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import grpc

from . import keepalive, schemas
from .errors import APIError, unavailable
from .generation import check_finished, finish_reason, merged, stream_failure
from .logprobs import CompletionLogprobs, chat_content
from .session import Job, Session
from .sse import DONE, event


def _chunks(session: Session, req, make: Callable[..., dict]):
    """(chunk, usage_event) of one stream: ``chunk(index, content, finish=None, logprobs=None)`` encodes
    a chunk made by `make` (`schemas.chat_chunk` or `schemas.text_chunk`); ``usage_event()`` the usage
    chunk, or None when the client did not ask for it."""
    created = int(time.time())
    fp = session.entry.fingerprint
    with_usage = req.include_usage()

    def chunk(index: int, content, finish: str | None = None, logprobs=None) -> bytes:
        return event(make(session.rid, created, session.model, fp, index, content, finish, None, with_usage, logprobs))

    def usage_event() -> bytes | None:
        if not with_usage:
            return None
        return event(make(session.rid, created, session.model, fp, None, usage=session.usage_dict(), with_usage=True))

    return chunk, usage_event


def chat_stream(session: Session, req: schemas.ChatCompletionRequest) -> AsyncIterator[bytes]:
    """The SSE body of a chat completion (``chat.completion.chunk`` events; tool calls as deltas)."""
    plan = session.plan
    for j in session.jobs:
        j.tools = plan.tool_stream()
    chunk, usage_event = _chunks(session, req, schemas.chat_chunk)

    def body(job: Job, msg) -> list[bytes]:
        out = []
        text = session.record(job, msg)
        calls: list[dict[str, Any]] = []
        if job.tools is not None:
            text, calls = job.tools.feed(text)
            if job.finish_reason is not None:
                rest, more = job.tools.finish()
                text, calls = text + rest, calls + more
        logprobs = chat_content(plan.texts, msg.logprobs, plan.skip) if plan.logprobs else None
        if text or logprobs:
            out.append(chunk(job.index, {"content": text}, logprobs=logprobs))
        for call in calls:
            out.append(chunk(job.index, {"tool_calls": [{"index": job.calls_sent, **call}]}))
            job.calls_sent += 1
        if job.finish_reason not in (None, "abort"):  # an abort is answered with an error event (_stream)
            out.append(chunk(job.index, {}, finish_reason(job, job.calls_sent > 0)))
        return out

    opening = [chunk(j.index, {"role": "assistant", "content": ""}) for j in session.jobs]
    return _stream(session, opening, body, usage_event)


def text_stream(session: Session, req: schemas.CompletionRequest) -> AsyncIterator[bytes]:
    """The SSE body of a text completion (``text_completion`` events)."""
    plan = session.plan
    for j in session.jobs:
        j.completion_logprobs = CompletionLogprobs(plan.texts) if plan.logprobs else None
    chunk, usage_event = _chunks(session, req, schemas.text_chunk)

    def body(job: Job, msg) -> list[bytes]:
        out = []
        text = session.record(job, msg)
        logprobs = None
        if job.completion_logprobs is not None:
            logprobs = job.completion_logprobs.add(msg.logprobs, plan.skip)
            if not logprobs["tokens"]:
                logprobs = None
        if text or logprobs:
            out.append(chunk(job.index, text, logprobs=logprobs))
        if job.finish_reason not in (None, "abort"):  # an abort is answered with an error event (_stream)
            out.append(chunk(job.index, "", job.finish_reason))
        return out

    return _stream(session, [], body, usage_event)


async def _stream(session: Session, opening: list[bytes], body, usage_event) -> AsyncIterator[bytes]:
    """The SSE body (module docstring); settles in every case. `body(job, msg)` gives the chunks of
    one worker message (all its tokens), written at once."""
    try:
        start = session.start_task
        if start is not None and not start.done():  # answered before the first token: keep the line alive
            async for b in keepalive.comments(start, session.gw.settings.keepalive_interval_s):
                yield b
        if start is not None:
            failed = _start_failure(session, start)
            if failed is not None:
                if failed:
                    yield failed
                return
        tail: list[bytes] = []
        async with aclosing(_content(session, body, b"".join(opening), tail)) as content:
            async for b in content:
                yield b
        if not session.finished:
            return
        u = usage_event()
        # the last write: the final message's chunks, the usage chunk, [DONE]; the settlement follows it
        yield b"".join(tail) + (DONE if u is None else u + DONE)
    finally:
        session.gw.metrics.latency.labels(session.tenant.id, session.endpoint).observe(
            time.perf_counter() - session.t0)
        await session.settle()


def _start_failure(session: Session, start: asyncio.Future) -> bytes | None:
    """How a stream whose start ran in its own task ended that start: None (it started), an error
    event to send, or b"" (nothing to send: the client is gone)."""
    try:
        start.result()
    except APIError as e:
        return event(e.body())
    except asyncio.CancelledError:
        if session.stop_reason is not None and not session.client_gone:
            return event(unavailable(session.stop_reason, retry_after_s=1).body())
        return b""
    return None


async def _content(session: Session, body, opening: bytes, tail: list[bytes]) -> AsyncIterator[bytes]:
    """The content chunks of every worker message; an error event when the generation fails (nothing
    once the client is gone). Sets ``session.finished`` when every choice finished.

    opening: the opening chunks, sent in one write with the first message's chunks (that message was
    read before the response began, so the opening waits for nothing), or before the error event or
    the end when there is none. tail: where the chunks of the message that finishes the last choice
    go instead of a write of their own (the caller sends them with the usage chunk and ``[DONE]``:
    nothing is left to wait for); a message after it (not expected) sends them first."""
    held = b""
    try:
        async with aclosing(merged(session)) as messages:
            async for job, msg in messages:
                chunks = body(job, msg)
                if opening:
                    chunks.insert(0, opening)
                    opening = b""
                if held:
                    chunks.insert(0, held)
                    held = b""
                if not chunks:
                    continue
                if all(j.finish_reason is not None for j in session.jobs):
                    held = b"".join(chunks)  # the last message: it goes with [DONE]
                else:
                    yield b"".join(chunks)
        check_finished(session)
    except APIError as e:
        if not session.client_gone:
            yield opening + held + event(e.body())
        return
    except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
        if session.client_gone:
            return
        if isinstance(e, asyncio.CancelledError) and session.stop_reason is None and not any(
                j.gen is not None and j.gen.call.cancelled() for j in session.jobs):
            raise  # we are being cancelled ourselves
        yield opening + held + event(stream_failure(session, e).body())
        return
    if opening or held:
        tail.append(opening + held)
    session.finished = True


__all__ = ["chat_stream", "text_stream"]
