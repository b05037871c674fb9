"""The SGLang worker's gRPC servicer over a stand-in engine (no GPU): streaming, usage with cached
tokens, abort by RPC and by cancelling the stream, validation errors, GetModelInfo / GetLoad.

The stand-in `tokenizer_manager.generate_request` behaves like SGLang 0.5.23's for a streaming
request with `skip_tokenizer_init`: cumulative `output_ids` (or only the new ids when
`incremental_streaming_output`), `meta_info` with `finish_reason`, `prompt_tokens`,
`completion_tokens`, `cached_tokens`; `abort_request(rid=...)` ends the stream with an abort.
"""

from __future__ import annotations

import asyncio
import json
import os

import grpc
import pytest

from fairshare import worker_auth
from fairshare.v1 import worker_pb2, worker_pb2_grpc
from tests.support.auth import forged_calls, signed
from tests.support.waits import wait_for_async
from worker import sglang_server as ss
from worker.sglang_plugin import tenant as tn


class FakeTokenizerManager:
    """until_aborted: after the first step, produce nothing more until the request is aborted (a
    generation that is certainly still going when the test aborts or cancels it, on any machine)."""

    def __init__(self, incremental=False, tokens_per_step=1, steps=4, delay=0.01, until_aborted=False):
        self.incremental_streaming_output = incremental
        self.tokens_per_step, self.steps, self.delay = tokens_per_step, steps, delay
        self.until_aborted = until_aborted
        self.requests, self.aborted = [], []
        self._abort_events: dict[str, asyncio.Event] = {}

    def abort_request(self, rid="", abort_all=False):
        self.aborted.append(rid)
        if rid in self._abort_events:
            self._abort_events[rid].set()

    async def generate_request(self, obj, request=None):
        self.requests.append(obj)
        out, prompt = [], obj["input_ids"]
        if obj["sampling_params"].get("regex") == "([":  # what SGLang answers to a grammar it cannot compile
            yield {"output_ids": [], "meta_info": {"finish_reason": {
                "type": "abort", "status_code": 400, "message": "Failed to compile regex grammar: unclosed ["},
                "prompt_tokens": len(prompt), "completion_tokens": 0}}
            return
        limit = obj["sampling_params"]["max_new_tokens"]
        self._abort_events[obj["rid"]] = asyncio.Event()
        for step in range(self.steps):
            await asyncio.sleep(self.delay)
            if self.until_aborted and step > 0:
                await self._abort_events[obj["rid"]].wait()
            if obj["rid"] in self.aborted:
                yield {"output_ids": [] if self.incremental_streaming_output else list(out),
                       "meta_info": {"finish_reason": {"type": "abort", "message": "Aborted"},
                                     "prompt_tokens": len(prompt), "completion_tokens": len(out), "cached_tokens": 0}}
                return
            new = [10 + len(out) + i for i in range(self.tokens_per_step)][: limit - len(out)]
            out += new
            done = len(out) >= limit or step == self.steps - 1
            reason = {"type": "length", "length": limit} if done else None
            yield {"output_ids": new if self.incremental_streaming_output else list(out),
                   "meta_info": {"finish_reason": reason, "prompt_tokens": len(prompt), "completion_tokens": len(out),
                                 "cached_tokens": 2, "queue_time": 0.005}}
            if done:
                return


class FakeEngine:
    def __init__(self, **kw):
        self.tokenizer_manager = FakeTokenizerManager(**kw)


FACTS = ss.ModelFacts(name="fake", max_context_tokens=128, vocab_size=1000, eos_token_ids=[2])


def _verifier() -> worker_auth.Verifier:
    return worker_auth.Verifier(worker_auth.WorkerKeys.parse(os.environ[worker_auth.KEYS_ENV]))


async def _serve(engine, facts=FACTS, **options):
    server = grpc.aio.server()
    servicer = ss.SGLangWorkerServicer(engine, facts, "sec", "vtc", request_factory=dict, verifier=_verifier(),
                                       **options)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, worker_pb2_grpc.WorkerStub(channel), servicer


def _request(rid="r1", max_tokens=4, prompt=(1, 2, 3, 4, 5)):
    req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=list(prompt),
                                     tenant=worker_pb2.Tenant(id="acme", weight=2.0, cache_namespace="ns"))
    req.sampling.max_tokens = max_tokens
    return req


@pytest.mark.parametrize("incremental,per_step", [(False, 1), (True, 1), (False, 3)])
async def test_generate_streams_tokens_and_usage(incremental, per_step):
    engine = FakeEngine(incremental=incremental, tokens_per_step=per_step)
    server, channel, stub, servicer = await _serve(engine)
    try:
        req = _request(max_tokens=4)
        msgs = [m async for m in stub.Generate(req, metadata=signed(req))]
        tokens = [t for m in msgs for t in m.token_ids]
        assert tokens == [10, 11, 12, 13]
        final = msgs[-1]
        assert final.finish_reason == worker_pb2.FINISH_REASON_LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens) == (5, 4, 2)
        assert msgs[0].timings.queued_s == pytest.approx(0.005) and final.timings.first_token_s > 0
        sent = engine.tokenizer_manager.requests[0]
        assert sent["extra_key"] == tn.extra_key_for("acme", "", "sec") and sent["rid"] == ss.sglang_rid("r1")
        tag, _ = tn.verify(sent["sampling_params"]["custom_params"][tn.CUSTOM_PARAM_KEY], "sec", rid=sent["rid"])
        assert tag.tenant_id == "acme"
        load = await stub.GetLoad(worker_pb2.GetLoadRequest())
        assert load.policy == "vtc" and load.tenants[0].tenant_id == "acme" and load.tenants[0].output_tokens == 4
        assert load.tenants[0].prompt_tokens == 3 and load.tenants[0].finished == 1   # uncached prompt tokens
        info = await stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
        assert info.model_name == "fake" and list(info.eos_token_ids) == [2]
    finally:
        await channel.close()
        await server.stop(None)


async def test_abort_rpc_and_stream_cancel_abort_in_sglang():
    engine = FakeEngine(steps=50, delay=0.02, until_aborted=True)
    server, channel, stub, servicer = await _serve(engine)
    try:
        req = _request("r-abort", max_tokens=100)
        call = stub.Generate(req, metadata=signed(req))
        first = await call.read()
        assert list(first.token_ids) == [10]
        abort = worker_pb2.AbortRequest(request_id="r-abort")
        resp = await stub.Abort(abort, metadata=signed(abort))
        assert resp.found and engine.tokenizer_manager.aborted == [ss.sglang_rid("r-abort")]
        rest = []
        while (m := await call.read()) is not grpc.aio.EOF:
            rest.append(m)
        assert rest[-1].finish_reason == worker_pb2.FINISH_REASON_ABORT
        gone = worker_pb2.AbortRequest(request_id="r-never-live")
        assert not (await stub.Abort(gone, metadata=signed(gone))).found

        req2 = _request("r-cancel", max_tokens=100)
        call2 = stub.Generate(req2, metadata=signed(req2))
        await call2.read()
        call2.cancel()                                   # the gateway went away
        await wait_for_async(lambda: ss.sglang_rid("r-cancel") in engine.tokenizer_manager.aborted,
                             "the cancelled stream aborted in SGLang")
        await wait_for_async(lambda: "r-cancel" not in servicer.live, "the cancelled request no longer live")
    finally:
        await channel.close()
        await server.stop(None)


async def _refused_as_invalid(stub, req) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [m async for m in stub.Generate(req, metadata=signed(req))]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_invalid_requests_rejected():
    server, channel, stub, _ = await _serve(FakeEngine())
    try:
        for bad in (_request("bad-1", prompt=()), _request("bad-2", prompt=[5] * 128), _request("bad-3", prompt=[1000])):
            await _refused_as_invalid(stub, bad)
    finally:
        await channel.close()
        await server.stop(None)


def _tenant_request(rid: str, tenant: str, weight: float) -> worker_pb2.GenerateRequest:
    req = _request(rid)
    req.tenant.id, req.tenant.weight = tenant, weight
    return req


async def test_calls_not_signed_by_the_gateway_are_unauthenticated_and_never_reach_sglang():
    """No token, a forged one, an unknown key, a token moved to another identity, an expired one, a
    garbled one, and a replay of a used one: UNAUTHENTICATED, counted per reason, and SGLang never
    sees the request (its tokenizer manager got exactly the one honest call)."""
    engine = FakeEngine()
    server, channel, stub, servicer = await _serve(engine)
    try:
        for case, reason, req, md in forged_calls(_tenant_request):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(req, metadata=md)]
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, case
            assert servicer.metrics.auth_failures.labels(reason)._value.get() >= 1, (case, reason)
        assert engine.tokenizer_manager.requests == [] and servicer.tenants == {}
        honest = _tenant_request("auth-replay", "victim", 1.0)
        md = signed(honest)
        msgs = [m async for m in stub.Generate(honest, metadata=md)]
        assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the same call again, captured
            [m async for m in stub.Generate(honest, metadata=md)]
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "already used" in err.value.details()
        assert servicer.metrics.auth_failures.labels("replayed")._value.get() == 1
        assert len(engine.tokenizer_manager.requests) == 1          # only the honest call reached SGLang
        abort = worker_pb2.AbortRequest(request_id="auth-replay")
        with pytest.raises(grpc.aio.AioRpcError) as err:            # Abort needs a token as well
            await stub.Abort(abort)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and engine.tokenizer_manager.aborted == []
        load = await stub.GetLoad(worker_pb2.GetLoadRequest())     # load and model info stay open
        assert [t.tenant_id for t in load.tenants] == ["victim"]
    finally:
        await channel.close()
        await server.stop(None)


async def test_scheduler_failure_fails_open_streams_and_refuses_new_calls():
    """SGLang's scheduler reports a failure (the SIGQUIT handler calls `scheduler_failed`): the open
    stream ends with UNAVAILABLE (the gateway retries a request without tokens elsewhere), new calls
    are refused with UNAVAILABLE, the failure is exported, and `on_failed` (health NOT_SERVING) ran."""
    engine = FakeEngine(steps=50, delay=0.02, until_aborted=True)
    server, channel, stub, servicer = await _serve(engine)
    heard = []
    servicer.on_failed = heard.append
    try:
        req = _request("r-open", max_tokens=100)
        call = stub.Generate(req, metadata=signed(req))
        assert list((await call.read()).token_ids) == [10]            # streaming, then waiting in SGLang
        servicer.scheduler_failed("an SGLang scheduler process failed (SIGQUIT)")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "failed" in err.value.details()
        assert heard and "SIGQUIT" in heard[0]
        late = _request("r-late")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(late, metadata=signed(late))]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [r["rid"] for r in engine.tokenizer_manager.requests] == [ss.sglang_rid("r-open")]
        text = servicer.metrics.render().decode()
        assert "fairshare_worker_engine_failed 1.0" in text and "fairshare_worker_engine_faults_total 1.0" in text
        await wait_for_async(lambda: "r-open" not in servicer.live, "the failed stream no longer live")
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_grammar_sglang_cannot_compile_is_invalid_argument_naming_the_grammar():
    server, channel, stub, servicer = await _serve(FakeEngine())
    try:
        req = _request("r-grammar")
        req.sampling.grammar.regex = "(["
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(req, metadata=signed(req))]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "compile" in err.value.details()
        assert dict(err.value.trailing_metadata())["fairshare-invalid"] == "grammar"
        # the servicer forgets the request in its handler's cleanup, which may run after the client has the error
        await wait_for_async(lambda: "r-grammar" not in servicer.live, "the refused request no longer live")
    finally:
        await channel.close()
        await server.stop(None)


def _sample(text: str, name: str, **labels) -> float:
    """One sample's value from a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_generate_exports_the_reference_workers_series_and_spans():
    """The SGLang worker feeds the reference worker's per-tenant stream series (worker.metrics) and
    spans (worker.tracing): TTFT, queue time (SGLang's meta_info queue_time), ITL, requests by
    finish reason (rejected included), prompt and cached prompt tokens; worker.generate with its
    queue / prefill / decode phases."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fairshare.telemetry import make_tracer_provider
    from worker.metrics import WorkerMetrics
    from worker.tracing import worker_tracer

    exporter = InMemorySpanExporter()
    metrics = WorkerMetrics()
    server, channel, stub, servicer = await _serve(
        FakeEngine(), metrics=metrics, tracer=worker_tracer(make_tracer_provider("t", span_exporter=exporter)))
    try:
        req = _request(max_tokens=4)
        msgs = [m async for m in stub.Generate(req, metadata=signed(req))]
        assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        await _refused_as_invalid(stub, _request("r2", prompt=()))   # refused before SGLang sees it
    finally:
        await channel.close()
        await server.stop(None)
    text = metrics.render().decode()
    assert _sample(text, "fairshare_worker_ttft_seconds_count", tenant="acme") == 1
    assert _sample(text, "fairshare_worker_queue_seconds_sum", tenant="acme") == pytest.approx(0.005)
    assert _sample(text, "fairshare_worker_itl_seconds_count", tenant="acme") == 3     # 4 tokens, one a step
    assert _sample(text, "fairshare_worker_requests_total", tenant="acme", finish_reason="length") == 1
    assert _sample(text, "fairshare_worker_requests_total", tenant="acme", finish_reason="rejected") == 1
    assert _sample(text, "fairshare_worker_prompt_tokens_total", tenant="acme") == 5
    assert _sample(text, "fairshare_worker_cached_prompt_tokens_total", tenant="acme") == 2
    spans = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    assert sorted(spans) == ["worker.decode", "worker.generate", "worker.prefill", "worker.queue"]
    ok = next(s for s in spans["worker.generate"] if s.attributes["fairshare.outcome"] == "length")
    assert ok.attributes["fairshare.tenant"] == "acme" and ok.attributes["fairshare.tier"] == "interactive"
    assert ok.attributes["fairshare.cached_prompt_tokens"] == 2 and ok.attributes["fairshare.completion_tokens"] == 4
    assert any(s.attributes["fairshare.outcome"] == "rejected" for s in spans["worker.generate"])
    queue = next(s for s in spans["worker.queue"] if s.parent.span_id == ok.context.span_id)
    assert (queue.end_time - queue.start_time) == pytest.approx(0.005e9, abs=1e3)


async def test_ttft_floor_holds_a_tiers_first_token():
    """--ttft-floor interactive=0.3: the first token leaves no earlier than 0.3 s after arrival (the
    TTFT reported, in the message and the series, is the one the client sees); every token still comes."""
    from worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    server, channel, stub, servicer = await _serve(FakeEngine(), metrics=metrics, ttft_floor_s={"interactive": 0.3})
    try:
        req = _request(max_tokens=4)
        msgs = [m async for m in stub.Generate(req, metadata=signed(req))]
    finally:
        await channel.close()
        await server.stop(None)
    assert [t for m in msgs for t in m.token_ids] == [10, 11, 12, 13]
    first = next(m for m in msgs if m.token_ids)
    assert first.timings.first_token_s >= 0.3
    assert _sample(metrics.render().decode(), "fairshare_worker_ttft_seconds_sum", tenant="acme") >= 0.3


def test_worker_flags_reach_the_servicer_and_plugin():
    """`--ttft-floor` is the reference worker's flag (worker.cache.options)."""
    from worker.cache.options import ttft_floor_settings

    p = ss.build_parser()
    args = p.parse_args(["--model", "m", "--ttft-floor", "interactive=0.2"])
    assert ttft_floor_settings(p, args) == {"interactive": 0.2}
    with pytest.raises(SystemExit):
        ttft_floor_settings(p, p.parse_args(["--model", "m", "--ttft-floor", "batch=1", "--ttft-floor", "batch=2"]))


async def test_metrics_export_the_schedulers_fairshare_figures_under_the_reference_names():
    """The SGLang worker's /metrics carries the reference worker's per-tenant and per-tier series,
    from each scheduler's plugin state (`Scheduler.get_internal_state`, read through the tokenizer
    manager at scrape time, off the event loop as Prometheus scrapes are)."""
    from tests.sglang.test_plugin_state import FakeReq, admit_all, make_state

    plugin = make_state()
    admit_all(plugin, [FakeReq("a1", "A", 40, weight=2.0), FakeReq("g1", "G", 30, tier="background")])
    plugin.on_arrival(FakeReq("a2", "A", 40, weight=2.0))
    plugin.policy.charge("A", 80.0, prompt_tokens=40)

    class Manager(FakeTokenizerManager):
        async def get_internal_state(self):
            return [{"max_running_requests": 8, "fairshare": plugin.engine_snapshot()}]

    engine = FakeEngine()
    engine.tokenizer_manager = Manager()
    server, channel, stub, servicer = await _serve(engine)
    try:
        servicer.snapshots.loop = asyncio.get_running_loop()
        text = (await asyncio.to_thread(servicer.metrics.render)).decode()
    finally:
        await channel.close()
        await server.stop(None)
    assert _sample(text, "fairshare_worker_running_requests") == 2
    assert _sample(text, "fairshare_worker_waiting_requests") == 1
    assert _sample(text, "fairshare_worker_tenant_virtual_counter", tenant="A") == \
        plugin.policy.accounts["A"].virtual_counter > 0
    assert _sample(text, "fairshare_worker_tenant_charged_service_units_total", tenant="A") == 80.0
    assert _sample(text, "fairshare_worker_tenant_waiting_requests", tenant="A") == 1
    assert _sample(text, "fairshare_worker_tier_running_requests", tier="background") == 1
    assert _sample(text, "fairshare_worker_tier_min_share", tier="background") == 0.05
    assert _sample(text, "fairshare_worker_policy_info", policy="vtc") == 1


def _byte_level_facts() -> ss.ModelFacts:
    """Facts of a model whose tokenizer is byte-level BPE over the 256 bytes plus ``<eos>`` (id 256):
    enough for xgrammar to build its vocabulary tables."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return ss.ModelFacts(name="fake", max_context_tokens=128, vocab_size=257, eos_token_ids=[256],
                         tokenizer_json=tok.to_str())


async def test_a_grammar_nothing_satisfies_is_refused_before_sglang_runs_it():
    """The reference engine's refusals (worker/engine/grammar.GrammarCompiler) hold on the SGLang path:
    a schema that compiles but admits no value, or a forced tool call whose parameters admit none,
    is INVALID_ARGUMENT naming the grammar, and SGLang never sees the request; a satisfiable schema
    still reaches SGLang unchanged."""
    engine = FakeEngine()
    server, channel, stub, servicer = await _serve(engine, facts=_byte_level_facts())
    tool_tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<tool_call>\n{\"name\": \"f\", "
                "\"arguments\": ", "content": {"type": "json_schema", "json_schema": {"$ref": "#"}},
                "end": "}\n</tool_call>"}}
    try:
        for i, (kind, source) in enumerate([("json_schema", '{"$ref": "#"}'),
                                            ("structural_tag", json.dumps(tool_tag))]):
            req = _request(f"r-dead-{i}")
            setattr(req.sampling.grammar, kind, source)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(req, metadata=signed(req))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "no output satisfies it" in err.value.details(), err.value.details()
            assert dict(err.value.trailing_metadata())["fairshare-invalid"] == "grammar"
        assert engine.tokenizer_manager.requests == []  # SGLang never saw them
        req = _request("r-ok")
        req.sampling.grammar.json_schema = '{"type": "object"}'
        msgs = [m async for m in stub.Generate(req, metadata=signed(req))]
        assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        assert engine.tokenizer_manager.requests[0]["sampling_params"]["json_schema"] == '{"type": "object"}'
        await wait_for_async(lambda: not servicer.live, "the requests no longer live")
    finally:
        await channel.close()
        await server.stop(None)


async def test_generate_many_serves_the_sglang_path_as_generate_does():
    """The gateway's GenerateMany stream (worker/multiplex.py) runs the SGLang servicer's own Generate
    per open: on one stream, a request SGLang answers streams its tokens then ends OK, a refused
    grammar ends INVALID_ARGUMENT with `fairshare-invalid: grammar`, and an unsigned one ends
    UNAUTHENTICATED, each without touching the others."""
    engine = FakeEngine()
    server, channel, stub, servicer = await _serve(engine, facts=_byte_level_facts())
    good, dead, unsigned = _request("m-good"), _request("m-dead"), _request("m-unsigned")
    dead.sampling.grammar.json_schema = '{"$ref": "#"}'
    msg = worker_pb2.GenerateManyIn(open=[worker_pb2.GenerateOpen(request=r, metadata=dict(signed(r)))
                                          for r in (good, dead)] + [worker_pb2.GenerateOpen(request=unsigned)])
    call = stub.GenerateMany()
    try:
        await call.write(msg)
        events: dict[str, list] = {}
        ended: dict[str, worker_pb2.GenerateEnd] = {}
        async def until_all_ended():
            async for out in call:
                for ev in out.events:
                    assert ev.request_id not in ended, f"an event for {ev.request_id} after its end"
                    if ev.HasField("end"):
                        ended[ev.request_id] = ev.end
                    else:
                        events.setdefault(ev.request_id, []).append(ev.response)
                if len(ended) == 3:
                    return
        await asyncio.wait_for(until_all_ended(), 60)  # a ceiling against a hang only
        assert ended["m-good"].code == 0 and events["m-good"][-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        assert ended["m-dead"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert dict(ended["m-dead"].trailing_metadata) == {"fairshare-invalid": "grammar"}
        assert ended["m-unsigned"].code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert "m-dead" not in events and "m-unsigned" not in events
        assert len(engine.tokenizer_manager.requests) == 1  # only the good one reached SGLang
        await wait_for_async(lambda: not servicer.live, "the requests no longer live")
    finally:
        call.cancel()
        await channel.close()
        await server.stop(None)
