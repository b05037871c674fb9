"""The gateway's spans (OpenTelemetry). See docs/observability.md for the tree and attributes.

One request is traced as::

    gateway.request (SERVER)          tenant, endpoint, status, request id
      gateway.auth                    outcome only (the key is never recorded)
      gateway.tokenize                prompt tokens
      gateway.admission               cost, admitted, reason
      gateway.routing                 model, attempts, chosen worker (until the first token)
      gateway.worker_call (CLIENT)    one per attempt and choice; its context travels in the gRPC
                                      metadata and parents the worker's spans
      gateway.streaming               first token -> settlement: completion tokens, finish reasons

Span attributes and statuses carry error *codes* (``invalid_api_key``, ``rate_limit_exceeded``),
never error messages, which may echo part of a key.

With no exporter configured and no tracer provider installed in the process (no
``opentelemetry-instrument``, none set before the app is built), the gateway's tracer is
`UntracedTracer`: every span is the invalid span, and nothing is attached to the context or put in
gRPC metadata, so tracing costs a method call per span.
"""

from __future__ import annotations

from contextlib import nullcontext

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

from fairshare.telemetry import get_tracer

TRACER_NAME = "fairshare.gateway"


class UntracedTracer(trace.NoOpTracer):
    """A tracer for a process that traces nothing: spans are `INVALID_SPAN` (not recording, an invalid
    context: never propagated), and `start_as_current_span` does not touch the current context."""

    _CURRENT = nullcontext(INVALID_SPAN)  # reusable: enters to the invalid span, exits doing nothing

    def start_span(self, *args, **kwargs) -> Span:
        return INVALID_SPAN

    def start_as_current_span(self, *args, **kwargs):
        return self._CURRENT


def gateway_tracer(provider=None) -> trace.Tracer:
    """The gateway's tracer from `provider`; None: from the global provider when one is installed,
    else an `UntracedTracer` (decided now: a provider installed later is not seen)."""
    if provider is None and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return UntracedTracer()
    return get_tracer(TRACER_NAME, provider)


def set_error(span: Span, code: str | None) -> None:
    """Mark `span` failed with an error code (never a message)."""
    if span.is_recording():
        span.set_attribute("error.type", code or "error")
        span.set_status(Status(StatusCode.ERROR, code or None))


def end_request_span(span: Span, status: int, code: str | None = None) -> None:
    """Record the HTTP status of a request span and end it (5xx marks it failed, as for servers)."""
    if span.is_recording():
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_attribute("error.type", code or str(status))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, code or str(status)))
    span.end()


__all__ = ["TRACER_NAME", "UntracedTracer", "end_request_span", "gateway_tracer", "set_error"]
