"""Prometheus metrics of both tiers after a two-tenant run: scrape /metrics of the gateway and of a
worker started with ``fairshare worker --metrics-port N`` and check the per-tenant series against
the requests sent."""

from __future__ import annotations

import threading
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fairshare.ports import free_port
from tests.conftest import start_worker
from tests.support.waits import join_all
from worker.metrics import OTHER_TENANT, EngineCollector, TenantLabels, WorkerMetrics

ALPHA_N, BETA_N, MAX_TOKENS = 3, 2, 5


def scrape(url: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    """(raw text, {(sample name, sorted label items): value}) of a /metrics endpoint."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def value(samples, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def tenant_labels(samples, prefix: str) -> set[str]:
    return {dict(lbl).get("tenant") for (name, lbl) in samples if name.startswith(prefix) and "tenant" in dict(lbl)}


@pytest.fixture(scope="module")
def metrics_worker(tmp_path_factory):
    """A reference worker (random tiny Llama) with its metrics server on: (gRPC address, metrics URL)."""
    mport = free_port()
    log = tmp_path_factory.mktemp("obs-worker") / "worker.log"
    proc, addr = start_worker("--metrics-port", str(mport), "--num-kv-blocks", "512", log_path=log)
    yield addr, f"http://127.0.0.1:{mport}/metrics"
    proc.terminate()
    proc.wait(15)


def test_two_tenant_run_metrics_on_both_tiers(metrics_worker, gateway_factory):
    addr, worker_metrics_url = metrics_worker
    gw_metrics_port = free_port()  # the gateway's /metrics is on its admin listener, not the public port
    gw = gateway_factory([
        {"id": "alpha", "weight": 1.0, "limits": {"rpm": 1000, "tpm": 1_000_000}},
        {"id": "beta", "weight": 2.0, "tier": "interactive", "limits": {"rpm": BETA_N, "tpm": 1_000_000}},
    ], workers=[addr], key_prefix="fairshare-obs-metrics", metrics_port=gw_metrics_port)
    usages: dict[str, list] = {"alpha": [], "beta": []}
    errors: list[BaseException] = []
    statuses: dict[str, list[int]] = {"alpha": [], "beta": []}

    def run(tenant: str, prompts: list[str]) -> None:
        client = gw.client(tenant)
        try:
            for p in prompts:
                try:
                    r = client.completions.create(model="random-tiny", prompt=p, max_tokens=MAX_TOKENS,
                                                  extra_body={"ignore_eos": True})
                    usages[tenant].append(r.usage)
                    statuses[tenant].append(200)
                except openai.RateLimitError:
                    statuses[tenant].append(429)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=("alpha", [f"alpha prompt number {i} about apples" * (i + 1)
                                                           for i in range(ALPHA_N)])),
               threading.Thread(target=run, args=("beta", [f"beta asks {i} about bananas" * (i + 2)
                                                          for i in range(BETA_N + 1)]))]
    for t in threads:
        t.start()
    join_all(threads, "both tenants' requests")
    assert not errors, errors
    assert statuses == {"alpha": [200] * ALPHA_N, "beta": [200] * BETA_N + [429]}  # beta's RPM is BETA_N

    bad_key = "sk-fs-" + "q" * 39 + "SEEN"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.base_url + "/v1", api_key=bad_key, max_retries=0).completions.create(
            model="random-tiny", prompt="x", max_tokens=1)

    # -- gateway ------------------------------------------------------------------------------
    text, g = scrape(f"http://127.0.0.1:{gw_metrics_port}/metrics")
    assert bad_key not in text and "SEEN" not in text and gw.keys["alpha"] not in text and gw.keys["beta"] not in text
    assert tenant_labels(g, "fairshare_gateway_") <= {"alpha", "beta", "unknown"}
    assert value(g, "fairshare_gateway_requests_total", tenant="alpha", endpoint="completions", status="200") == ALPHA_N
    assert value(g, "fairshare_gateway_requests_total", tenant="beta", endpoint="completions", status="200") == BETA_N
    assert value(g, "fairshare_gateway_requests_total", tenant="beta", endpoint="completions", status="429") == 1
    assert value(g, "fairshare_gateway_requests_total", tenant="unknown", endpoint="completions", status="401") == 1
    assert value(g, "fairshare_gateway_rate_limited_total", tenant="beta", reason="requests") == 1
    assert value(g, "fairshare_gateway_rate_limited_total", tenant="alpha", reason="requests") is None
    assert value(g, "fairshare_gateway_admission_seconds_count", tenant="alpha", outcome="admitted") == ALPHA_N
    assert value(g, "fairshare_gateway_admission_seconds_count", tenant="beta", outcome="admitted") == BETA_N
    assert value(g, "fairshare_gateway_admission_seconds_count", tenant="beta", outcome="rejected") == 1
    for t in ("alpha", "beta"):
        assert value(g, "fairshare_gateway_inflight_tokens", tenant=t) == 0
        assert value(g, "fairshare_gateway_inflight_requests", tenant=t) == 0
        n = len(usages[t])
        assert value(g, "fairshare_gateway_tokens_total", tenant=t, model="random-tiny", kind="completion") == \
            n * MAX_TOKENS
        assert value(g, "fairshare_gateway_tokens_total", tenant=t, model="random-tiny", kind="prompt") == \
            sum(u.prompt_tokens for u in usages[t])
        assert value(g, "fairshare_gateway_ttft_seconds_count", tenant=t, model="random-tiny") == n

    # -- worker -------------------------------------------------------------------------------
    text, w = scrape(worker_metrics_url)
    assert tenant_labels(w, "fairshare_worker_") == {"alpha", "beta"}
    assert "sk-fs-" not in text
    for t, weight in (("alpha", 1.0), ("beta", 2.0)):
        u = usages[t]
        n = len(u)
        prompt = sum(x.prompt_tokens for x in u)
        cached = sum(x.prompt_tokens_details.cached_tokens for x in u)
        computed = prompt - cached
        out = n * MAX_TOKENS
        assert value(w, "fairshare_worker_tenant_output_tokens_total", tenant=t) == out
        assert value(w, "fairshare_worker_tenant_prompt_tokens_computed_total", tenant=t) == computed
        # the worker was started with the default cost: alpha=1 per prompt token, beta=2 per output token
        charged = value(w, "fairshare_worker_tenant_charged_service_units_total", tenant=t)
        assert charged == pytest.approx(1.0 * computed + 2.0 * out)
        assert value(w, "fairshare_worker_tenant_weight", tenant=t) == weight
        assert value(w, "fairshare_worker_tenant_virtual_counter", tenant=t) >= charged / weight - 1e-6
        assert value(w, "fairshare_worker_tenant_finished_requests_total", tenant=t) == n
        assert value(w, "fairshare_worker_tenant_preemptions_total", tenant=t) == 0
        assert value(w, "fairshare_worker_tenant_waiting_requests", tenant=t) == 0
        assert value(w, "fairshare_worker_tenant_running_requests", tenant=t) == 0
        assert value(w, "fairshare_worker_tenant_kv_blocks", tenant=t) is not None
        assert value(w, "fairshare_worker_requests_total", tenant=t, finish_reason="length") == n
        assert value(w, "fairshare_worker_prompt_tokens_total", tenant=t) == prompt
        assert (value(w, "fairshare_worker_cached_prompt_tokens_total", tenant=t) or 0) == cached
        assert value(w, "fairshare_worker_ttft_seconds_count", tenant=t) == n
        assert value(w, "fairshare_worker_queue_seconds_count", tenant=t) == n
        assert value(w, "fairshare_worker_itl_seconds_count", tenant=t) == out - n  # every token after the first
        assert value(w, "fairshare_worker_ttft_seconds_sum", tenant=t) > 0
    assert value(w, "fairshare_worker_waiting_requests") == 0
    assert value(w, "fairshare_worker_running_requests") == 0
    assert value(w, "fairshare_worker_kv_blocks_total") == 512
    assert value(w, "fairshare_worker_policy_info", policy="vtc") == 1
    assert value(w, "fairshare_worker_iterations_total") >= MAX_TOKENS
    assert value(w, "fairshare_worker_draining") == 0


# -- label bounding (no processes) ------------------------------------------------------------------

class _FakeEngine:
    def __init__(self, tenants):
        self.tenants = tenants

    def snapshot(self):
        return {"waiting": 1, "running": 2, "kv_blocks_used": 3, "kv_blocks_total": 10, "kv_block_size": 16,
                "policy": "vtc", "iterations": 7, "inflight_tokens": 99, "tenants": self.tenants}


def _tenant(tid, **kw):
    base = {"tenant_id": tid, "weight": 1.0, "tier": "interactive", "virtual_counter": 0.0, "charged_service": 0.0,
            "prompt_tokens": 0, "output_tokens": 0, "waiting": 0, "running": 0, "kv_blocks": 0, "finished": 0,
            "preemptions": 0}
    base.update(kw)
    return base


def test_worker_tenant_labels_are_bounded():
    labels = TenantLabels(max_tenants=2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER_TENANT, "a", OTHER_TENANT, "b"]
    assert TenantLabels(0)("a") == OTHER_TENANT

    engine = _FakeEngine([_tenant("t1", charged_service=10.0, virtual_counter=10.0, waiting=1, preemptions=1),
                          _tenant("t2", charged_service=5.0, virtual_counter=2.5, weight=2.0, kv_blocks=3),
                          _tenant("t3", charged_service=1.0, virtual_counter=1.0, running=2, preemptions=2),
                          _tenant("t4", charged_service=2.0, virtual_counter=2.0, running=1)])
    m = WorkerMetrics(engine, max_tenants=2)
    m.observe_finish("t1", "stop", prompt_tokens=10, cached_tokens=4)  # t1 takes the first label
    m.render()  # the snapshot's t2 takes the second; t3, t4 are "other"
    m.observe_first_token("t9", 0.01, 0.02)  # seen later: "other" in the histograms too
    samples = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert tenant_labels(samples, "fairshare_worker_") == {"t1", "t2", OTHER_TENANT}
    assert value(samples, "fairshare_worker_tenant_charged_service_units_total", tenant="t1") == 10.0
    assert value(samples, "fairshare_worker_tenant_charged_service_units_total", tenant=OTHER_TENANT) == 3.0
    assert value(samples, "fairshare_worker_tenant_running_requests", tenant=OTHER_TENANT) == 3
    assert value(samples, "fairshare_worker_tenant_preemptions_total", tenant=OTHER_TENANT) == 2
    assert value(samples, "fairshare_worker_tenant_virtual_counter", tenant="t2") == 2.5
    assert value(samples, "fairshare_worker_tenant_virtual_counter", tenant=OTHER_TENANT) is None
    assert value(samples, "fairshare_worker_ttft_seconds_count", tenant=OTHER_TENANT) == 1
    assert value(samples, "fairshare_worker_cached_prompt_tokens_total", tenant="t1") == 4
    assert value(samples, "fairshare_worker_cache_hit_requests_total", tenant="t1") == 1
    assert value(samples, "fairshare_worker_kv_blocks_used") == 3
    assert value(samples, "fairshare_worker_inflight_tokens") == 99


def test_worker_metrics_scrape_survives_a_failing_snapshot():
    class Broken:
        def snapshot(self):
            raise RuntimeError("boom")

    text = WorkerMetrics(Broken()).render().decode()
    assert "fairshare_worker_ttft_seconds" in text and "fairshare_worker_kv_blocks_used" not in text


def test_gateway_metrics_are_exposed_without_traffic():
    from gateway.metrics import GatewayMetrics

    text = GatewayMetrics().render().decode()
    for name in ("fairshare_gateway_rate_limited", "fairshare_gateway_admission_seconds",
                 "fairshare_gateway_inflight_tokens", "fairshare_gateway_requests"):
        assert f"# HELP {name}" in text


def test_collector_is_lazy():
    calls = []

    class Counting(_FakeEngine):
        def snapshot(self):
            calls.append(1)
            return super().snapshot()

    m = WorkerMetrics(Counting([]))
    assert calls == []
    m.render()
    assert calls == [1]
    assert EngineCollector(Counting([]), TenantLabels()).describe() == []
