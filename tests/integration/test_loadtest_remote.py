"""`fairshare loadtest CAMPAIGN --url URL` against a stand-in gateway, and the pieces it is built from.

The stand-in (`StubGateway`, a threaded HTTP server in this process) speaks the parts of the
OpenAI wire format the campaign uses: `/v1/models`, streamed `/v1/chat/completions` (role chunk,
one chunk per token, usage chunk, `data: [DONE]`), 401 for an unknown key, 429 with `retry-after`
for every third `flood` request, and a worker-style Prometheus `/metrics` with per-tenant charged
service. A real Locust run (a few seconds) goes through the whole `--url` path: keys from a file,
service and policy from `--worker-metrics`, the report with its plots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from fairshare.config import TenantsFile
from loadtests.campaigns import CAMPAIGNS, get_campaign
from loadtests.client import (RequestRecord, chat_body, env_name, keys_from_env, parse_keys, stream_chat,
                              synth_prompt)
from loadtests.reports.loadtest import Run, percentile, write_report
from tests.support.skips import require_module

LOADTEST_HINT = "pip install -e '.[loadtest]' (make install does)"

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"flood": "sk-stub-flood", "trickle": "sk-stub-trickle"}


class StubGateway:
    """A stand-in gateway + worker metrics endpoint on a free loopback port."""

    def __init__(self, token_delay_s: float = 0.005):
        self.token_delay_s = token_delay_s
        self.lock = threading.Lock()
        self.service: dict[str, float] = {}
        self.requests: dict[str, int] = {}
        self.unauthorized = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # close after each response: the body ends at EOF

            def log_message(self, *a):
                pass

            def _json(self, code: int, obj: dict, headers: dict | None = None) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _tenant(self) -> str | None:
                key = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                return {v: k for k, v in KEYS.items()}.get(key)

            def do_GET(self):
                if self.path == "/metrics":
                    self._metrics()
                elif self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def _metrics(self):
                from prometheus_client import CollectorRegistry, generate_latest
                from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

                with stub.lock:
                    svc = dict(stub.service)

                class C:
                    def collect(self):
                        f = CounterMetricFamily("fairshare_worker_tenant_charged_service_units", "x",
                                                labels=["tenant"])
                        for t, v in svc.items():
                            f.add_metric([t], v)
                        yield f
                        g = GaugeMetricFamily("fairshare_worker_policy_info", "x", labels=["policy"])
                        g.add_metric(["vtc"], 1)
                        yield g

                reg = CollectorRegistry()
                reg.register(C())
                body = generate_latest(reg)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                tenant = self._tenant()
                if tenant is None:
                    with stub.lock:
                        stub.unauthorized += 1
                    self._json(401, {"error": {"message": "bad key", "type": "invalid_request_error",
                                               "param": None, "code": "invalid_api_key"}})
                    return
                with stub.lock:
                    n = stub.requests[tenant] = stub.requests.get(tenant, 0) + 1
                if tenant == "flood" and n % 3 == 0:
                    self._json(429, {"error": {"message": "too many", "type": "rate_limit_error", "param": None,
                                               "code": "rate_limit_exceeded"}}, {"retry-after": "0.2"})
                    return
                assert body["stream"] is True and body["ignore_eos"] is True
                prompt = len(body["messages"][0]["content"].split())
                out = int(body["max_tokens"])
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def ev(obj) -> None:
                    self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                    self.wfile.flush()

                ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for _ in range(out):
                    time.sleep(stub.token_delay_s)
                    ev({"choices": [{"index": 0, "delta": {"content": " x"}}]})
                    with stub.lock:
                        stub.service[tenant] = stub.service.get(tenant, 0.0) + 2.0
                with stub.lock:
                    stub.service[tenant] = stub.service.get(tenant, 0.0) + prompt
                ev({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
                ev({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                                             "total_tokens": prompt + out}})
                self.wfile.write(b"data: [DONE]\n\n")

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128  # Locust opens a few dozen connections at once

            def handle_error(self, request, client_address):
                pass  # clients closing streams at the end of the run (BrokenPipe, reset) are expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "StubGateway":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------------------------------
# Pieces
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CAMPAIGNS))
def test_campaign_tenants_file_is_valid_and_matches_the_workload(name):
    c = get_campaign(name)
    tf = TenantsFile.model_validate(c.tenants_file())  # the schema `fairshare up` and the gateway use
    w = c.workload()
    assert [t.id for t in tf.tenants] == c.tenant_ids()
    assert {t.tenant_id for t in w.tenants} == set(c.tenant_ids())
    assert {t.id: t.weight for t in tf.tenants} == w.weights()
    assert c.focus in c.tenant_ids()
    assert w.generate(seed=0) == w.generate(seed=0)  # the same requests under every policy
    assert all(c.tenants[t].users >= 1 for t in c.tenant_ids())


def test_noisy_neighbour_trickle_is_far_below_its_fair_share_and_stops_before_the_end():
    c = get_campaign("noisy-neighbour")
    for d in (30.0, 60.0):
        reqs = c.workload(d).generate(seed=0)
        trickle = [r for r in reqs if r.tenant_id == "trickle"]
        flood = [r for r in reqs if r.tenant_id == "flood"]
        assert trickle and flood
        assert min(r.arrival_s for r in trickle) >= 5.0
        assert max(r.arrival_s for r in trickle) <= d - 7.0  # room to finish even when queued
        # the flood asks for far more than it can get; the trickle for little
        assert len(flood) > 10 * c.tenants["flood"].users
        assert max(r.output_tokens for r in trickle) * 4 <= min(r.output_tokens for r in flood)
    assert c.tenants["flood"].users > c.tenants["flood"].limits["max_concurrent_requests"]  # 429s by design


def test_length_scale_shrinks_requests_but_keeps_their_arrivals():
    c = get_campaign("long-output")
    full, quarter = c.requests(60, seed=1), c.requests(60, seed=1, length_scale=0.25)
    assert [(r.request_id, r.arrival_s) for r in full] == [(r.request_id, r.arrival_s) for r in quarter]
    assert {(r.prompt_tokens, r.output_tokens) for r in quarter if r.tenant_id == "long-out"} == {(4, 256)}
    assert min(r.prompt_tokens for r in c.requests(60, seed=1, length_scale=0.001)) == 1


def test_keys_from_files_and_environment(tmp_path):
    assert parse_keys({"a": "sk-1", "b": "sk-2"}) == {"a": "sk-1", "b": "sk-2"}
    assert parse_keys({"tenants": [{"id": "a", "key": "sk-1"}]}) == {"a": "sk-1"}
    with pytest.raises(ValueError):
        parse_keys(["sk-1"])
    f = tmp_path / "keys.yaml"
    f.write_text(yaml.safe_dump({"flood": "sk-f"}))
    assert env_name("long-out") == "FAIRSHARE_KEY_LONG_OUT"
    env = {"FAIRSHARE_LOADTEST_KEYS": str(f), "FAIRSHARE_KEY_TRICKLE": "sk-t", "FAIRSHARE_KEY_FLOOD": "sk-other"}
    assert keys_from_env(["flood", "trickle"], env) == {"flood": "sk-f", "trickle": "sk-t"}
    assert keys_from_env(["flood"], {"FAIRSHARE_LOADTEST_KEYS": '{"flood": "sk-j"}'}) == {"flood": "sk-j"}


def test_percentile_interpolates():
    assert percentile([], 99) is None
    assert percentile([3.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_stream_chat_records_ttft_itl_usage_and_429():
    import httpx

    with StubGateway(token_delay_s=0.01) as gw, httpx.Client(timeout=10) as http:
        url = gw.url + "/v1/chat/completions"
        rec = RequestRecord("trickle", "trickle-0", 0.0, 0.0, 8, 5)
        prompt = synth_prompt("trickle-0", 8)
        stream_chat(http, url, KEYS["trickle"], chat_body("m", prompt, 5), rec)
        assert rec.outcome == "ok" and rec.status == 200
        assert rec.ttft_s is not None and rec.ttft_s >= 0.01
        assert len(rec.itl_s) == 4 and rec.chunks == 5  # the role-only opening chunk is not a token
        assert rec.completion_tokens == 5 and rec.prompt_tokens == len(prompt.split())  # usage, as served
        assert rec.e2e_s >= rec.ttft_s
        outcomes = []
        for i in range(3):
            r = RequestRecord("flood", f"flood-{i}", 0.0, 0.0, 8, 2)
            stream_chat(http, url, KEYS["flood"], chat_body("m", "hi", 2), r)
            outcomes.append((r.outcome, r.status, r.retry_after_s))
        assert outcomes[2] == ("rejected", 429, 0.2)
        bad = RequestRecord("x", "x-0", 0.0, 0.0, 1, 1)
        stream_chat(http, url, "sk-wrong", chat_body("m", "hi", 1), bad)
        assert (bad.outcome, bad.status, bad.error) == ("error", 401, "bad key")


def test_report_from_synthetic_runs_has_tables_plots_and_the_comparison(tmp_path):
    require_module("matplotlib", LOADTEST_HINT)
    c = get_campaign("noisy-neighbour")

    def run(policy: str, trickle_ttft: float) -> Run:
        recs = []
        for i in range(20):
            t = float(i)
            recs.append(RequestRecord("flood", f"flood-{i}", t, t, 64, 64, status=200, outcome="ok", ttft_s=5.0,
                                      itl_s=[0.02] * 63, e2e_s=6.3, chunks=64, prompt_tokens=80,
                                      completion_tokens=64).to_json())
            recs.append(RequestRecord("flood", f"flood-r{i}", t, t, 64, 64, status=429, outcome="rejected",
                                      e2e_s=0.01, retry_after_s=1.0).to_json())
            recs.append(RequestRecord("trickle", f"trickle-{i}", t, t, 16, 16, status=200, outcome="ok",
                                      ttft_s=trickle_ttft + 0.01 * i, itl_s=[0.02] * 15, e2e_s=trickle_ttft + 0.3,
                                      chunks=16, prompt_tokens=40, completion_tokens=16).to_json())
        recs.append(RequestRecord("trickle", "trickle-cut", 25.0, 25.0, 16, 16).to_json())  # waiting at the end
        data = {"campaign": c.name, "workload": "synthetic", "duration_s": 30.0, "seed": 0, "rate_scale": 1.0,
                "model": "m", "t0_wall": 0.0, "t_end": 30.0, "planned": {"flood": 600, "trickle": 13},
                "unsent": {"flood": 560, "trickle": 0}, "weights": {"flood": 1.0, "trickle": 1.0},
                "users": {"flood": 24, "trickle": 8}, "records": recs}
        samples = [{"t": float(k), "tenants": {"flood": {"charged_service": 200.0 * k},
                                               "trickle": {"charged_service": 20.0 * k}}} for k in range(31)]
        return Run(policy, data, samples, [], "GetLoad test", {"target": "synthetic", "max_running": 2})

    summary = write_report(tmp_path, [run("fcfs", 12.0), run("vtc", 0.5)], c, "trickle")
    fl = summary["runs"]["vtc"]["tenants"]["flood"]
    tr = summary["runs"]["vtc"]["tenants"]["trickle"]
    assert (fl["sent"], fl["ok"], fl["rejected_429"], fl["unsent"]) == (40, 20, 20, 560)
    assert (tr["ok"], tr["cut"], tr["waiting_at_end"]) == (20, 1, 1)
    assert tr["ttft_max_s"] == pytest.approx(5.0)  # the cut request: 30 - 25 s so far, a lower bound
    assert fl["worker_service_share"] == pytest.approx(200 / 220)
    assert fl["worker_service_rate"] == pytest.approx(200.0)
    cmp_ = summary["comparison"]
    assert cmp_["tenant"] == "trickle" and cmp_["ttft_p99_vtc_s"] < cmp_["ttft_p99_fcfs_s"]
    md = (tmp_path / "report.md").read_text()
    for png in ("ttft.png", "service.png", "rejections.png"):
        assert f"({png})" in md
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "FCFS vs VTC" in md and "p99 TTFT of `trickle`" in md
    assert "α = 1, β = 2" in md
    assert json.loads((tmp_path / "summary.json").read_text())["policies"] == ["fcfs", "vtc"]


# ------------------------------------------------------------------------------------------------
# The whole --url path with Locust
# ------------------------------------------------------------------------------------------------

def test_loadtest_against_a_url_with_keys_file_and_worker_metrics(tmp_path):
    require_module("locust", LOADTEST_HINT)  # (found, never imported here: it monkey-patches with gevent)
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    out = tmp_path / "report"
    with StubGateway() as gw:
        cmd = [sys.executable, "-m", "fairshare.cli", "loadtest", "noisy-neighbour", "--url", gw.url,
               "--keys", str(keys), "--worker-metrics", gw.url + "/metrics", "--duration", "15", "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRSHARE_KEY")}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert gw.unauthorized == 0
        served = dict(gw.requests)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policies"] == ["vtc"]  # read from the worker's metrics
    t = summary["runs"]["vtc"]["tenants"]
    assert t["flood"]["ok"] > 0 and t["flood"]["rejected_429"] > 0 and t["trickle"]["rejected_429"] == 0
    assert t["trickle"]["ok"] >= 1 and t["trickle"]["ttft_p99_s"] is not None
    # every request the stub answered was recorded (some of those sent at the very end never reached it)
    assert served["flood"] <= t["flood"]["sent"] and served["trickle"] == t["trickle"]["sent"]
    assert t["flood"]["ok"] + t["flood"]["rejected_429"] <= served["flood"]
    assert t["flood"]["worker_service_units"] > 0 and t["flood"]["worker_service_share"] > 0.5
    for png in ("ttft.png", "service.png", "rejections.png"):
        assert (out / png).stat().st_size > 5000
    md = (out / "report.md").read_text()
    assert f"deployed gateway {gw.url}" in md and "metrics " + gw.url in md
    stats = (out / "vtc" / "locust_stats.csv").read_text()
    assert "TTFT,trickle" in stats and "ITL,flood" in stats and "chat,flood" in stats
    assert not (out / "vtc" / "locust_config.json").exists()  # it held the keys


def test_loadtest_rejects_bad_arguments(tmp_path):
    def run(*a):
        return subprocess.run([sys.executable, "-m", "fairshare.cli", "loadtest", *a], cwd=ROOT,
                              capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if not k.startswith("FAIRSHARE_")})

    p = run("nope")
    assert p.returncode == 2 and "unknown campaign" in p.stderr and "noisy-neighbour" in p.stderr
    p = run("noisy-neighbour", "--url", "http://127.0.0.1:9", "--policy", "both")
    assert p.returncode == 2 and "--policy both" in p.stderr
    p = run("noisy-neighbour", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "o"))
    assert p.returncode == 1 and "FAIRSHARE_KEY_FLOOD" in p.stderr
    p = run("list")
    assert p.returncode == 0 and all(name in p.stdout for name in CAMPAIGNS)
