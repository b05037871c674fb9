"""KV quotas through `fairshare worker --kv-quota ...` over real gRPC on loopback (random tiny Llama):
GetLoad's quota fields and the Prometheus quota series, filled from the engine's state.

The scenario (pool 256 blocks x 16 tokens, flood's soft quota 5% = 12 blocks, watermark 0.5 = 128
blocks): `flood` sends three 1000-token prompts (63 blocks each) with long outputs; two are admitted
(the second bursts, the pool stays under the watermark), the third waits on its quota. Then `victim`
(soft quota: its weight share, 121 blocks) sends a 1900-token prompt (119 blocks) that does not fit
beside the flood: the worker reclaims blocks from the over-quota flood (a reclaim preemption).
"""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest

from fairshare.ports import free_port
from fairshare.v1 import worker_pb2
from tests.support.auth import signed
from tests.conftest import start_worker
from tests.integration.test_worker_grpc import gen_request, stub_for, wait_idle, wait_load
from tests.support.waits import join_all


def _poll(stub, cond, what: str = "quota state"):
    """GetLoad until `cond(load)` holds; returns that load (AssertionError naming `what` if never)."""
    return wait_load(stub, cond, what)


def _tenants(load) -> dict:
    return {t.tenant_id: t for t in load.tenants}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not exposed")


@pytest.fixture(scope="module")
def quota_worker(tmp_path_factory):
    mport = free_port()
    log = tmp_path_factory.mktemp("quota-worker") / "worker.log"
    proc, addr = start_worker("--num-kv-blocks", "256", "--kv-quota", "--kv-watermark", "0.5",
                              "--kv-soft-quota", "flood=0.05", "--kv-hard-cap-for", "flood=0.9",
                              "--kv-hard-cap-for", "batch=0.5", "--metrics-port", str(mport), log_path=log)
    yield addr, mport
    proc.terminate()
    try:
        proc.wait(15)
    except Exception:
        proc.kill()


def test_getload_and_metrics_report_quotas_and_reclaim(quota_worker):
    addr, mport = quota_worker
    stub = stub_for(addr)
    idle = wait_idle(stub)
    assert idle.kv_quota_enabled and idle.kv_blocks_total == 256 and idle.reclaim_preemptions == 0

    calls, results = [], {}

    def run(name, req):
        call = stub.Generate(req, metadata=signed(req))
        calls.append(call)
        try:
            for msg in call:
                if msg.token_ids:
                    results.setdefault(name, "first-token")
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                results[name] = f"error {exc.code()}"

    threads = []
    for i in range(3):
        prompt = [1 + (k * 7 + i) % 500 for k in range(1000)]
        t = threading.Thread(target=run, args=(f"flood{i}", gen_request("flood", prompt, max_tokens=1040)))
        t.start()
        threads.append(t)
        if i < 2:  # admission order: the first two run, the third waits on flood's quota
            _poll(stub, lambda ld, n=i + 1: _tenants(ld).get("flood") is not None and _tenants(ld)["flood"].running == n)
    try:
        load = _poll(stub, lambda ld: _tenants(ld)["flood"].quota_waits > 0)
        flood = _tenants(load)["flood"]
        assert flood.kv_soft_quota_blocks == 12 and flood.kv_hard_cap_blocks == 230  # int(0.05*256), int(0.9*256)
        assert flood.running == 2 and flood.waiting == 1 and flood.kv_over_quota and flood.kv_blocks > 12
        assert load.reclaim_preemptions == 0

        victim_prompt = [1 + (k * 3) % 500 for k in range(1900)]
        vt = threading.Thread(target=run, args=("victim", gen_request("victim", victim_prompt, max_tokens=4)))
        vt.start()
        threads.append(vt)
        load = _poll(stub, lambda ld: ld.reclaim_preemptions >= 1)
        join_all([vt], "the victim's request")
        assert results.get("victim") == "first-token", results
        by = _tenants(stub.GetLoad(worker_pb2.GetLoadRequest()))
        assert by["victim"].kv_soft_quota_blocks == 121  # weight share of 256 * 0.95 between two tenants of w=1
        assert by["victim"].kv_hard_cap_blocks == 256 and by["victim"].preemptions == 0
        assert by["flood"].preemptions >= 1

        text = _scrape(mport)
        assert _value(text, "fairshare_worker_kv_quota_enabled") == 1
        assert _value(text, 'fairshare_worker_preemptions_total{reason="reclaim"}') >= 1
        assert _value(text, 'fairshare_worker_tenant_kv_soft_quota_blocks{tenant="flood"}') == 12
        assert _value(text, 'fairshare_worker_tenant_kv_hard_cap_blocks{tenant="flood"}') == 230
        assert _value(text, 'fairshare_worker_tenant_kv_soft_quota_blocks{tenant="victim"}') == 121
        assert _value(text, 'fairshare_worker_tenant_kv_over_quota{tenant="victim"}') == 0
        assert _value(text, 'fairshare_worker_tenant_quota_waits_total{tenant="flood"}') > 0
    finally:
        for call in calls:
            call.cancel()
        for t in threads:
            t.join(60)
    # cancelling every stream frees every block
    assert wait_idle(stub).kv_blocks_used == 0


def test_worker_without_quotas_reports_them_off(worker_addr):
    stub = stub_for(worker_addr)
    plain = gen_request("plain", [5, 6, 7], max_tokens=2)
    for _ in stub.Generate(plain, metadata=signed(plain)):
        pass
    load = stub.GetLoad(worker_pb2.GetLoadRequest())
    assert not load.kv_quota_enabled and load.reclaim_preemptions == 0
    plain = _tenants(load)["plain"]
    assert (plain.kv_soft_quota_blocks, plain.kv_hard_cap_blocks, plain.kv_over_quota, plain.quota_waits) == (0, 0, False, 0)


def test_preemptions_by_reason_and_quota_gauges_from_the_engine_snapshot():
    """The three preemption reasons add up to the engine's total; quota gauges only with quotas on;
    non-additive quota figures are not reported for the `other` label."""
    from prometheus_client.parser import text_string_to_metric_families

    from worker.metrics import WorkerMetrics

    class Engine:
        def __init__(self, snap):
            self.snap = snap

        def snapshot(self):
            return self.snap

    def tenant(tid, **kw):
        t = {"tenant_id": tid, "weight": 1.0, "virtual_counter": 0.0, "charged_service": 0.0, "prompt_tokens": 0,
             "output_tokens": 0, "waiting": 0, "running": 0, "kv_blocks": 0, "finished": 0, "preemptions": 0,
             "quota_waits": 0}
        t.update(kw)
        return t

    def samples(snap, max_tenants=64):
        out = {}
        for fam in text_string_to_metric_families(WorkerMetrics(Engine(snap), max_tenants=max_tenants).render().decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    base = {"waiting": 0, "running": 0, "kv_blocks_used": 9, "kv_blocks_total": 64, "kv_block_size": 16,
            "policy": "vtc", "iterations": 5, "inflight_tokens": 0, "preemptions": 10, "reclaim_preemptions": 3,
            "returning_preemptions": 2, "kv_quota": True,
            "tenants": [tenant("a", kv_blocks=9, quota_waits=4, kv_soft_quota_blocks=5, kv_hard_cap_blocks=64,
                               kv_over_quota=True),
                        tenant("b", quota_waits=1, kv_soft_quota_blocks=5, kv_hard_cap_blocks=64, kv_over_quota=False)]}
    s = samples(base, max_tenants=1)
    reasons = {dict(k[1])["reason"]: v for k, v in s.items() if k[0] == "fairshare_worker_preemptions_total"}
    assert reasons == {"out-of-blocks": 5, "reclaim": 3, "returning": 2}
    assert s[("fairshare_worker_kv_quota_enabled", ())] == 1
    assert s[("fairshare_worker_tenant_kv_over_quota", (("tenant", "a"),))] == 1
    assert s[("fairshare_worker_tenant_kv_soft_quota_blocks", (("tenant", "a"),))] == 5
    assert ("fairshare_worker_tenant_kv_soft_quota_blocks", (("tenant", "other"),)) not in s
    assert s[("fairshare_worker_tenant_quota_waits_total", (("tenant", "other"),))] == 1

    off = dict(base, kv_quota=False, reclaim_preemptions=0, returning_preemptions=0,
               tenants=[tenant("a", kv_blocks=9)])
    s = samples(off)
    assert s[("fairshare_worker_kv_quota_enabled", ())] == 0
    assert s[("fairshare_worker_preemptions_total", (("reason", "out-of-blocks"),))] == 10
    assert not [k for k in s if k[0].startswith("fairshare_worker_tenant_kv_soft")]
