"""GenerateMany (worker/multiplex.py, gateway/worker_stream.py): many generations on one gRPC stream
behave as one Generate call each — messages in order, per-generation status with trailing metadata,
cancellation and deadlines reaching the handler, the stream's failure failing its generations and
the next request reopening it, a drained stream ending once idle.

Real gRPC over loopback. The worker is a scripted ``Generate`` handler: what a real worker's
Generate does is tested elsewhere (test_worker_grpc, the e2e tests run through this path); here the
stream around it is under test.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from gateway.worker_stream import GenerateStream, StreamedGenerate
from worker.multiplex import GenerateManyMixin
from tests.support.waits import wait_for_async

CEILING_S = 60.0  # against a hang only


class ScriptedWorker(pb_grpc.WorkerServicer):
    """Generate by the prompt's first token id: 1 = answer `prompt[1]` messages of one token each,
    2 = abort INVALID_ARGUMENT with trailing metadata, 3 = hold until cancelled (records it), 4 = raise,
    5 = answer the invocation metadata's keys as text, 6 = hold until `release` is set, then answer one
    message, 7 = answer `prompt[1]` messages of `prompt[2]` bytes of text each, all at once."""

    def __init__(self) -> None:
        self.generate_calls = 0
        self.many_calls = 0
        self.many_ended = 0
        self.in_sizes: list[int] = []
        self.out_sizes: list[int] = []
        self.holding: set[str] = set()
        self.cancelled: set[str] = set()
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        self.generate_calls += 1
        kind, *args = request.prompt_token_ids
        if kind == 1:
            for i in range(args[0]):
                yield pb.GenerateResponse(token_ids=[i], text_delta=f"{request.request_id}:{i} ")
            yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=args[0]))
        elif kind == 2:
            context.set_trailing_metadata((("fairshare-invalid", "grammar"),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no output satisfies this grammar")
        elif kind == 3:
            self.holding.add(request.request_id)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.add(request.request_id)
                raise
        elif kind == 4:
            raise RuntimeError("scripted failure")
        elif kind == 6:
            self.holding.add(request.request_id)
            await self.release.wait()
            yield pb.GenerateResponse(text_delta="released", finish_reason=pb.FINISH_REASON_STOP)
        elif kind == 7:
            for i in range(args[0]):
                yield pb.GenerateResponse(token_ids=[i], text_delta=f"{i:04d}" + "x" * (args[1] - 4))
            yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=args[0]))
        elif kind == 5:
            keys = sorted(k for k, _ in context.invocation_metadata())
            yield pb.GenerateResponse(text_delta=",".join(keys), finish_reason=pb.FINISH_REASON_STOP)


class ManyWorker(GenerateManyMixin, ScriptedWorker):
    async def GenerateMany(self, request_iterator, context):
        self.many_calls += 1

        async def counted():  # the size of every message the gateway sent, in bytes
            async for msg in request_iterator:
                self.in_sizes.append(msg.ByteSize())
                yield msg
        try:
            async for out in super().GenerateMany(counted(), context):
                self.out_sizes.append(out.ByteSize())  # the size of every message sent back, in bytes
                yield out
        finally:
            self.many_ended += 1


async def _serve(servicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


@pytest.fixture
async def many():
    servicer = ManyWorker()
    server, port = await _serve(servicer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = GenerateStream(pb_grpc.WorkerStub(channel))
    yield servicer, stream, server, port, channel
    await stream.close()
    await channel.close()
    await server.stop(0)


def _req(rid: str, *prompt: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, tenant=pb.Tenant(id="t"), prompt_token_ids=list(prompt))


async def _drain(call) -> list[pb.GenerateResponse]:
    return [m async for m in call]


async def test_many_generations_share_one_stream_each_in_order(many):
    servicer, stream, *_ = many
    calls = [stream.generate(_req(f"r{i}", 1, 3 + i % 4)) for i in range(24)]
    assert all(isinstance(c, StreamedGenerate) for c in calls)
    answers = await asyncio.wait_for(asyncio.gather(*map(_drain, calls)), CEILING_S)
    for i, msgs in enumerate(answers):
        n = 3 + i % 4
        assert [m.text_delta for m in msgs[:-1]] == [f"r{i}:{k} " for k in range(n)]
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == n
        assert calls[i].done() and not calls[i].cancelled()
    assert servicer.many_calls == 1 and servicer.generate_calls == 24


async def test_an_abort_ends_only_its_generation_with_its_status_and_trailing_metadata(many):
    servicer, stream, *_ = many
    bad = stream.generate(_req("bad", 2))
    good = stream.generate(_req("good", 1, 2))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(_drain(bad), CEILING_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "no output satisfies this grammar"
    assert dict(err.value.trailing_metadata()) == {"fairshare-invalid": "grammar"}
    assert len(await asyncio.wait_for(_drain(good), CEILING_S)) == 3
    crash = stream.generate(_req("crash", 4))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(_drain(crash), CEILING_S)
    assert err.value.code() == grpc.StatusCode.UNKNOWN and "scripted failure" in err.value.details()
    assert servicer.many_calls == 1


async def test_cancel_reaches_the_handler_and_the_stream_stays_usable(many):
    servicer, stream, *_ = many
    held = stream.generate(_req("held", 3))
    waiting = asyncio.ensure_future(_drain(held))
    await wait_for_async(lambda: "held" in servicer.holding, "the held generation reached the handler",
                         timeout_s=CEILING_S)
    assert held.cancel() and held.cancelled() and held.done()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await wait_for_async(lambda: "held" in servicer.cancelled, "the handler saw the cancel", timeout_s=CEILING_S)
    assert not held.cancel()  # already ended
    assert len(await asyncio.wait_for(_drain(stream.generate(_req("after", 1, 1))), CEILING_S)) == 2
    assert servicer.many_calls == 1


async def test_a_deadline_fails_the_generation_and_cancels_its_handler(many):
    servicer, stream, *_ = many
    late = stream.generate(_req("late", 3), timeout=0.2)  # held until cancelled: only the deadline ends it
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(_drain(late), CEILING_S)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for_async(lambda: "late" in servicer.cancelled, "the handler was cancelled at the deadline",
                         timeout_s=CEILING_S)


async def test_the_call_metadata_reaches_the_handler(many):
    _, stream, *_ = many
    msgs = await asyncio.wait_for(_drain(stream.generate(_req("md", 5), metadata=[("fairshare-auth", "tok"),
                                                                                  ("traceparent", "00-x")])),
                                  CEILING_S)
    assert msgs[0].text_delta == "fairshare-auth,traceparent"


async def test_a_duplicate_request_id_is_refused_without_touching_the_first(many):
    servicer, stream, *_ = many
    first = stream.generate(_req("dup", 6))
    await wait_for_async(lambda: "dup" in servicer.holding, "the first generation reached the handler",
                         timeout_s=CEILING_S)
    second = stream.generate(_req("dup", 1, 1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(_drain(second), CEILING_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not first.done()
    servicer.release.set()
    assert [m.text_delta for m in await asyncio.wait_for(_drain(first), CEILING_S)] == ["released"]


async def test_a_stopped_worker_fails_its_generations_and_the_next_request_reopens_the_stream(many):
    servicer, stream, server, port, channel = many
    held = [stream.generate(_req(f"h{i}", 3)) for i in range(3)]
    await wait_for_async(lambda: len(servicer.holding) == 3, "three generations held on the worker",
                         timeout_s=CEILING_S)
    await server.stop(0)
    for call in held:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(_drain(call), CEILING_S)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    again = ManyWorker()
    server2, _ = await _serve(again, port)
    try:
        await asyncio.wait_for(channel.channel_ready(), CEILING_S)  # the channel reconnected
        msgs = await asyncio.wait_for(_drain(stream.generate(_req("again", 1, 2))), CEILING_S)
        assert len(msgs) == 3 and again.many_calls == 1
    finally:
        await server2.stop(0)


async def test_draining_ends_the_stream_once_nothing_runs_on_it(many):
    servicer, stream, *_ = many
    held = stream.generate(_req("held", 3))
    await wait_for_async(lambda: "held" in servicer.holding, "the held generation reached the handler",
                         timeout_s=CEILING_S)
    servicer.end_generate_many()
    done = stream.generate(_req("still-served", 1, 1))  # the stream is still up while something runs
    assert len(await asyncio.wait_for(_drain(done), CEILING_S)) == 2
    assert servicer.many_ended == 0 and not held.done()
    held.cancel()
    await wait_for_async(lambda: servicer.many_ended == 1, "the drained stream ended once idle", timeout_s=CEILING_S)


async def test_the_gateway_uses_the_stream_with_the_workers_that_say_they_serve_it():
    from opentelemetry import trace

    from gateway.routing import WorkerClient, _call_worker

    servicer = ManyWorker()
    server, port = await _serve(servicer)
    w = WorkerClient(f"127.0.0.1:{port}")
    w.connect()
    try:
        for i, flag in enumerate((True, False, True)):
            w.info = pb.ModelInfo(model_name="m", generate_many=flag)
            gen = _call_worker(w, _req(f"g{i}", 1, 1), 0, 10, trace.get_tracer("test"), None, None, None)
            assert isinstance(gen.call, StreamedGenerate) == flag
            assert len(await asyncio.wait_for(_drain(gen.call), CEILING_S)) == 2
            gen.close()
        assert servicer.many_calls == 1 and servicer.generate_calls == 3 and w.local_inflight == 0
    finally:
        await w.close()
        await server.stop(0)


async def test_a_burst_of_long_prompts_is_split_under_the_message_limit(many, monkeypatch):
    import gateway.worker_stream as ws

    servicer, stream, *_ = many
    monkeypatch.setattr(ws, "MAX_MESSAGE_BYTES", 4096)
    calls = [stream.generate(_req(f"long{i}", 1, 1, *range(1000))) for i in range(10)]  # ~2 KB each
    for msgs in await asyncio.wait_for(asyncio.gather(*map(_drain, calls)), CEILING_S):
        assert len(msgs) == 2
    assert servicer.many_calls == 1 and servicer.generate_calls == 10
    one = _req("x", 1, 1, *range(1000)).ByteSize()
    assert len(servicer.in_sizes) >= 10 * one // 4096 and max(servicer.in_sizes) <= 4096 + one, servicer.in_sizes


async def test_events_piled_up_go_back_in_messages_under_the_limit_in_order(many, monkeypatch):
    import worker.multiplex as mx

    servicer, stream, *_ = many
    monkeypatch.setattr(mx, "MAX_MESSAGE_BYTES", 4096)
    calls = [stream.generate(_req(f"big{i}", 7, 12, 1000)) for i in range(3)]  # 12 answers of ~1 KB each
    answers = await asyncio.wait_for(asyncio.gather(*map(_drain, calls)), CEILING_S)
    for msgs in answers:
        assert [m.text_delta[:4] for m in msgs[:-1]] == [f"{i:04d}" for i in range(12)]
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    one = pb.GenerateEvent(request_id="big0", response=pb.GenerateResponse(token_ids=[0], text_delta="x" * 1000))
    # each generation's 12 answers were ready at once: several per message, never past the limit
    assert len(servicer.out_sizes) >= 3 * 12 * one.ByteSize() // 4096, servicer.out_sizes
    assert max(servicer.out_sizes) <= 4096 + 64, servicer.out_sizes
    assert max(servicer.out_sizes) > 2 * one.ByteSize(), servicer.out_sizes


async def test_a_generation_cancelled_before_its_open_is_sent_never_reaches_the_worker(many):
    servicer, stream, *_ = many
    for rid in ("first-use", "later"):  # before the stream exists, and on the open stream
        gone = stream.generate(_req(rid, 3))
        gone.cancel()  # in the same loop iteration: its open is still queued
        assert len(await asyncio.wait_for(_drain(stream.generate(_req(f"after-{rid}", 1, 1))), CEILING_S)) == 2
    assert servicer.generate_calls == 2 and not servicer.holding  # only the two "after" requests ran
    assert servicer.many_calls == 1


async def test_an_open_and_its_cancel_in_one_message_leave_nothing_on_the_worker(many):
    servicer, _, _, _, channel = many
    call = pb_grpc.WorkerStub(channel).GenerateMany()
    await call.write(pb.GenerateManyIn(open=[pb.GenerateOpen(request=_req("both", 3))], cancel=["both"]))
    await call.done_writing()
    # the worker's side ends once the gateway's side is closed and nothing runs: nothing stayed behind
    async def events_until_the_end():
        return [ev async for out in call for ev in out.events]
    events = await asyncio.wait_for(events_until_the_end(), CEILING_S)
    assert await asyncio.wait_for(call.code(), CEILING_S) == grpc.StatusCode.OK
    assert events == [] and servicer.many_ended == 1 and "both" not in servicer.holding
