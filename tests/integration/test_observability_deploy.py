"""deploy/: the Prometheus scrape config, the Grafana dashboard and the compose "monitoring" profile
agree with each other and with the metrics the code exports (no containers are started)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


class _Engine:
    """A snapshot with every optional part on (KV quotas, preemption reasons), so that every series is exported."""

    def snapshot(self):
        t = {"tenant_id": "t", "weight": 1.0, "tier": "interactive", "virtual_counter": 0.0, "charged_service": 0.0,
             "prompt_tokens": 0, "output_tokens": 0, "waiting": 0, "running": 0, "kv_blocks": 0, "finished": 0,
             "preemptions": 0, "quota_waits": 0, "kv_soft_quota_blocks": 1, "kv_hard_cap_blocks": 1,
             "kv_over_quota": 0}
        return {"waiting": 0, "running": 0, "kv_blocks_used": 0, "kv_blocks_total": 1, "kv_block_size": 16,
                "policy": "vtc", "iterations": 0, "inflight_tokens": 0, "kv_quota": True, "preemptions": 0,
                "reclaim_preemptions": 0, "returning_preemptions": 0, "tenants": [t]}


def exported_sample_names() -> set[str]:
    """Every sample name the two tiers can export (histograms: _bucket/_sum/_count; counters: _total)."""
    names: set[str] = set()
    for text in (GatewayMetrics().render().decode(), WorkerMetrics(_Engine()).render().decode()):
        for fam in text_string_to_metric_families(text):
            if fam.type == "histogram":
                names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
            elif fam.type == "counter":
                names |= {fam.name + "_total", fam.name + "_created"}
            else:
                names.add(fam.name)
    return names


def exported_label_values(metric: str, label: str) -> set[str]:
    """Values of `label` on the samples of `metric` (a family name) in the worker's exposition."""
    text = WorkerMetrics(_Engine()).render().decode()
    return {s.labels[label] for fam in text_string_to_metric_families(text) if fam.name == metric
            for s in fam.samples if label in s.labels}


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "fairshare.json").read_text())
    exprs = []
    for p in dash["panels"]:
        exprs += [t["expr"] for t in p.get("targets", [])]
    return exprs


def test_dashboard_queries_only_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "fairshare.json").read_text())
    assert dash["uid"] == "fairshare-overview" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exported = exported_sample_names()
    used = {m for e in dashboard_exprs() for m in re.findall(r"\bfairshare_[a-z0-9_]+", e)}
    assert used, "the dashboard queries no FairShare metric"
    assert used <= exported, sorted(used - exported)
    # the per-tenant views the issue asks for are all there
    for needed in ("fairshare_gateway_requests_total", "fairshare_gateway_rate_limited_total",
                   "fairshare_gateway_admission_seconds_bucket", "fairshare_gateway_inflight_tokens",
                   "fairshare_worker_tenant_charged_service_units_total", "fairshare_worker_tenant_virtual_counter",
                   "fairshare_worker_tenant_waiting_requests", "fairshare_worker_tenant_kv_blocks",
                   "fairshare_worker_ttft_seconds_bucket", "fairshare_worker_itl_seconds_bucket",
                   "fairshare_worker_tenant_preemptions_total", "fairshare_worker_cached_prompt_tokens_total",
                   # KV quotas and preemption reasons
                   "fairshare_worker_tenant_kv_soft_quota_blocks", "fairshare_worker_tenant_kv_hard_cap_blocks",
                   "fairshare_worker_tenant_kv_over_quota", "fairshare_worker_tenant_quota_waits_total",
                   "fairshare_worker_preemptions_total"):
        assert needed in used, needed
    # preemptions are plotted by reason, and the worker reports each of these reasons
    assert any("by (reason)" in e and "fairshare_worker_preemptions_total" in e for e in dashboard_exprs())
    assert exported_label_values("fairshare_worker_preemptions", "reason") == {"out-of-blocks", "reclaim",
                                                                               "returning"}


def test_dashboard_panels_do_not_overlap():
    dash = json.loads((DEPLOY / "grafana" / "fairshare.json").read_text())
    cells: dict[tuple[int, int], int] = {}
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for y in range(g["y"], g["y"] + g["h"]):
            for x in range(g["x"], g["x"] + g["w"]):
                assert (x, y) not in cells, f"panel {p['id']} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = p["id"]


def test_scrape_config_matches_the_compose_services():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert set(jobs) == {"fairshare-gateway", "fairshare-worker"}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    cmd = services["worker"]["command"]
    metrics_port = cmd[cmd.index("--metrics-port") + 1]
    assert jobs["fairshare-worker"]["static_configs"][0]["targets"] == [f"worker:{metrics_port}"]
    assert jobs["fairshare-gateway"]["static_configs"][0]["targets"] == ["gateway:9100"]
    assert all(j.get("metrics_path", "/metrics") == "/metrics" for j in jobs.values())


def test_monitoring_profile():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        s = services[name]
        assert s["profiles"] == ["monitoring"], name
        assert all(str(p).startswith("127.0.0.1:") for p in s["ports"]), name  # not published beyond the host
        assert s["cap_drop"] == ["ALL"] and "no-new-privileges:true" in s["security_opt"], name
        for v in s["volumes"]:
            src = v.split(":", 1)[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), v
            else:
                assert src in compose["volumes"], v
    prom_mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert prom_mounts["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus.yml"
    graf_mounts = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "fairshare.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert graf_mounts[f"{path}/fairshare.json"] == "./deploy/grafana/fairshare.json"
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    # the workers that the default (cpu) profile runs expose metrics; the default profiles are unchanged
    assert "--metrics-port" in services["worker"]["command"]
    assert "monitoring" not in (ROOT / ".env").read_text().split("COMPOSE_PROFILES=")[1].splitlines()[0]
