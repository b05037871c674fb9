"""The worker over real gRPC on loopback, serving the seeded random tiny Llama."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairshare.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import start_worker


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


def collect(stub, req):
    tokens, text, last = [], "", None
    for msg in stub.Generate(req):
        tokens += list(msg.token_ids)
        text += msg.text_delta
        last = msg
    return tokens, text, last


def wait_idle(stub, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    load = stub.GetLoad(worker_pb2.GetLoadRequest())
    while (load.running or load.waiting or load.kv_blocks_used) and time.monotonic() < deadline:
        time.sleep(0.05)
        load = stub.GetLoad(worker_pb2.GetLoadRequest())
    return load


def test_health_and_model_info(worker_addr):
    channel = grpc.insecure_channel(worker_addr)
    health = health_pb2_grpc.HealthStub(channel)
    for svc in ("", "fairshare.v1.Worker"):
        assert health.Check(health_pb2.HealthCheckRequest(service=svc)).status == health_pb2.HealthCheckResponse.SERVING
    info = worker_pb2_grpc.WorkerStub(channel).GetModelInfo(worker_pb2.GetModelInfoRequest())
    assert info.model_name == "random-tiny"
    assert info.max_context_tokens > 0 and info.tokenizer_json.startswith("{") and info.chat_template
    assert len(info.tokenizer_sha256) == 64 and info.eos_token_ids


def test_two_tenants_stream_concurrently_with_correct_usage(worker_addr):
    stub = stub_for(worker_addr)
    results = {}

    def run(name, tenant, prompt, n):
        results[name] = collect(stub, gen_request(tenant, prompt, max_tokens=n))

    threads = [threading.Thread(target=run, args=(f"{t}{i}", t, list(range(100 + i, 140 + 3 * i)), 12 + i))
               for t in ("acme", "globex") for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
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


def test_cancelled_stream_and_abort_rpc_free_every_kv_block(worker_addr):
    stub = stub_for(worker_addr)
    idle = wait_idle(stub).kv_blocks_used
    assert idle == 0
    # 1) the client cancels the stream mid-generation
    call = stub.Generate(gen_request("acme", list(range(1, 300)), max_tokens=5000))
    next(call)
    next(call)
    assert stub.GetLoad(worker_pb2.GetLoadRequest()).kv_blocks_used > 0
    call.cancel()
    assert wait_idle(stub).kv_blocks_used == idle
    # 2) Abort by request id
    req = gen_request("globex", list(range(1, 300)), max_tokens=5000)
    call = stub.Generate(req)
    next(call)
    assert stub.Abort(worker_pb2.AbortRequest(request_id=req.request_id)).found
    last = None
    for msg in call:
        last = msg
    assert last.finish_reason == worker_pb2.FINISH_REASON_ABORT
    assert wait_idle(stub).kv_blocks_used == idle
    assert not stub.Abort(worker_pb2.AbortRequest(request_id=req.request_id)).found


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
    """Tenant A queues 20 requests; then B sends 2. Under VTC B's first token comes before A's
    fifth request starts; under FCFS it does not."""
    proc, addr = start_worker("--max-running", "4", policy=policy, log_path=tmp_path / "w.log")
    try:
        stub = stub_for(addr)
        first_token_at: dict[str, float] = {}

        def run(name, tenant, prompt, n):
            for msg in stub.Generate(gen_request(tenant, prompt, max_tokens=n)):
                if msg.token_ids and name not in first_token_at:
                    first_token_at[name] = time.monotonic()

        threads = []
        for i in range(20):
            th = threading.Thread(target=run, args=(f"A{i}", "A", list(range(1000 + i, 1032 + i)), 16 + 3 * i))
            th.start()
            threads.append(th)
            time.sleep(0.01)  # A's requests arrive in index order
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            load = stub.GetLoad(worker_pb2.GetLoadRequest())
            if load.waiting + load.running >= 20:
                break
            time.sleep(0.01)
        for i in range(2):
            th = threading.Thread(target=run, args=(f"B{i}", "B", list(range(2000 + i, 2016 + i)), 4))
            th.start()
            threads.append(th)
        for th in threads:
            th.join(120)
        assert len(first_token_at) == 22
        b_first = min(first_token_at["B0"], first_token_at["B1"])
        a_fifth = sorted(first_token_at[f"A{i}"] for i in range(20))[4]
        if policy == "vtc":
            assert b_first < a_fifth
        else:
            assert b_first > a_fifth
    finally:
        proc.terminate()
        proc.wait(20)
