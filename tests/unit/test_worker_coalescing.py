"""The worker's Generate stream coalesces: outputs the engine produced while the stream was not
reading go out in one message, with one logprob entry per token (worker/server.py).

The engine is the real one (random tiny Llama) stepped by hand, so the state "the engine ran ahead
of the stream" is reached by construction: the test steps it to the end of the request before it
reads the stream's next message.
"""

from __future__ import annotations

import asyncio

import pytest

from fairshare.v1 import worker_pb2
from worker.engine.engine import Engine, EngineConfig
from worker.models import load_model
from tests.support.waits import wait_for_async
from worker.server import WorkerServicer


class Context:
    """What Generate uses of a grpc.aio servicer context."""

    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, md):
        pass

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


@pytest.fixture(scope="module")
def model():
    return load_model("random-tiny", progress=False)


def request(rid: str, max_tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid, tenant=worker_pb2.Tenant(id="t", weight=1.0, tier=worker_pb2.TIER_INTERACTIVE),
        prompt_token_ids=[1, 2, 3, 4, 5],
        sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True,
                                           top_logprobs=2))


def run_to_idle(engine: Engine) -> int:
    steps = 0
    while engine.step():
        steps += 1
        assert steps < 1000, "the engine never went idle"
    return steps


async def open_stream(model, rid: str, max_tokens: int):
    """(engine, stream, its first message pending) once the request waits in the (unstarted) engine."""
    engine = Engine(model, EngineConfig(num_kv_blocks=64, max_running=4))
    servicer = WorkerServicer(engine, "random-tiny")
    stream = servicer.Generate(request(rid, max_tokens), Context())
    first = asyncio.ensure_future(stream.__anext__())
    await wait_for_async(lambda: rid in servicer.live, "the request registered with the engine")
    return engine, stream, first


async def test_outputs_ready_together_are_one_message_with_per_token_logprobs(model):
    engine, stream, first = await open_stream(model, "r1", 8)
    steps = run_to_idle(engine)  # every output of the request is queued before the stream reads one
    assert steps >= 8  # prefill, then one decode step per further token: 8 outputs in all
    msg = await first
    assert len(msg.token_ids) == 8 and msg.finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert msg.usage.completion_tokens == 8 and msg.usage.prompt_tokens == 5
    assert [lp.token_id for lp in msg.logprobs] == list(msg.token_ids)
    assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in msg.logprobs)
    assert msg.timings.first_token_s > 0
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_a_stream_that_keeps_up_gets_one_message_per_iteration(model):
    engine, stream, pending = await open_stream(model, "r2", 4)
    messages = []
    while True:
        assert engine.step(), "the engine went idle before the request finished"
        messages.append(await pending)  # read before the next iteration runs
        if messages[-1].finish_reason:
            break
        pending = asyncio.ensure_future(stream.__anext__())
    assert [len(m.token_ids) for m in messages] == [1, 1, 1, 1]
    assert all(len(m.logprobs) == 1 for m in messages)
