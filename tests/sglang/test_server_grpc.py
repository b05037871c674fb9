"""The SGLang worker's gRPC servicer over a stand-in engine (no GPU): streaming, usage with cached
tokens, abort by RPC and by cancelling the stream, validation errors, GetModelInfo / GetLoad.

The stand-in `tokenizer_manager.generate_request` behaves like SGLang 0.5.23's for a streaming
request with `skip_tokenizer_init`: cumulative `output_ids` (or only the new ids when
`incremental_streaming_output`), `meta_info` with `finish_reason`, `prompt_tokens`,
`completion_tokens`, `cached_tokens`; `abort_request(rid=...)` ends the stream with an abort.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fairshare.v1 import worker_pb2, worker_pb2_grpc
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


async def _serve(engine):
    server = grpc.aio.server()
    servicer = ss.SGLangWorkerServicer(engine, FACTS, "sec", "vtc", request_factory=dict)
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
        msgs = [m async for m in stub.Generate(_request(max_tokens=4))]
        tokens = [t for m in msgs for t in m.token_ids]
        assert tokens == [10, 11, 12, 13]
        final = msgs[-1]
        assert final.finish_reason == worker_pb2.FINISH_REASON_LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens) == (5, 4, 2)
        assert msgs[0].timings.queued_s == pytest.approx(0.005) and final.timings.first_token_s > 0
        sent = engine.tokenizer_manager.requests[0]
        assert sent["extra_key"] == tn.extra_key_for("acme", "", "sec") and sent["rid"] == ss.sglang_rid("r1")
        assert tn.verify(sent["sampling_params"]["custom_params"][tn.CUSTOM_PARAM_KEY], "sec").tenant_id == "acme"
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
        call = stub.Generate(_request("r-abort", max_tokens=100))
        first = await call.read()
        assert list(first.token_ids) == [10]
        resp = await stub.Abort(worker_pb2.AbortRequest(request_id="r-abort"))
        assert resp.found and engine.tokenizer_manager.aborted == [ss.sglang_rid("r-abort")]
        rest = []
        while (m := await call.read()) is not grpc.aio.EOF:
            rest.append(m)
        assert rest[-1].finish_reason == worker_pb2.FINISH_REASON_ABORT
        assert not (await stub.Abort(worker_pb2.AbortRequest(request_id="r-abort"))).found

        call2 = stub.Generate(_request("r-cancel", max_tokens=100))
        await call2.read()
        call2.cancel()                                   # the gateway went away
        await wait_for_async(lambda: ss.sglang_rid("r-cancel") in engine.tokenizer_manager.aborted,
                             "the cancelled stream aborted in SGLang")
        await wait_for_async(lambda: "r-cancel" not in servicer.live, "the cancelled request no longer live")
    finally:
        await channel.close()
        await server.stop(None)


async def test_invalid_requests_rejected():
    server, channel, stub, _ = await _serve(FakeEngine())
    try:
        for bad in (_request(prompt=()), _request(prompt=[5] * 128), _request(prompt=[1000])):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(bad)]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_grammar_sglang_cannot_compile_is_invalid_argument_naming_the_grammar():
    server, channel, stub, servicer = await _serve(FakeEngine())
    try:
        req = _request("r-grammar")
        req.sampling.grammar.regex = "(["
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in stub.Generate(req)]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "compile" in err.value.details()
        assert dict(err.value.trailing_metadata())["fairshare-invalid"] == "grammar"
        assert "r-grammar" not in servicer.live
    finally:
        await channel.close()
        await server.stop(None)
