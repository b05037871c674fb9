"""The worker over real gRPC on loopback, serving the seeded random tiny Llama."""

from __future__ import annotations

import threading
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairshare.v1 import worker_pb2, worker_pb2_grpc
from tests.support.auth import signed
from tests.conftest import start_worker, stop_worker
from tests.support.control_client import WorkerControl
from tests.support.waits import join_all, wait_for


def stub_for(addr):
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(addr))


def gen_request(tenant, prompt, max_tokens=16, weight=1.0, **sampling):
    return worker_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        tenant=worker_pb2.Tenant(id=tenant, weight=weight, tier=worker_pb2.TIER_INTERACTIVE),
        prompt_token_ids=prompt,
        sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=sampling.pop("temperature", 0.0),
                                           ignore_eos=sampling.pop("ignore_eos", True), **sampling),
    )


def abort_req(request_id: str) -> worker_pb2.AbortRequest:
    return worker_pb2.AbortRequest(request_id=request_id)


def collect(stub, req):
    tokens, text, last = [], "", None
    for msg in stub.Generate(req, metadata=signed(req)):
        tokens += list(msg.token_ids)
        text += msg.text_delta
        last = msg
    return tokens, text, last


def wait_load(stub, cond, what: str, timeout_s: float = 120.0):
    """GetLoad until `cond(load)` holds; returns that load (AssertionError naming `what`, and the last
    GetLoad, when it never does)."""
    last = []

    def probe():
        last[:] = [stub.GetLoad(worker_pb2.GetLoadRequest())]
        return last[0] if cond(last[0]) else None

    return wait_for(probe, lambda: f"{what}; last GetLoad: {last[0] if last else None}", timeout_s)


def wait_idle(stub, timeout_s=120.0):
    """GetLoad once nothing is waiting or running and every KV block is free."""
    return wait_load(stub, lambda ld: not (ld.running or ld.waiting or ld.kv_blocks_used),
                     "worker idle (nothing waiting or running, every KV block free)", timeout_s)


def test_health_and_model_info(worker_addr):
    channel = grpc.insecure_channel(worker_addr)
    health = health_pb2_grpc.HealthStub(channel)
    for svc in ("", "fairshare.v1.Worker"):
        assert health.Check(health_pb2.HealthCheckRequest(service=svc)).status == health_pb2.HealthCheckResponse.SERVING
    info = worker_pb2_grpc.WorkerStub(channel).GetModelInfo(worker_pb2.GetModelInfoRequest())
    assert info.model_name == "random-tiny"
    assert info.max_context_tokens > 0 and info.tokenizer_json.startswith("{") and info.chat_template
    assert len(info.tokenizer_sha256) == 64 and info.eos_token_ids
    assert info.generate_many  # the gateway sends its requests on one GenerateMany stream


async def test_generate_many_runs_each_open_as_generate_does(worker_addr):
    """On one GenerateMany stream (the gateway's client, gateway/worker_stream.py) the real worker
    streams each request's own tokens with exact usage, refuses an unsigned or invalid one with the
    status Generate gives it, without touching the others, and frees every KV block."""
    import asyncio

    from gateway.worker_stream import GenerateStream

    channel = grpc.aio.insecure_channel(worker_addr)
    stream = GenerateStream(worker_pb2_grpc.WorkerStub(channel))
    try:
        reqs = [gen_request(f"t{i % 3}", [5 + i, 6, 7, 8], max_tokens=3 + i) for i in range(6)]
        calls = [stream.generate(r, metadata=signed(r), timeout=120) for r in reqs]
        unsigned = gen_request("t0", [1, 2, 3])
        invalid = gen_request("t0", [])
        refused = [stream.generate(unsigned, timeout=120), stream.generate(invalid, metadata=signed(invalid))]

        async def drain(call):
            return [m async for m in call]

        for i, msgs in enumerate(await asyncio.gather(*map(drain, calls))):
            assert sum(len(m.token_ids) for m in msgs) == 3 + i
            assert msgs[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
            assert msgs[-1].usage.prompt_tokens == 4 and msgs[-1].usage.completion_tokens == 3 + i
        for call, code in zip(refused, (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await drain(call)
            assert err.value.code() == code, err.value
    finally:
        await stream.close()
        await channel.close()
    assert wait_idle(stub_for(worker_addr)).kv_blocks_used == 0


def test_two_tenants_stream_concurrently_with_correct_usage(worker_addr):
    stub = stub_for(worker_addr)
    results = {}

    def run(name, tenant, prompt, n):
        results[name] = collect(stub, gen_request(tenant, prompt, max_tokens=n))

    threads = [threading.Thread(target=run, args=(f"{t}{i}", t, list(range(100 + i, 140 + 3 * i)), 12 + i))
               for t in ("acme", "globex") for i in range(3)]
    for th in threads:
        th.start()
    join_all(threads, "six concurrent streams")
    assert len(results) == 6
    for name, (tokens, text, last) in results.items():
        i = int(name[-1])
        assert last.finish_reason == worker_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == 40 + 2 * i
        assert last.usage.completion_tokens == len(tokens) == 12 + i
        assert last.timings.first_token_s >= last.timings.queued_s >= 0
    load = wait_idle(stub)
    by_tenant = {t.tenant_id: t for t in load.tenants}
    assert by_tenant["acme"].finished >= 3 and by_tenant["globex"].finished >= 3
    assert load.kv_blocks_used == 0


def test_greedy_is_deterministic_and_seed_is_honoured(worker_addr):
    stub = stub_for(worker_addr)
    prompt = list(range(500, 530))
    a = collect(stub, gen_request("acme", prompt, 10))[0]
    b = collect(stub, gen_request("acme", prompt, 10))[0]
    assert a == b
    s1 = collect(stub, gen_request("acme", prompt, 10, temperature=1.0, seed=7))[0]
    s2 = collect(stub, gen_request("acme", prompt, 10, temperature=1.0, seed=7))[0]
    s3 = collect(stub, gen_request("acme", prompt, 10, temperature=1.0, seed=8))[0]
    assert s1 == s2 and s1 != s3


def test_cancelled_stream_and_abort_rpc_free_every_kv_block(worker_addr, control):
    """The engine is held right after the request's 2nd (then 1st) token, so it is still generating
    when the stream is cancelled (or Abort is called) however fast the machine: the abort is carried
    out without another iteration and frees every block."""
    stub = stub_for(worker_addr)
    assert wait_idle(stub).kv_blocks_used == 0
    # 1) the client cancels the stream mid-generation
    req = gen_request("cancel-t", list(range(1, 300)), max_tokens=5000)
    control.hold_when("token", tenant="cancel-t", count=2)
    call = stub.Generate(req, metadata=signed(req))
    next(call)
    next(call)
    wait_for(lambda: control.state()["held"], "engine held after cancel-t's 2nd token")
    load = stub.GetLoad(worker_pb2.GetLoadRequest())
    assert load.running == 1 and load.kv_blocks_used > 0
    call.cancel()
    assert wait_idle(stub).kv_blocks_used == 0  # while held: no iteration was needed
    r = control.requests(request_id=req.request_id)[req.request_id]
    assert r.reason == "abort" and len(r.tokens) == 2 and r.tokens_after(r.abort_requested[0]) == 0
    control.release()
    cancelled_id = req.request_id
    # 2) Abort by request id
    req = gen_request("abort-t", list(range(1, 300)), max_tokens=5000)
    control.hold_when("token", tenant="abort-t", count=1)
    call = stub.Generate(req, metadata=signed(req))
    next(call)
    wait_for(lambda: control.state()["held"], "engine held after abort-t's first token")
    assert stub.Abort(abort_req(req.request_id), metadata=signed(abort_req(req.request_id))).found
    last = None
    for msg in call:
        last = msg
    assert last.finish_reason == worker_pb2.FINISH_REASON_ABORT and last.usage.completion_tokens == 1
    assert wait_idle(stub).kv_blocks_used == 0
    # idempotent: a request no longer live is "not found" (the cancelled one above) ...
    assert not stub.Abort(abort_req(cancelled_id), metadata=signed(abort_req(cancelled_id))).found
    # ... and one Abort per request id: a second one, even freshly signed, is refused as a replay
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(abort_req(req.request_id), metadata=signed(abort_req(req.request_id)))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "already used" in err.value.details()


def test_invalid_requests_are_refused_with_invalid_argument(worker_addr):
    stub = stub_for(worker_addr)
    info = stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
    for req in (gen_request("acme", []), gen_request("acme", [1] * info.max_context_tokens),
                gen_request("acme", [10**9]), gen_request("", [1, 2, 3])):
        with pytest.raises(grpc.RpcError) as err:
            collect(stub, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_idle(stub).kv_blocks_used == 0


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_vtc_serves_second_tenant_before_backlog_fcfs_does_not(policy, tmp_path):
    """Tenant A queues 20 requests; then B sends 2 (max 4 running). Under VTC B's first token comes
    before A's fifth request's first token; under FCFS it does not.

    The engine is held until all 20 of A's requests, in index order, and then both of B's are
    waiting, then released: the scheduler decides with the whole backlog in front of it on any
    machine. The order is read from the worker's own event log (one sequence over every token)."""
    proc, addr = start_worker("--max-running", "4", policy=policy, log_path=tmp_path / "w.log")
    control = WorkerControl(addr)
    try:
        stub = stub_for(addr)
        a = [gen_request("A", list(range(1000 + i, 1032 + i)), max_tokens=16 + 3 * i) for i in range(20)]
        b = [gen_request("B", list(range(2000 + i, 2016 + i)), max_tokens=4) for i in range(2)]
        errors: list[BaseException] = []

        def run(req):
            try:
                collect(stub, req)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = []
        with control.held():
            for n, req in enumerate(a + b, start=1):  # each one waiting before the next is sent
                threads.append(threading.Thread(target=run, args=(req,)))
                threads[-1].start()
                wait_load(stub, lambda ld, n=n: ld.waiting == n and ld.running == 0, f"{n} requests waiting")
        join_all(threads, "22 streams")
        assert not errors, errors
        log = control.requests()
        first = {req.request_id: log[req.request_id].first_token[0] for req in a + b}
        b_first = min(first[req.request_id] for req in b)
        a_fifth = sorted(first[req.request_id] for req in a)[4]
        assert all(log[req.request_id].reason == "length" for req in a + b)
        if policy == "vtc":
            assert b_first < a_fifth
        else:
            assert b_first > a_fifth
    finally:
        control.close()
        stop_worker(proc)
