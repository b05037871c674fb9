"""A session's worker streams: start every choice on a worker (routing, retries on other workers
until the first token: gateway/routing.py), merge their messages, turn a stream failure into the
client's error, and run a non-streamed request to its JSON body.

Until the first token (which may wait in the worker's queue) the request's watch still watches the
client and interrupts the wait (499; 503 on `Session.stop`). A non-streamed request waits in the
handler's task. A stream waits there at most the keep-alive grace: its start runs in a task of its
own, so that the response can begin and keep the connection alive while it runs on
(gateway/keepalive.py); errors within the grace still get their own status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from fairshare.contract import TIER_ENUMS
from fairshare.v1 import worker_pb2 as pb

from . import keepalive, schemas
from .background import cancel_and_wait
from .errors import APIError, client_closed, unavailable
from .logprobs import CompletionLogprobs, chat_content
from .plan import OutputPlan
from .routing import start_generation
from .session import Job, Session
from .tracing import set_error

log = logging.getLogger("fairshare.gateway")

# gRPC codes of a stream that mean the worker (or the connection to it) is gone, not the request
_WORKER_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}


async def start_generations(session: Session, req) -> None:
    """Start every choice of `session` (each retried on other workers until its first token) in a
    ``gateway.routing`` span; then open the ``gateway.streaming`` span. On any failure the session is
    settled before the error propagates (APIError: 499, 503, 504, 400 for a grammar the worker refused)."""
    gw = session.gw
    span = gw.tracer.start_span("gateway.routing", attributes={"fairshare.model": session.model,
                                                               "fairshare.choices": len(session.jobs)})
    try:
        if req.stream:
            await _start_within_grace(session, req, span)
        else:
            await _start_and_wait(session, req, span)
    except BaseException:
        if session.start_task is not None:
            await cancel_and_wait(session.start_task)
        await session.settle()
        raise
    session.stream_span = gw.tracer.start_span("gateway.streaming", context=session.trace_ctx,
                                               attributes={"fairshare.stream": bool(req.stream)})


async def _start_within_grace(session: Session, req, span: trace.Span) -> None:
    """A stream's start: in a task of its own (the span current in it, ended with it), awaited here
    for at most the keep-alive grace."""
    token = otel_context.attach(trace.set_span_in_context(span))  # current in the start task
    try:
        start = session.start_task = asyncio.ensure_future(_start_all(session, req))
    finally:
        otel_context.detach(token)
    start.add_done_callback(lambda task: _end_routing_span(span, task))
    grace_s = session.gw.settings.keepalive_interval_s
    if not await session.until_started(keepalive.started_within(start, grace_s)):
        if span.is_recording():
            span.set_attribute("fairshare.keepalive", True)


async def _start_and_wait(session: Session, req, span: trace.Span) -> None:
    """A non-streamed request's start, in the handler's task (the span ends with it)."""
    try:
        if span.get_span_context().is_valid:
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                await session.until_started(_start_all(session, req))
        else:  # untraced: nothing to make current
            await session.until_started(_start_all(session, req))
    except BaseException as e:
        set_error(span, e.code if isinstance(e, APIError) else
                  "cancelled" if isinstance(e, asyncio.CancelledError) else type(e).__name__)
        raise
    finally:
        span.end()


def _end_routing_span(span: trace.Span, task: asyncio.Future) -> None:
    """End the ``gateway.routing`` span when its start task ends (error type when it failed)."""
    if task.cancelled():
        set_error(span, "cancelled")
    elif task.exception() is not None:
        e = task.exception()
        set_error(span, e.code if isinstance(e, APIError) else type(e).__name__)
    span.end()


def generate_request(session: Session, job: Job, req) -> pb.GenerateRequest:
    """The worker's ``GenerateRequest`` of one choice (its sampling parameters, tenant, prompt ids)."""
    t = session.tenant
    plan = session.plan
    sp = pb.SamplingParams(
        max_tokens=job.max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=int(req.top_k or 0),
        stop=req.stops(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=plan.logprobs,
        top_logprobs=plan.top_logprobs,
    )
    if plan.grammar is not None:
        sp.grammar.CopyFrom(plan.grammar)
    if job.seed is not None:
        sp.seed = job.seed
    rid = session.rid if len(session.jobs) == 1 else f"{session.rid}.{job.index}"
    return pb.GenerateRequest(
        request_id=rid,
        tenant=pb.Tenant(id=t.id, weight=t.weight, tier=TIER_ENUMS[t.tier]),
        prompt_token_ids=job.prompt_ids, sampling=sp, cache_salt=req.cache_salt or "")


async def _start_all(session: Session, req) -> None:
    """Start every job's generation (each retried on other workers until its first token)."""
    gw = session.gw
    attempts = gw.settings.max_retries + 1

    async def start(job: Job) -> None:
        try:
            job.gen = await start_generation(gw.pool, session.model, generate_request(session, job, req),
                                             len(job.prompt_ids) + job.max_tokens, max_attempts=attempts,
                                             metrics=gw.metrics, tracer=gw.tracer, parent=session.trace_ctx,
                                             deadline=session.deadline, signer=gw.signer)
        except APIError as e:
            if e.status == 504 and e.code == "timeout":  # the deadline passed while it was queued
                raise session.deadline_info.error(started=False) from None
            if e.code == "invalid_grammar":  # the worker could not compile it: name the field
                e.param, e.code = session.plan.grammar_param, "invalid_value"
            raise

    if len(session.jobs) == 1:
        await start(session.jobs[0])
        return
    tasks = [asyncio.ensure_future(start(j)) for j in session.jobs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merged(session: Session) -> AsyncIterator[tuple[Job, pb.GenerateResponse]]:
    """Messages of every job as they come. Raises the first stream error."""
    jobs = session.jobs
    if len(jobs) == 1:
        job = jobs[0]
        try:
            async for msg in job.gen.messages():
                yield job, msg
        except grpc.aio.AioRpcError as e:
            job.error = e
            raise
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for msg in job.gen.messages():
                await queue.put((job, msg, None))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            if isinstance(e, grpc.aio.AioRpcError):
                job.error = e
            await queue.put((job, None, e))
            return
        await queue.put((job, None, None))

    tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, msg, err = await queue.get()
            if err is not None:
                raise err
            if msg is None:
                remaining -= 1
                continue
            yield job, msg
    finally:
        for t in tasks:
            t.cancel()


def stream_failure(session: Session, err: BaseException) -> APIError:
    """The client's error for a generation that failed after its first token (the details, which name
    workers, go to the log only). A worker whose connection broke is marked unhealthy at once, so the
    next requests go to the others."""
    if session.stop_reason is not None:
        return unavailable(session.stop_reason, retry_after_s=1)
    for j in session.jobs:
        e = j.error
        if e is not None and j.gen is not None:
            log.warning("request %s: worker %s failed during generation: %s %s", session.rid, j.gen.worker.addr,
                        e.code().name, e.details())
            if e.code() in _WORKER_LOST:
                session.gw.pool.mark_failed(j.gen.worker, f"{e.code().name} during generation")
    retry_s = session.gw.pool.retry_after_s(session.model)  # another worker may take it (retry hints)
    if isinstance(err, grpc.aio.AioRpcError):
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return session.deadline_info.error(started=True)
        return unavailable(f"The worker failed during generation ({err.code().name}); please retry.",
                           retry_after_s=retry_s)
    return unavailable(f"The worker failed during generation ({type(err).__name__}); please retry.",
                       retry_after_s=retry_s)


def check_finished(session: Session) -> None:
    """Raise APIError 503 when a stream ended without a finish reason, or the worker aborted it."""
    retry_s = session.gw.pool.retry_after_s(session.model)
    for j in session.jobs:
        if j.finish_reason is None:
            raise unavailable("The worker ended the stream without finishing the request.", retry_after_s=retry_s)
        if j.finish_reason == "abort":
            raise unavailable("The worker aborted the request.", retry_after_s=retry_s)


async def collect(session: Session, kind: str) -> dict[str, Any]:
    """Run a non-streamed request to the end and return its JSON body (a disconnect or `Session.stop`
    cancels its gRPC calls: APIError 499 / 503)."""
    try:
        async with aclosing(merged(session)) as messages:
            async for job, msg in messages:
                session.record(job, msg)
    except grpc.aio.AioRpcError as e:
        raise stream_failure(session, e) from None
    except asyncio.CancelledError:  # our own cancellation, or a call cancelled by a disconnect or stop()
        if session.client_gone:
            raise client_closed() from None
        if session.stop_reason is not None:
            raise stream_failure(session, asyncio.CancelledError()) from None
        raise
    check_finished(session)
    session.finished = True
    created = int(time.time())
    plan = session.plan
    if kind == "chat":
        choices = [chat_choice(plan, j) for j in session.jobs]
        return schemas.chat_completion(session.rid, created, session.model, choices, session.usage_dict(),
                                       session.entry.fingerprint)
    texts = [("".join(j.text), j.finish_reason or "stop",
              CompletionLogprobs(plan.texts).add(j.logprobs, plan.skip) if plan.logprobs else None)
             for j in session.jobs]
    return schemas.text_completion(session.rid, created, session.model, texts, session.usage_dict(),
                                   session.entry.fingerprint)


def finish_reason(job: Job, made_calls: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the choice ended normally after calling tools."""
    reason = job.finish_reason or "stop"
    return "tool_calls" if made_calls and reason == "stop" else reason


def chat_choice(plan: OutputPlan, job: Job) -> dict[str, Any]:
    """A non-streamed chat choice: the text read by the tool-call parser (the same reader the
    stream uses), its logprobs."""
    text = "".join(job.text)
    calls: list[dict[str, Any]] = []
    reader = plan.tool_stream()
    if reader is not None:
        content, calls = reader.feed(text)
        rest, more = reader.finish()
        text, calls = content + rest, calls + more
    logprobs = chat_content(plan.texts, job.logprobs, plan.skip) if plan.logprobs else None
    return schemas.chat_choice(job.index, None if calls and not text else text, finish_reason(job, bool(calls)),
                               calls or None, logprobs)


__all__ = ["chat_choice", "check_finished", "collect", "finish_reason", "generate_request", "merged",
           "start_generations", "stream_failure"]
