"""The worker's spans (OpenTelemetry) for one ``Generate`` call.

::

    worker.generate (SERVER)   parent: the gateway's gateway.worker_call, from the gRPC metadata
      worker.queue             arrival -> first scheduled          (engine's queued_s)
      worker.prefill           first scheduled -> first token      (first_token_s - queued_s)
      worker.decode            first token -> finish

The engine reports its phase boundaries as seconds since the request's arrival (`RequestOutput.timings`
queued_s / first_token_s); the phase spans are created when the call ends, with explicit start and
end times anchored at the wall-clock arrival time, so the engine loop is untouched. A preempted
request that is recomputed still has one queue and one prefill span (first scheduling, first token).
Attributes carry the tenant id, request id and token counts; never prompts, outputs or keys.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from fairshare.telemetry import extract_metadata, get_tracer

TRACER_NAME = "fairshare.worker"


def worker_tracer(provider=None) -> trace.Tracer:
    """The worker's tracer from `provider` (None: the global provider, a no-op unless configured)."""
    return get_tracer(TRACER_NAME, provider)


def _ns(base_ns: int, seconds: float) -> int:
    return base_ns + int(seconds * 1e9)


class RequestTrace:
    """Spans of one Generate call. Call `observe()` for each engine output and `end()` once."""

    def __init__(self, tracer: trace.Tracer, metadata, request_id: str, tenant_id: str, *, prompt_tokens: int,
                 max_tokens: int, tier: str) -> None:
        self.tracer = tracer
        self.arrival_ns = time.time_ns()
        self.span = tracer.start_span(
            "worker.generate", context=extract_metadata(metadata), kind=SpanKind.SERVER, start_time=self.arrival_ns,
            attributes={"rpc.system": "grpc", "rpc.service": "fairshare.v1.Worker", "rpc.method": "Generate",
                        "fairshare.request_id": request_id, "fairshare.tenant": tenant_id,
                        "fairshare.tier": tier, "fairshare.prompt_tokens": prompt_tokens,
                        "fairshare.max_tokens": max_tokens})
        self.recording = self.span.is_recording()
        self.queued_s: float | None = None
        self.first_token_s: float | None = None
        self.completion_tokens = 0
        self._ended = False

    def observe(self, queued_s: float | None, first_token_s: float | None, tokens: int) -> None:
        """Note one output of the call: its queue time and time to first token so far (seconds since
        arrival at the worker, None: not reached yet; the first value given counts) and `tokens`, the
        output tokens it carries."""
        if self.queued_s is None and queued_s is not None:
            self.queued_s = queued_s
        if self.first_token_s is None and first_token_s is not None:
            self.first_token_s = first_token_s
        self.completion_tokens += tokens

    def end(self, outcome: str, end_ns: int | None = None, usage=None) -> None:
        """End the call: `outcome` is the finish reason (stop, length, abort), ``cancelled`` (the client
        went away), ``error`` (the engine failed it) or ``rejected`` (invalid request). end_ns: wall time of
        the end (default now). usage: the final RequestOutput, for token counts."""
        if self._ended:
            return
        self._ended = True
        end_ns = end_ns or time.time_ns()
        if not self.recording:
            self.span.end(end_time=end_ns)
            return
        ctx = trace.set_span_in_context(self.span)
        base = self.arrival_ns
        q_end = None if self.queued_s is None else min(_ns(base, self.queued_s), end_ns)
        self._phase("worker.queue", ctx, base, q_end if q_end is not None else end_ns, q_end is None)
        if q_end is not None:
            f_end = None if self.first_token_s is None else min(max(_ns(base, self.first_token_s), q_end), end_ns)
            self._phase("worker.prefill", ctx, q_end, f_end if f_end is not None else end_ns, f_end is None)
            if f_end is not None:
                self._phase("worker.decode", ctx, f_end, end_ns, outcome not in ("stop", "length"),
                            {"fairshare.completion_tokens": self.completion_tokens})
        attrs = {"fairshare.outcome": outcome, "fairshare.completion_tokens": self.completion_tokens}
        if usage is not None:
            attrs["fairshare.cached_prompt_tokens"] = int(usage.cached_tokens)
        if self.queued_s is not None:
            attrs["fairshare.queued_s"] = self.queued_s
        if self.first_token_s is not None:
            attrs["fairshare.first_token_s"] = self.first_token_s
        self.span.set_attributes(attrs)
        if outcome in ("error", "rejected"):
            self.span.set_attribute("error.type", outcome)
            self.span.set_status(Status(StatusCode.ERROR, outcome))
        self.span.end(end_time=end_ns)

    def _phase(self, name: str, ctx, start_ns: int, end_ns: int, interrupted: bool, attrs: dict | None = None):
        attrs = dict(attrs or {})
        if interrupted:  # the call ended during this phase (abort, cancel, error)
            attrs["fairshare.interrupted"] = True
        span = self.tracer.start_span(name, context=ctx, start_time=start_ns, attributes=attrs)
        span.end(end_time=max(start_ns, end_ns))


__all__ = ["RequestTrace", "TRACER_NAME", "worker_tracer"]
