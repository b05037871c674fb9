"""Admission and settlement of one request: `admit` turns a `GenerationPlan` into an admitted
`Session` (one Redis call: RPM, TPM reserving ``prompt + n * max_tokens`` tokens, in-flight tokens,
concurrent requests), and `Session.settle` ends it exactly once, on success, error or client
disconnect: it cancels the gRPC streams (the worker aborts), refunds ``reserved - (prompt +
completion actually used)`` TPM tokens and releases the lease (gateway/admission.py).

A session's choices are its `Job` s (prompts x n); each holds its worker stream
(`gateway.routing.Generation`) once started (gateway/generation.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import Request
from opentelemetry import context as otel_context
from opentelemetry import trace

from fairshare.config import TenantConfig
from fairshare.v1 import worker_pb2 as pb

from . import schemas
from .admission import RedisUnavailable
from .auth import Principal
from .deadlines import Deadline
from .errors import APIError, client_closed, invalid_request, retry_headers, unavailable
from .logprobs import CompletionLogprobs
from .plan import GenerationPlan, OutputPlan, too_large_error
from .redis_buckets import Decision, Lease
from .routing import Generation, ModelEntry
from .tools import ToolCallStream
from .tracing import end_request_span, set_error
from .watch import RequestWatch

log = logging.getLogger("fairshare.gateway")


@dataclass
class Job:
    """One choice: a prompt (group) sampled once. Token counts in tokens."""

    index: int
    group: int
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None
    gen: Generation | None = None
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    error: grpc.aio.AioRpcError | None = None  # how its stream failed, if it did
    first_at: float | None = None  # perf_counter() of its first and latest output tokens (gateway/progress.py)
    last_at: float | None = None
    first_tokens: int = 0  # tokens in the message that carried the first ones
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob entries received so far
    tools: ToolCallStream | None = None           # tool-call reader of this choice (streams)
    calls_sent: int = 0                           # tool calls streamed so far
    completion_logprobs: CompletionLogprobs | None = None  # text completions: offsets across chunks


@dataclass(eq=False)
class Session:
    """An admitted request: its jobs, generations, lease and the settlement that ends it (once).

    gw: the app's `gateway.state.Gateway`; endpoint: the metrics label, ``chat`` or ``completions``; t0: ``perf_counter()`` when
    the request arrived (TTFT and latency are measured from it); deadline_info: whose deadline, when
    (gateway/deadlines.py).
    """

    gw: Any = field(repr=False)
    principal: Principal
    entry: ModelEntry = field(repr=False)
    model: str
    jobs: list[Job] = field(repr=False)
    lease: Lease
    decision: Decision = field(repr=False)
    rid: str
    endpoint: str
    t0: float
    plan: OutputPlan = field(default_factory=OutputPlan, repr=False)
    deadline_info: Deadline = field(default_factory=lambda: Deadline(None, None))
    finished: bool = False
    client_gone: bool = False
    stop_reason: str | None = None  # set by stop(): the server ends the request (drain deadline)
    # a stream's start, in a task of its own once it outlasts the keep-alive grace (its body then
    # sends keep-alive comments until the first token; gateway/keepalive.py)
    start_task: asyncio.Future | None = None
    first_token_at: float | None = None
    trace_ctx: Any = field(default_factory=otel_context.get_current, repr=False)  # parent of worker calls
    stream_span: trace.Span = field(default=trace.INVALID_SPAN, repr=False)  # first token -> settlement
    request_span: trace.Span | None = field(default=None, repr=False)  # SSE responses end it when they settle
    _watch: RequestWatch | None = field(default=None, init=False, repr=False)  # disconnect watch, then settlement
    _starting: asyncio.Task | None = field(default=None, init=False, repr=False)  # the handler awaiting first tokens

    @property
    def deadline(self) -> float | None:
        """``time.monotonic()`` of the request's deadline (the gRPC deadline of each call), or None."""
        return self.deadline_info.at

    @property
    def tenant(self) -> TenantConfig:
        return self.principal.tenant

    def headers(self) -> dict[str, str]:
        """Rate-limit headers from the admission decision, plus the request id."""
        h = self.decision.state.headers()
        h["x-request-id"] = self.rid
        return h

    def record(self, job: Job, msg: pb.GenerateResponse) -> str:
        """Account one worker message to `job` (tokens, TTFT, text, logprobs, finish); returns its text delta."""
        if self.first_token_at is None and (msg.token_ids or msg.text_delta):
            self.first_token_at = time.perf_counter()
            self.gw.metrics.ttft.labels(self.tenant.id, self.model).observe(self.first_token_at - self.t0)
        if msg.token_ids:
            job.last_at = time.perf_counter()
            if job.first_at is None:
                job.first_at, job.first_tokens = job.last_at, len(msg.token_ids)
        job.completion_tokens += len(msg.token_ids)
        if msg.text_delta:
            job.text.append(msg.text_delta)
        if msg.logprobs:
            job.logprobs.extend(msg.logprobs)
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            job.finish_reason = schemas.FINISH.get(msg.finish_reason, "stop")
            if msg.HasField("usage"):
                job.usage = msg.usage
                job.completion_tokens = int(msg.usage.completion_tokens)
        return msg.text_delta

    def usage(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens: the workers' figures, counted once per prompt."""
        prompt = cached = 0
        seen: set[int] = set()
        for j in self.jobs:
            if j.group in seen or j.gen is None:
                continue
            seen.add(j.group)
            src = next((k.usage for k in self.jobs if k.group == j.group and k.usage is not None), None)
            if src is not None:
                prompt += int(src.prompt_tokens)
                cached += int(src.cached_prompt_tokens)
            else:
                prompt += len(j.prompt_ids)
        completion = sum(j.completion_tokens for j in self.jobs)
        return prompt, completion, cached

    def usage_dict(self) -> dict[str, Any]:
        """The OpenAI ``usage`` object of `usage`."""
        p, c, k = self.usage()
        return schemas.usage_dict(p, c, k)

    def watch(self, request: Request) -> None:
        """Start the request's one task: it watches the client's connection until the request ends,
        then settles it (gateway/watch.py). Call once, after admission."""
        self._watch = RequestWatch(request.receive, self.on_client_gone, self._do_settle)

    async def until_started(self, coro):
        """Await `coro` (the wait for the first tokens, in the caller's task) and return its result; a
        disconnect or `stop()` meanwhile interrupts it (cancelling the gRPC calls it has open, and a
        stream's start task): APIError 499 or 503."""
        task = asyncio.current_task()
        self._starting = task
        try:
            return await coro
        except asyncio.CancelledError:
            if not (self.client_gone or self.stop_reason is not None):
                raise  # cancelled from elsewhere
            if hasattr(task, "uncancel"):  # Python >= 3.11 counts cancellations
                task.uncancel()
            if self.client_gone:
                raise client_closed() from None
            raise unavailable(self.stop_reason or "The request was stopped.", retry_after_s=1) from None
        finally:
            self._starting = None

    def _interrupt(self) -> None:
        """Cancel every gRPC stream (the workers abort) and a wait for the first tokens."""
        for j in self.jobs:
            if j.gen is not None:
                j.gen.cancel()
        if self._starting is not None:
            self._starting.cancel()
        if self.start_task is not None:
            self.start_task.cancel()

    def on_client_gone(self) -> None:
        """The client disconnected: cancel every gRPC stream (the workers abort)."""
        if self.finished or self.client_gone:
            return
        self.client_gone = True
        self.gw.metrics.disconnects.labels(self.tenant.id).inc()
        self._interrupt()

    def stop(self, reason: str) -> None:
        """End the request from the server side (the gateway is shutting down): cancel its gRPC streams;
        the client gets an OpenAI error (an SSE ``data:`` error event, or a 503 body)."""
        if self.finished or self.client_gone or self.stop_reason is not None:
            return
        self.stop_reason = reason
        self._interrupt()

    async def settle(self) -> None:
        """Cancel what still runs, refund unused TPM and release the lease; idempotent, and completes
        even when the caller is cancelled."""
        if self._watch is None:  # never watched (settled right after admission): settle in a task all the same
            self._watch = RequestWatch(None, self.on_client_gone, self._do_settle)
        await self._watch.close()

    async def _do_settle(self) -> None:
        try:
            await self._settle_now()
        finally:
            self.gw.live.discard(self)  # open until here: `gw.live` empty means every release is made (or owed)

    async def _settle_now(self) -> None:
        for j in self.jobs:
            if j.gen is not None:
                j.gen.close()
        self.gw.rates.observe_jobs(self.model, self.jobs)
        p, c, k = self.usage()
        used = p + c
        m = self.gw.metrics
        m.inflight.labels(self.tenant.id).dec()
        m.inflight_tokens.labels(self.tenant.id).dec(self.lease.tokens)
        self._end_spans(p, c, k)
        m.tokens.labels(self.tenant.id, self.model, "prompt").inc(p)
        m.tokens.labels(self.tenant.id, self.model, "completion").inc(c)
        m.tokens.labels(self.tenant.id, self.model, "cached").inc(k)
        try:  # never raises for Redis failures: an unreachable Redis is settled with when it returns
            await self.gw.control.settle(self.lease, used)
        except Exception:
            log.exception("settlement of %s failed; the lease expires in %.0f s", self.rid,
                          self.gw.control.lease_ttl_s)

    def _end_spans(self, prompt: int, completion: int, cached: int) -> None:
        span = self.stream_span
        if span.is_recording():
            span.set_attributes({
                "fairshare.prompt_tokens": prompt, "fairshare.completion_tokens": completion,
                "fairshare.cached_prompt_tokens": cached, "fairshare.client_gone": self.client_gone,
                "fairshare.finish_reasons": [j.finish_reason or "none" for j in self.jobs]})
            if not self.finished and not self.client_gone:
                set_error(span, "incomplete")
        span.end()
        if self.request_span is not None:
            rs, self.request_span = self.request_span, None
            if self.client_gone and rs.is_recording():
                rs.set_attribute("fairshare.client_gone", True)
            end_request_span(rs, 200)


# -- admission ----------------------------------------------------------------------------------------

async def admit(gw, principal: Principal, plan: GenerationPlan, t0: float) -> Session:
    """Admit `plan` for the principal's tenant in one Redis call and open its `Session` (lease held,
    counted in ``gw.live``; gw: a `gateway.state.Gateway`). Raises APIError 429 (a limit is reached:
    ``retry-after`` and ``x-ratelimit-*`` headers), 400 (it could never fit), 503 (Redis is down and the
    tenant's tier fails closed)."""
    tenant = principal.tenant
    rid = ("chatcmpl-" if plan.kind == "chat" else "cmpl-") + secrets.token_hex(16)  # 32 hex digits, as uuid4().hex gave
    decision = await _decide(gw, tenant, plan, rid)
    if not decision.admitted:
        raise _refusal(gw, tenant, plan, decision)
    lease = decision.lease
    assert lease is not None
    gw.metrics.inflight.labels(tenant.id).inc()
    gw.metrics.inflight_tokens.labels(tenant.id).inc(lease.tokens)
    jobs = _jobs(plan)
    session = Session(gw, principal, plan.entry, plan.model, jobs, lease, decision, rid, plan.endpoint, t0,
                      plan.output, plan.deadline)
    lease.remaining_s = lambda: gw.rates.remaining_s(plan.model, jobs)  # refreshed in Redis at each renewal
    gw.live.add(session)
    return session


async def _decide(gw, tenant: TenantConfig, plan: GenerationPlan, rid: str) -> Decision:
    """The admission decision, in a ``gateway.admission`` span, timed. Raises APIError 503 (Redis down,
    the tier fails closed)."""
    m = gw.metrics
    with gw.tracer.start_as_current_span("gateway.admission", record_exception=False, set_status_on_exception=False,
                                         attributes={"fairshare.cost_tokens": plan.cost}) as span:
        ta = time.perf_counter()
        try:
            decision = await gw.control.admit(tenant, plan.cost, lease_id=rid,
                                              expected_s=gw.rates.seconds_for(plan.model, plan.max_tokens))
        except RedisUnavailable as e:  # Redis is down and this tier fails closed
            m.admission_latency.labels(tenant.id, "error").observe(time.perf_counter() - ta)
            set_error(span, "redis_unavailable")
            raise unavailable(f"The rate limiter is unavailable (Redis {e.cause}); please retry.",
                              retry_after_s=e.retry_after_s) from None
        m.admission_latency.labels(tenant.id, "admitted" if decision.admitted else "rejected").observe(
            time.perf_counter() - ta)
        if span.is_recording():
            span.set_attributes({"fairshare.admitted": decision.admitted, "fairshare.reason": decision.reason})
    return decision


def _refusal(gw, tenant: TenantConfig, plan: GenerationPlan, decision: Decision) -> APIError:
    """The error of a refused admission: 400 when it can never fit, else 429; counted."""
    m = gw.metrics
    m.rejections.labels(tenant.id, decision.reason).inc()
    if decision.reason in ("tokens_never_fit", "inflight_never_fit"):
        err = too_large_error(tenant, plan.cost, plan.param) or invalid_request("Request too large.", plan.param,
                                                                                "request_too_large")
        err.headers.update(decision.state.headers())
        return err
    m.rate_limited.labels(tenant.id, decision.reason).inc()
    return rate_limit_error(tenant, plan.model, decision, plan.cost)


def _jobs(plan: GenerationPlan) -> list[Job]:
    """One `Job` per prompt and choice; choice i of a seeded request samples with ``seed + i``."""
    jobs: list[Job] = []
    seed0 = plan.req.seed
    for g, p in enumerate(plan.prompts):
        for i in range(plan.n):
            seed = None if seed0 is None else (seed0 + i + 2**63) % 2**64 - 2**63  # stays an int64
            jobs.append(Job(index=g * plan.n + i, group=g, prompt_ids=p, max_tokens=plan.max_tokens, seed=seed))
    return jobs


def rate_limit_error(tenant: TenantConfig, model: str, d: Decision, cost: int) -> APIError:
    """429 ``rate_limit_exceeded`` in OpenAI's wording, naming the limit that refused `cost` tokens,
    with ``retry-after`` and the ``x-ratelimit-*`` headers."""
    st = d.state
    lim = tenant.limits
    wait = _human(d.retry_after_s)
    prefix = f"Rate limit reached for {model} for tenant {tenant.id} on"
    if d.reason == "requests":
        typ = "requests"
        msg = (f"{prefix} requests per min (RPM): Limit {st.rpm_limit}, "
               f"Used {st.rpm_limit - max(0, st.rpm_remaining or 0)}, Requested 1. Please try again in {wait}.")
    elif d.reason == "tokens":
        typ = "tokens"
        msg = (f"{prefix} tokens per min (TPM): Limit {st.tpm_limit}, "
               f"Used {st.tpm_limit - max(0, st.tpm_remaining or 0)}, Requested {cost}. Please try again in {wait}.")
    elif d.reason == "inflight_tokens":
        typ = "tokens"
        msg = (f"{prefix} in-flight tokens: Limit {lim.max_inflight_tokens}, In flight {d.inflight_tokens}, "
               f"Requested {cost}. Please try again in {wait}.")
    else:
        typ = "requests"
        msg = (f"{prefix} concurrent requests: Limit {lim.max_concurrent_requests}, Running {d.concurrent}. "
               f"Please try again in {wait}.")
    headers = st.headers()
    headers.update(retry_headers(d.retry_after_s))
    return APIError(429, msg, typ, None, "rate_limit_exceeded", headers)


def _human(seconds: float) -> str:
    """A wait as the 429 message writes it: ``250ms``, ``1.5s``."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


__all__ = ["Job", "Session", "admit", "rate_limit_error"]
