"""Worker authentication on the reference worker, over real gRPC (fairshare/worker_auth.py).

A raw gRPC client that reaches the worker's port is not the gateway: without a token, with a forged
one, with one of an unknown key, with a real token moved to another identity (another tenant, a
bigger weight), with an expired one, with a garbled one, and replaying a used one, its Generate is
refused with UNAUTHENTICATED before the engine sees it (the engine's own event log has no arrival
of it, GetLoad no tenant of it), each refusal counted in ``fairshare_worker_auth_failures_total``.
Keys rotate without a restart: the worker re-reads its keys file.
"""

from __future__ import annotations

import os
import time

import grpc
import httpx
import pytest

from fairshare import worker_auth
from fairshare.ports import free_port
from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from tests.conftest import start_worker, stop_worker
from tests.support.auth import forged_calls, signed
from tests.support.control_client import WorkerControl
from tests.support.waits import wait_for


def make_request(rid: str, tenant: str, weight: float) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"{rid}-{time.monotonic_ns()}", prompt_token_ids=[11, 12, 13, 14],
                              tenant=pb.Tenant(id=tenant, weight=weight, tier=pb.TIER_INTERACTIVE),
                              sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))


@pytest.fixture(scope="module")
def keyed_worker(tmp_path_factory):
    """A test worker reading its keys from a file (the tests' key at first), with a metrics port."""
    d = tmp_path_factory.mktemp("auth")
    keys = d / "worker-keys"
    keys.write_text(os.environ[worker_auth.KEYS_ENV] + "\n")
    mport = free_port()
    proc, addr = start_worker("--worker-keys-file", str(keys), "--metrics-port", str(mport), "--threads", "1",
                              log_path=d / "worker.log")
    yield addr, keys, f"http://127.0.0.1:{mport}/metrics"
    stop_worker(proc)


def refusals(metrics_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("fairshare_worker_auth_failures_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def call(stub, req, metadata) -> list[pb.GenerateResponse]:
    return list(stub.Generate(req, metadata=metadata, timeout=60))


def test_calls_not_signed_by_the_gateway_are_unauthenticated_and_never_scheduled(keyed_worker):
    addr, _, metrics_url = keyed_worker
    control = WorkerControl(addr)
    control.reset()
    before = refusals(metrics_url)
    with grpc.insecure_channel(addr) as ch:
        stub = pb_grpc.WorkerStub(ch)
        cases = forged_calls(make_request)
        for case, reason, req, md in cases:
            with pytest.raises(grpc.RpcError) as err:
                call(stub, req, md)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (case, err.value)
        # a replay: the gateway's real call, captured and sent again
        honest = make_request("auth-replay", "victim", 1.0)
        md = signed(honest)
        assert call(stub, honest, md)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        with pytest.raises(grpc.RpcError) as err:
            call(stub, honest, md)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "already used" in err.value.details()
        # Abort needs the gateway's token too
        with pytest.raises(grpc.RpcError) as err:
            stub.Abort(pb.AbortRequest(request_id=honest.request_id), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)  # load and model info stay open
    # nothing scheduled: the engine saw exactly one request, the honest one, once
    arrivals = [e["request_id"] for e in control.events() if e["kind"] == "arrival"]
    assert arrivals == [honest.request_id]
    assert {t.tenant_id for t in load.tenants} == {"victim"}
    after = refusals(metrics_url)
    expected = {r: 0 for r in worker_auth.REASONS}
    for _, reason, _, _ in cases:
        expected[reason] += 1
    expected["missing"] += 1  # the unsigned Abort
    expected["replayed"] += 1
    assert {r: after[r] - before.get(r, 0) for r in worker_auth.REASONS} == expected
    control.close()


def test_keys_rotate_without_a_restart(keyed_worker):
    """Add a second key to the file: both are accepted. Remove the first: its tokens are refused
    (unknown key) while the new key's go on being accepted; the worker never restarted."""
    addr, keys, metrics_url = keyed_worker
    old_text = keys.read_text()
    new_key = worker_auth.WorkerKeys.parse("next-key:" + "7f" * 24)
    new = worker_auth.Signer(new_key)
    old = worker_auth.Signer(worker_auth.WorkerKeys.parse(os.environ[worker_auth.KEYS_ENV]))

    def accepted(signer) -> bool:
        req = make_request("rotate", "rotating", 1.0)
        try:
            with grpc.insecure_channel(addr) as ch:
                call(pb_grpc.WorkerStub(ch), req, signer.metadata(worker_auth.generate_claims(req)))
            return True
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            return False

    try:
        assert accepted(old) and not accepted(new)
        keys.write_text(old_text + "next-key:" + "7f" * 24 + "\n")  # step 1: the new key accepted too
        wait_for(lambda: accepted(new), "the worker accepts the new key (keys file re-read)")
        assert accepted(old)
        keys.write_text("next-key:" + "7f" * 24 + "\n")  # step 3: the old key removed
        wait_for(lambda: not accepted(old), "the worker refuses the removed key")
        assert accepted(new)
        assert refusals(metrics_url)["unknown_key"] >= 2
    finally:
        keys.write_text(old_text)
        wait_for(lambda: accepted(old), "the worker accepts the tests' key again")
