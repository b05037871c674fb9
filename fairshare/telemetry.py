"""Tracing set-up shared by the gateway and the worker (OpenTelemetry), and W3C trace-context over gRPC.

Configuration (both tiers, off by default):

- ``FAIRSHARE_OTEL_EXPORTER=none|console|otlp`` (flag ``--otel-exporter``):
  ``none`` creates no tracer provider; spans go to whatever global provider the process has (a no-op
  one unless something else, e.g. ``opentelemetry-instrument``, installed one), so tracing costs
  next to nothing. ``console`` prints finished spans as JSON on stdout. ``otlp`` sends them over
  OTLP/gRPC to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; default
  ``http://localhost:4317``), batched.
- ``OTEL_SERVICE_NAME`` overrides the service name (``fairshare-gateway`` / ``fairshare-worker``);
  ``OTEL_RESOURCE_ATTRIBUTES`` adds resource attributes.

Trace context crosses the gateway -> worker hop in the gRPC metadata of ``Generate`` (``traceparent``
and ``tracestate``, W3C Trace Context; `inject_metadata` on the client, `extract_metadata` on the
server). No gRPC auto-instrumentation is used.

This module never imports torch (the gateway uses it).
"""

from __future__ import annotations

import os
from typing import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXPORTERS = ("none", "console", "otlp")
ENV_EXPORTER = "FAIRSHARE_OTEL_EXPORTER"

# Only W3C trace context crosses the hop (no baggage: nothing a client chose travels to the worker).
_PROPAGATOR = TraceContextTextMapPropagator()


def exporter_from_env(default: str = "none") -> str:
    """The exporter named by ``FAIRSHARE_OTEL_EXPORTER`` (lower-cased), else `default`."""
    return (os.environ.get(ENV_EXPORTER) or default).strip().lower()


def make_tracer_provider(service_name: str, exporter: str | None = None, span_exporter=None):
    """A new SDK `TracerProvider` for `service_name` exporting as `exporter` says, or None for ``none``.

    exporter: ``none``, ``console`` or ``otlp`` (default: ``FAIRSHARE_OTEL_EXPORTER``, else ``none``).
    span_exporter: an explicit SpanExporter (e.g. tests' InMemorySpanExporter), exported synchronously;
    it wins over `exporter`. Raises ValueError for an unknown exporter name.
    """
    exporter = exporter_from_env() if exporter is None else exporter.strip().lower()
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown tracing exporter {exporter!r}: use one of {', '.join(EXPORTERS)}")
    if span_exporter is None and exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attrs))
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    elif exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def get_tracer(name: str, provider=None) -> trace.Tracer:
    """A tracer from `provider`, or from the global provider when None."""
    if provider is None:
        return trace.get_tracer(name)
    return provider.get_tracer(name)


def inject_metadata(ctx: Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata (``traceparent``, ``tracestate``) carrying the span context of `ctx` (default: the
    current context). Empty when that span is not recording a valid trace (tracing off)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return [(k.lower(), v) for k, v in carrier.items()]


def extract_metadata(metadata: Iterable | None) -> Context:
    """The parent context found in gRPC invocation metadata (pairs or objects with key/value); an
    empty context when there is none or it is malformed."""
    carrier: dict[str, str] = {}
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if isinstance(value, bytes):  # binary (-bin) headers are never trace context
            continue
        carrier[key.lower()] = value
    return _PROPAGATOR.extract(carrier)


__all__ = ["ENV_EXPORTER", "EXPORTERS", "exporter_from_env", "extract_metadata", "get_tracer", "inject_metadata",
           "make_tracer_provider"]
