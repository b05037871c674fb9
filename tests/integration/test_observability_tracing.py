"""Tracing across the gateway -> worker gRPC hop, with in-memory span exporters.

The worker runs in this process (its own grpc.aio server on its own thread and event loop, the
seeded random tiny Llama) with its own tracer provider; the gateway runs under uvicorn on another
thread with another provider. Both providers write to one InMemorySpanExporter. Nothing but the
gRPC metadata of the Generate call connects the two traces' contexts: the worker's thread never
sees the gateway's current context.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import yaml
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fairshare.ports import free_port
from fairshare.telemetry import extract_metadata, inject_metadata, make_tracer_provider
from fairshare.v1 import worker_pb2, worker_pb2_grpc
from tests.support.auth import signed
from tests.conftest import wait_ready
from tests.support.waits import wait_for

SECRET = "observability-test-secret"


class InProcessWorker:
    """A worker (WorkerServicer over a small reference engine) served by grpc.aio on a thread."""

    def __init__(self, tracer_provider) -> None:
        from worker.engine.engine import Engine, EngineConfig
        from worker.models import load_model

        self.model = load_model("random-tiny", progress=False)
        self.engine = Engine(self.model, EngineConfig(num_kv_blocks=256, block_size=16, max_running=8))
        self.tracer_provider = tracer_provider
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="obs-worker", daemon=True)

    async def _main(self) -> None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from worker.server import SERVICE_NAME, WorkerServicer

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = grpc.aio.server()
        self.servicer = WorkerServicer(self.engine, "random-tiny", tracer_provider=self.tracer_provider)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, server)
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        server.add_insecure_port(self.addr)
        self.engine.start()
        await server.start()
        for svc in ("", SERVICE_NAME):
            await hs.set(svc, health_pb2.HealthCheckResponse.SERVING)
        self._started.set()
        await self._stop.wait()
        await server.stop(grace=1.0)
        self.engine.shutdown()

    def start(self) -> "InProcessWorker":
        self._thread.start()
        assert self._started.wait(60), "in-process worker did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)


@pytest.fixture(scope="module")
def traced_stack(redis_url, tmp_path_factory):
    """(exporter, worker, gateway base URL, {tenant: key}): both tiers exporting to one in-memory exporter."""
    from gateway.app import create_app
    from gateway.auth import create_key
    from gateway.config import GatewaySettings
    from gateway.serve import ServerThread

    exporter = InMemorySpanExporter()
    worker = InProcessWorker(make_tracer_provider("fairshare-worker", span_exporter=exporter)).start()
    d = tmp_path_factory.mktemp("obs-gw")
    tf = d / "tenants.yaml"
    tf.write_text(yaml.safe_dump({"tenants": [{"id": "tracer-t", "limits": {"rpm": 1000, "tpm": 1_000_000}}]}))
    key = create_key(SECRET.encode(), "tracer-t", d / "tenants.keys.yaml")[0]
    settings = GatewaySettings(tenants_file=tf, workers=[worker.addr], secret=SECRET, redis_url=redis_url,
                               key_prefix="fairshare-obs-trace")
    app = create_app(settings, tracer_provider=make_tracer_provider("fairshare-gateway", span_exporter=exporter))
    server = ServerThread(app).start()
    wait_ready(server.base_url)
    yield exporter, worker, server.base_url, {"tracer-t": key}
    server.stop()
    worker.stop()


def _spans_of_trace(exporter, trace_id: int, want: set[str]):
    """The finished spans of a trace, once every name in `want` is among them (AssertionError if never)."""
    def spans():
        found = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        return found if want <= {s.name for s in found} else None

    return wait_for(spans, lambda: f"spans {sorted(want)} of trace {trace_id:x} finished; have "
                                   f"{sorted({s.name for s in exporter.get_finished_spans()})}")


def _finished(exporter, name: str) -> list:
    """The finished spans named `name`, once there is at least one (AssertionError if never)."""
    return wait_for(lambda: [s for s in exporter.get_finished_spans() if s.name == name], f"a finished {name} span")


def _all_attribute_text(spans) -> str:
    parts = []
    for s in spans:
        parts += [f"{k}={v}" for k, v in (s.attributes or {}).items()]
        parts += [str(e.attributes) for e in s.events]
        parts.append(str(s.status.description))
        parts += [f"{k}={v}" for k, v in s.resource.attributes.items()]
    return "\n".join(parts)


def test_gateway_span_parents_worker_spans_across_grpc(traced_stack):
    import openai

    exporter, worker, base_url, keys = traced_stack
    exporter.clear()
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=keys["tracer-t"], max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="random-tiny", messages=[{"role": "user", "content": "trace me"}],
                                            max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(text, str)

    roots = _finished(exporter, "gateway.request")
    assert len(roots) == 1
    root = roots[0]
    spans = _spans_of_trace(exporter, root.context.trace_id, {"worker.generate", "worker.queue", "worker.prefill",
                                                               "worker.decode", "gateway.streaming"})
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)

    # the gateway's tree
    assert root.parent is None and root.kind == trace.SpanKind.SERVER
    assert root.attributes["fairshare.tenant"] == "tracer-t"
    assert root.attributes["http.response.status_code"] == 200
    assert root.resource.attributes["service.name"] == "fairshare-gateway"
    for name in ("gateway.auth", "gateway.tokenize", "gateway.admission", "gateway.routing", "gateway.streaming",
                 "gateway.worker_call"):
        assert len(by_name.get(name, [])) == 1, (name, sorted(by_name))
        assert by_name[name][0].parent.span_id == root.context.span_id, name
    assert by_name["gateway.admission"][0].attributes["fairshare.admitted"] is True
    assert by_name["gateway.routing"][0].attributes["fairshare.worker"] == worker.addr
    call = by_name["gateway.worker_call"][0]
    assert call.kind == trace.SpanKind.CLIENT and call.attributes["server.address"] == worker.addr
    # the reference worker multiplexes the gateway's calls on one GenerateMany stream: the span names it
    assert call.attributes["rpc.method"] == "GenerateMany"
    assert by_name["gateway.streaming"][0].attributes["fairshare.completion_tokens"] == 6

    # across the hop: the worker's server span is the child of the gateway's client span
    gen = by_name["worker.generate"]
    assert len(gen) == 1
    gen = gen[0]
    assert gen.resource.attributes["service.name"] == "fairshare-worker"
    assert gen.kind == trace.SpanKind.SERVER
    assert gen.context.trace_id == root.context.trace_id
    assert gen.parent is not None and gen.parent.is_remote
    assert gen.parent.span_id == call.context.span_id
    assert gen.attributes["fairshare.tenant"] == "tracer-t"
    assert gen.attributes["fairshare.outcome"] == "length"
    assert gen.attributes["fairshare.completion_tokens"] == 6

    # queueing, prefill and decode: children of worker.generate, in order, inside it
    q, p, d = (by_name[n][0] for n in ("worker.queue", "worker.prefill", "worker.decode"))
    for s in (q, p, d):
        assert s.parent.span_id == gen.context.span_id
        assert s.context.trace_id == root.context.trace_id
    assert gen.start_time == q.start_time <= q.end_time == p.start_time <= p.end_time == d.start_time
    assert d.end_time <= gen.end_time
    assert d.attributes["fairshare.completion_tokens"] == 6
    assert call.start_time <= gen.start_time

    # the API key never appears in any span
    everything = _all_attribute_text(spans)
    assert keys["tracer-t"] not in everything and keys["tracer-t"][-8:] not in everything


def test_worker_span_without_trace_metadata_is_a_root(traced_stack):
    """Proves the parent above came through the metadata: a call without it starts a new trace."""
    exporter, worker, _, _ = traced_stack
    exporter.clear()
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker.addr))
    req = worker_pb2.GenerateRequest(request_id="no-trace-ctx", tenant=worker_pb2.Tenant(id="direct", weight=1.0),
                                     prompt_token_ids=list(range(100, 120)),
                                     sampling=worker_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    assert sum(len(m.token_ids) for m in stub.Generate(req, metadata=signed(req))) == 3
    gen = _finished(exporter, "worker.generate")[0]
    assert gen.parent is None
    assert gen.attributes["fairshare.request_id"] == "no-trace-ctx"


def test_rejected_request_is_traced_without_the_key(traced_stack):
    import openai

    exporter, _, base_url, keys = traced_stack
    exporter.clear()
    bad = "sk-fs-" + "x" * 39 + "LEAK"
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=bad, max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="random-tiny", prompt="hi", max_tokens=2)
    root = _finished(exporter, "gateway.request")[0]
    spans = exporter.get_finished_spans()
    auth = [s for s in spans if s.name == "gateway.auth"][0]
    assert root.attributes["http.response.status_code"] == 401
    assert root.attributes["error.type"] == "invalid_api_key"
    assert "fairshare.tenant" not in root.attributes
    assert auth.status.status_code == trace.StatusCode.ERROR
    assert "LEAK" not in _all_attribute_text(spans) and "xxxx" not in _all_attribute_text(spans)
    assert not [s for s in spans if s.name.startswith("worker.")]


def test_exporter_configuration(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider

    monkeypatch.delenv("FAIRSHARE_OTEL_EXPORTER", raising=False)
    assert make_tracer_provider("svc") is None  # off by default
    assert make_tracer_provider("svc", "none") is None
    monkeypatch.setenv("FAIRSHARE_OTEL_EXPORTER", "console")
    p = make_tracer_provider("svc")
    assert isinstance(p, TracerProvider) and p.resource.attributes["service.name"] == "svc"
    p.shutdown()
    p = make_tracer_provider("svc", "otlp")  # exporter built lazily; nothing is sent until a span ends
    assert isinstance(p, TracerProvider)
    p.shutdown()
    with pytest.raises(ValueError):
        make_tracer_provider("svc", "zipkin")


def test_trace_context_metadata_round_trip():
    exporter = InMemorySpanExporter()
    tracer = make_tracer_provider("svc", span_exporter=exporter).get_tracer("t")
    assert inject_metadata() == []  # no span: nothing to carry
    with tracer.start_as_current_span("parent") as span:
        md = inject_metadata()
    assert [k for k, _ in md] == ["traceparent"]
    ctx = trace.get_current_span(extract_metadata(md)).get_span_context()
    assert ctx.trace_id == span.get_span_context().trace_id and ctx.span_id == span.get_span_context().span_id
    assert ctx.is_remote
    assert not trace.get_current_span(extract_metadata([("traceparent", "garbage")])).get_span_context().is_valid
    assert not trace.get_current_span(extract_metadata(None)).get_span_context().is_valid
