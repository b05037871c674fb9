"""The test worker's control service (tests/support/worker_control.py) does what the other tests rely
on, over real gRPC against the session's test worker; and the worker itself injects no fault on any
request field (what `cache_salt: "fault:..."` once did)."""

from __future__ import annotations

import threading

import grpc
import pytest

from fairshare.v1 import worker_pb2
from tests.support.auth import signed
from tests.integration.test_worker_grpc import collect, gen_request, stub_for, wait_idle, wait_load
from tests.support.waits import join_all, wait_for


def test_hold_keeps_requests_waiting_then_release_runs_them(worker_addr, control):
    stub = stub_for(worker_addr)
    reqs = [gen_request("ctl-hold", list(range(10 + i, 30 + i)), max_tokens=3) for i in range(3)]
    results = {}
    threads = [threading.Thread(target=lambda r=r: results.update({r.request_id: collect(stub, r)})) for r in reqs]
    with control.held():
        for t in threads:
            t.start()
        wait_load(stub, lambda ld: ld.waiting == 3 and ld.running == 0, "3 requests waiting while held")
        assert not any(e["kind"] in ("admit", "token") for e in control.events(tenant="ctl-hold"))
    join_all(threads, "the held requests")
    assert all(results[r.request_id][2].finish_reason == worker_pb2.FINISH_REASON_LENGTH for r in reqs)
    log = control.requests(tenant="ctl-hold")
    for r in reqs:
        ev = log[r.request_id]
        assert ev.arrival[0] < ev.admit[0] < ev.tokens[0][0] <= ev.tokens[-1][0] < ev.finish[0]
        assert len(ev.tokens) == 3 and ev.reason == "length"
    held = [e for e in control.events() if e["kind"] in ("held", "released")]
    assert [e["kind"] for e in held][-2:] == ["held", "released"]
    assert held[-1]["seq"] < min(log[r.request_id].admit[0] for r in reqs)  # nothing ran before the release


def test_hold_when_stops_at_an_exact_token_count(worker_addr, control):
    stub = stub_for(worker_addr)
    control.hold()
    reqs = [gen_request("ctl-exact", list(range(40 + i, 60 + i)), max_tokens=50) for i in range(2)]
    calls = [stub.Generate(r, metadata=signed(r)) for r in reqs]

    def drain(call) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:  # cancelled below
            assert exc.code() == grpc.StatusCode.CANCELLED

    threads = [threading.Thread(target=drain, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    control.run_until_tokens("ctl-exact", requests=2, tokens=5)
    log = control.requests(tenant="ctl-exact")
    assert [len(log[r.request_id].tokens) for r in reqs] == [5, 5]
    assert stub.GetLoad(worker_pb2.GetLoadRequest()).running == 2
    for c in calls:
        c.cancel()
    assert wait_idle(stub).kv_blocks_used == 0  # aborted while held
    assert all(control.requests(tenant="ctl-exact")[r.request_id].reason == "abort" for r in reqs)
    join_all(threads, "the cancelled streams")


def test_forward_error_fails_the_batch_through_the_engine(worker_addr, control):
    stub = stub_for(worker_addr)
    control.inject("forward_error", tenant="ctl-fwd", after=2)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, gen_request("ctl-fwd", list(range(70, 90)), max_tokens=20))
    assert err.value.code() == grpc.StatusCode.INTERNAL and "model forward failed" in err.value.details()
    (r,) = control.requests(tenant="ctl-fwd").values()
    assert len(r.tokens) == 2 and r.reason == "abort"
    assert control.state()["forward_faults"] == 0  # used once
    assert collect(stub, gen_request("ctl-fwd", list(range(70, 90)), max_tokens=4))[2].usage.completion_tokens == 4


def test_forward_error_on_the_nth_forward_from_now(worker_addr, control):
    stub = stub_for(worker_addr)
    wait_idle(stub)
    control.inject("forward_error", nth=3)  # prefill (1st forward, 1st token), one decode, then the failure
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, gen_request("ctl-nth", list(range(300, 320)), max_tokens=10))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    (r,) = control.requests(tenant="ctl-nth").values()
    assert len(r.tokens) == 2 and r.reason == "abort"


@pytest.mark.parametrize("kind,after", [("reject", 0), ("error_after", 2)])
def test_servicer_faults_match_tenant_and_prompt(worker_addr, control, kind, after):
    stub = stub_for(worker_addr)
    control.inject(kind, tenant="ctl-svc", after=after, times=1)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, gen_request("ctl-svc", list(range(100, 120)), max_tokens=10))
    want = grpc.StatusCode.INVALID_ARGUMENT if kind == "reject" else grpc.StatusCode.INTERNAL
    assert err.value.code() == want and "injected test fault" in err.value.details()
    # `times=1`: the next request of the tenant is served normally
    assert collect(stub, gen_request("ctl-svc", list(range(100, 120)), max_tokens=3))[2].usage.completion_tokens == 3
    wait_idle(stub)


def test_no_request_field_injects_a_fault(worker_addr, control):
    """The salts that used to trigger faults (worker/server.py before issue #19) are ordinary salts."""
    stub = stub_for(worker_addr)
    for salt in ("fault:reject", "fault:error-after:0", "fault:error-after:1"):
        req = gen_request("ctl-salt", list(range(200, 220)), max_tokens=4)
        req.cache_salt = salt
        tokens, _, last = collect(stub, req)
        assert len(tokens) == 4 and last.finish_reason == worker_pb2.FINISH_REASON_LENGTH
    wait_for(lambda: not control.state()["held"], "engine not held")
