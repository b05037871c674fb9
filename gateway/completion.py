"""One completion request (``/v1/chat/completions``, ``/v1/completions``) end to end, in order:

1. authenticate the API key -> tenant (401 otherwise; gateway/auth.py);
2. plan: body, validation, model, tokenization, token budget (gateway/plan.py);
3. admit in one Redis call and open the request's session (429 / 503 otherwise; gateway/session.py,
   gateway/admission.py);
4. start the generation(s) on the workers the routing policy picks, retrying on another worker until
   the first token (gateway/generation.py, gateway/routing.py);
5. answer: a JSON body, or an SSE stream (gateway/streaming.py), ``x-ratelimit-*`` headers on both;
6. settle exactly once on success, error or client disconnect (`gateway.session.Session.settle`):
   an error is settled before it is answered; a successful answer is sent first and settled right
   after its last byte (`SettledAfterSending`; a stream after its ``[DONE]``, gateway/streaming.py),
   so the client does not wait for the Redis round trip of the release (docs/architecture.md,
   "Settlement after the answer").

Each request is one ``gateway.request`` trace (gateway/tracing.py) with spans for auth, tokenize,
admission, routing, each worker call (whose context the worker continues) and streaming.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from .auth import Principal
from .errors import APIError
from .generation import collect, start_generations
from .metrics import UNKNOWN_TENANT
from .plan import endpoint_label, plan_request
from .session import Session, admit
from .sse import SSEResponse
from .state import Gateway
from .streaming import chat_stream, text_stream
from .tracing import end_request_span, set_error


async def serve(gw: Gateway, request: Request, kind: str):
    """Handle one completion request (`kind`: ``chat`` or ``text``) end to end (module docstring).
    Returns a JSONResponse or an SSEResponse; raises APIError (answered OpenAI-shaped)."""
    t0 = time.perf_counter()
    endpoint = endpoint_label(kind)
    span = gw.tracer.start_span("gateway.request", kind=SpanKind.SERVER, attributes={
        "http.request.method": request.method, "http.route": request.scope["path"], "fairshare.endpoint": endpoint})
    # the request span parents the others; an untraced one (tracing off) is not worth attaching
    token = otel_context.attach(trace.set_span_in_context(span)) if span.get_span_context().is_valid else None
    principal: Principal | None = None
    try:
        principal = _authenticate(gw, request, span, endpoint)
        session, answer = await _run(gw, request, kind, principal, span, endpoint, t0)
        return await _respond(gw, session, answer, span, endpoint, t0)
    except APIError:
        raise  # its status is on the request span already
    except BaseException as e:  # an unexpected error (or cancellation): the handlers answer 500
        cancelled = isinstance(e, asyncio.CancelledError)
        if not cancelled:  # counted as the 500 it is answered with (a cancelled request has no answer)
            gw.metrics.requests.labels(_tenant_of(principal), endpoint, "500").inc()
        end_request_span(span, 500, "cancelled" if cancelled else type(e).__name__)
        raise
    finally:
        if token is not None:
            otel_context.detach(token)


def _tenant_of(principal: Principal | None) -> str:
    return principal.tenant.id if principal is not None else UNKNOWN_TENANT


def _authenticate(gw: Gateway, request: Request, span: trace.Span, endpoint: str) -> Principal:
    """The request's principal, in a ``gateway.auth`` span. Raises APIError 401 (counted under the
    tenant ``unknown``: the key, or part of it, is never recorded)."""
    try:
        with gw.tracer.start_as_current_span("gateway.auth", record_exception=False,
                                             set_status_on_exception=False) as auth_span:
            try:
                principal = gw.directory.authenticate(request.headers.get("authorization"))
            except APIError as e:
                set_error(auth_span, e.code)
                raise
    except APIError as e:
        gw.metrics.requests.labels(UNKNOWN_TENANT, endpoint, str(e.status)).inc()
        end_request_span(span, e.status, e.code)
        raise
    span.set_attribute("fairshare.tenant", principal.tenant.id)
    return principal


async def _run(gw: Gateway, request: Request, kind: str, principal: Principal, span: trace.Span, endpoint: str,
               t0: float) -> tuple[Session, dict[str, Any] | AsyncIterator[bytes]]:
    """Steps 2-5 of the module docstring; an APIError gets the tenant's current ``x-ratelimit-*``
    headers (unless it carries its own), is counted and ends the request span."""
    tenant = principal.tenant
    try:
        return await admit_and_start(gw, request, kind, principal, t0)
    except APIError as e:
        if e.status not in (429, 503) and not any(k.startswith("x-ratelimit") for k in e.headers):
            d = await gw.control.peek(tenant)
            if d is not None:
                e.headers = {**d.state.headers(), **e.headers}
        gw.metrics.requests.labels(tenant.id, endpoint, str(e.status)).inc()
        end_request_span(span, e.status, e.code)
        raise


async def admit_and_start(gw: Gateway, request: Request, kind: str, principal: Principal, t0: float):
    """Plan, admit and start. Returns (session, dict body | SSE event iterator); a non-streamed
    request has run to the end (settled once its answer is sent, `_respond`). Raises APIError
    (nothing held: every error settles before it is raised)."""
    plan = await plan_request(gw, request, kind, principal.tenant)
    session = await admit(gw, principal, plan, t0)
    session.watch(request)
    req = plan.req
    await start_generations(session, req)
    if req.stream:
        return session, chat_stream(session, req) if kind == "chat" else text_stream(session, req)
    try:
        body = await collect(session, kind)
    except BaseException:
        await session.settle()
        raise
    return session, body


class SettledAfterSending(JSONResponse):
    """A non-streamed answer whose `session` settles once the response is over: after its last byte
    was handed to the server, or when sending it failed or was cancelled (settlement always runs)."""

    def __init__(self, content: dict[str, Any], session: Session) -> None:
        self.session = session
        super().__init__(content, headers=session.headers())

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.session.settle()


async def _respond(gw: Gateway, session: Session, answer, span: trace.Span, endpoint: str, t0: float):
    """The HTTP response: JSON (settled once sent; the request span ends now) or SSE (the span ends
    when the stream settles)."""
    tenant_id = session.tenant.id
    span.set_attribute("fairshare.request_id", session.rid)
    if isinstance(answer, dict):  # non-streamed: it settles once sent
        try:
            response = SettledAfterSending(answer, session)
        except BaseException:  # a body it cannot encode: a 500 (counted so), settled first
            await session.settle()
            raise
        gw.metrics.requests.labels(tenant_id, endpoint, "200").inc()
        gw.metrics.latency.labels(tenant_id, endpoint).observe(time.perf_counter() - t0)
        end_request_span(span, 200)
        return response
    gw.metrics.requests.labels(tenant_id, endpoint, "200").inc()
    span.set_attribute("fairshare.stream", True)
    session.request_span = span  # ended when the stream settles
    return SSEResponse(answer, on_disconnect=session.on_client_gone, on_close=session.settle,
                       headers=session.headers())


__all__ = ["admit_and_start", "serve"]
