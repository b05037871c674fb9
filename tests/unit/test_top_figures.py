"""`fairshare top`'s figures from two scrapes of Prometheus text (no processes): increases with
counter resets, service shares against the weighted ideal of the active tenants, TTFT quantiles,
the window, and where it finds the metrics of a `fairshare up`."""

from __future__ import annotations

import json
import math

import pytest

from fairshare.cli import top
from fairshare.cli.scrape import counter_delta, histogram_quantile, parse

GATEWAY = "http://gw/metrics"
WORKER_A, WORKER_B = "http://w0/metrics", "http://w1/metrics"


def gateway_text(ttft_acme: tuple[int, int, int], limited_globex: int, requests: int) -> str:
    """TTFT buckets (<=0.1, <=1, +Inf cumulative) for acme; 429s for globex."""
    le01, le1, inf = ttft_acme
    return f"""# TYPE fairshare_gateway_tenant_weight gauge
fairshare_gateway_tenant_weight{{tenant="acme",tier="interactive"}} 1.0
fairshare_gateway_tenant_weight{{tenant="globex",tier="batch"}} 3.0
fairshare_gateway_tenant_weight{{tenant="idle",tier="background"}} 4.0
# TYPE fairshare_gateway_ttft_seconds histogram
fairshare_gateway_ttft_seconds_bucket{{le="0.1",model="m",tenant="acme"}} {le01}
fairshare_gateway_ttft_seconds_bucket{{le="1.0",model="m",tenant="acme"}} {le1}
fairshare_gateway_ttft_seconds_bucket{{le="+Inf",model="m",tenant="acme"}} {inf}
fairshare_gateway_ttft_seconds_count{{model="m",tenant="acme"}} {inf}
fairshare_gateway_ttft_seconds_sum{{model="m",tenant="acme"}} 1.0
# TYPE fairshare_gateway_rate_limited counter
fairshare_gateway_rate_limited_total{{reason="tokens",tenant="globex"}} {limited_globex}
# TYPE fairshare_gateway_requests counter
fairshare_gateway_requests_total{{endpoint="chat",status="200",tenant="acme"}} {requests}
fairshare_gateway_requests_total{{endpoint="chat",status="401",tenant="unknown"}} 7
# TYPE fairshare_gateway_worker_up gauge
fairshare_gateway_worker_up{{worker="w0"}} 1
fairshare_gateway_worker_up{{worker="w1"}} 0
# TYPE fairshare_gateway_redis_up gauge
fairshare_gateway_redis_up 1
"""


def worker_text(acme: float, globex: float, waiting: int = 0, prompt: float = 100, cached: float = 25) -> str:
    return f"""# TYPE fairshare_worker_tenant_charged_service_units counter
fairshare_worker_tenant_charged_service_units_total{{tenant="acme"}} {acme}
fairshare_worker_tenant_charged_service_units_total{{tenant="globex"}} {globex}
# TYPE fairshare_worker_tenant_waiting_requests gauge
fairshare_worker_tenant_waiting_requests{{tenant="acme"}} {waiting}
fairshare_worker_tenant_waiting_requests{{tenant="globex"}} 2
# TYPE fairshare_worker_tenant_running_requests gauge
fairshare_worker_tenant_running_requests{{tenant="acme"}} 1
fairshare_worker_tenant_running_requests{{tenant="globex"}} 3
# TYPE fairshare_worker_tenant_kv_blocks gauge
fairshare_worker_tenant_kv_blocks{{tenant="acme"}} 5
fairshare_worker_tenant_kv_blocks{{tenant="globex"}} 7
# TYPE fairshare_worker_prompt_tokens counter
fairshare_worker_prompt_tokens_total{{tenant="acme"}} {prompt}
# TYPE fairshare_worker_cached_prompt_tokens counter
fairshare_worker_cached_prompt_tokens_total{{tenant="acme"}} {cached}
# TYPE fairshare_worker_kv_blocks_used gauge
fairshare_worker_kv_blocks_used 12
# TYPE fairshare_worker_kv_blocks_total gauge
fairshare_worker_kv_blocks_total 100
# TYPE fairshare_worker_policy_info gauge
fairshare_worker_policy_info{{policy="vtc"}} 1
"""


SOURCES = top.Sources([GATEWAY], [WORKER_A, WORKER_B], "test")


def scrape(t: float, gw: str, a: str, b: str | None) -> top.Scrape:
    return top.Scrape(t, 1_700_000_000 + t, {GATEWAY: parse(gw)},
                      {WORKER_A: parse(a), WORKER_B: None if b is None else parse(b)})


def rows(summary) -> dict:
    return {r["tenant"]: r for r in summary["tenants"]}


def test_since_start_shares_sum_the_workers_and_ideal_counts_only_active_tenants():
    s = top.summarize(scrape(0, gateway_text((1, 3, 4), 2, 10), worker_text(100, 300), worker_text(0, 0)),
                      None, SOURCES)
    r = rows(s)
    assert s["window_s"] is None
    assert set(r) == {"acme", "globex", "idle"}  # "unknown" (failed auth) is not a tenant
    assert r["acme"]["service_share"] == pytest.approx(0.25) and r["globex"]["service_share"] == pytest.approx(0.75)
    # idle has weight 4 but no service and nothing queued: not part of the ideal split
    assert r["acme"]["ideal_share"] == pytest.approx(0.25) and r["globex"]["ideal_share"] == pytest.approx(0.75)
    assert r["idle"]["ideal_share"] is None and r["idle"]["service_share"] == 0
    assert (r["globex"]["tier"], r["globex"]["weight"]) == ("batch", 3.0)
    assert (r["globex"]["queued"], r["globex"]["running"], r["globex"]["kv_blocks"]) == (4, 6, 14)  # both workers
    assert r["acme"]["cache_hit_rate"] == pytest.approx(0.25)
    assert r["globex"]["rate_limited"] == 2 and r["acme"]["requests"] == 10
    p = s["platform"]
    assert (p["workers_up"], p["workers_known"], p["redis_up"], p["policy"]) == (1, 2, True, "vtc")
    assert (p["kv_blocks_used"], p["kv_blocks_total"]) == (24, 200)


def test_window_uses_increases_and_a_reset_counter_counts_from_zero():
    base = scrape(0, gateway_text((1, 3, 4), 2, 10), worker_text(100, 300), worker_text(50, 50))
    # worker B restarted (its counters went down); worker A grew by 100 / 100
    new = scrape(10, gateway_text((1, 5, 8), 5, 14), worker_text(200, 400, prompt=300, cached=25),
                 worker_text(20, 40))
    s = top.summarize(new, base, SOURCES)
    r = rows(s)
    assert s["window_s"] == 10
    assert r["acme"]["service_units"] == 100 + 20 and r["globex"]["service_units"] == 100 + 40
    assert r["acme"]["service_units_total"] == 220 and r["globex"]["service_units_total"] == 440
    assert r["acme"]["service_share"] == pytest.approx(120 / 260)
    assert r["acme"]["service_units_per_s"] == pytest.approx(12.0)
    assert r["acme"]["cache_hit_rate"] == 0.0  # 200 prompt tokens in the window, none cached
    assert r["globex"]["rate_limited"] == 3 and r["acme"]["requests"] == 4
    # TTFT in the window: 4 samples, 2 in (0.1, 1], 2 above 1 s
    assert r["acme"]["ttft_p50_s"] == pytest.approx(1.0) and r["acme"]["ttft_p99_s"] == pytest.approx(1.0)


def test_a_source_that_cannot_be_read_is_left_out_and_named():
    s = top.summarize(scrape(0, gateway_text((0, 0, 0), 0, 0), worker_text(10, 30), None), None, SOURCES)
    assert s["platform"]["workers_reachable"] == 1
    assert rows(s)["acme"]["ttft_p50_s"] is None  # no TTFT sample yet


def test_histogram_quantile_and_counter_delta():
    assert histogram_quantile(0.5, {0.1: 2, 1.0: 4, math.inf: 4}) == pytest.approx(0.1)
    assert histogram_quantile(0.75, {0.1: 2, 1.0: 4, math.inf: 4}) == pytest.approx(0.55)
    assert histogram_quantile(0.99, {0.1: 0, 1.0: 0, math.inf: 3}) == 1.0  # in +Inf: the largest bound
    assert histogram_quantile(0.5, {math.inf: 0}) is None
    assert counter_delta(5, 3) == 2 and counter_delta(2, 3) == 2 and counter_delta(4, None) == 4


def test_history_keeps_one_scrape_at_least_a_window_old():
    h = top.History(window_s=10)
    for t in range(0, 31, 2):
        h.add(top.Scrape(float(t), 0.0, {}, {}))
    assert h.base().t == 20.0  # 30 - 10
    h2 = top.History(10)
    h2.add(top.Scrape(0.0, 0.0, {}, {}))
    assert h2.base() is None


def test_render_has_one_row_per_tenant():
    from rich.console import Console

    s = top.summarize(scrape(0, gateway_text((1, 3, 4), 2, 10), worker_text(100, 300), worker_text(0, 0)),
                      None, SOURCES)
    console = Console(width=200, record=True)
    console.print(top.render(s, SOURCES, 60))
    text = console.export_text()
    for word in ("tenant", "service share", "ideal", "TTFT p99", "429s", "acme", "globex", "idle", "25.0%",
                 "75.0%", "batch"):
        assert word in text, word


def test_sources_come_from_run_json_or_from_urls(tmp_path):
    p = top.build_parser()
    with pytest.raises(top.TopError, match="is `fairshare up` running"):
        top.find_sources(p.parse_args(["--state-dir", str(tmp_path)]))
    (tmp_path / "run.json").write_text(json.dumps({"pid": 42, "metrics": {"gateway": ["http://a/metrics"],
                                                                          "workers": ["http://b/metrics"]}}))
    src = top.find_sources(p.parse_args(["--state-dir", str(tmp_path)]))
    assert (src.gateways, src.workers) == (["http://a/metrics"], ["http://b/metrics"]) and "pid 42" in src.where
    src = top.find_sources(p.parse_args(["--worker-metrics", "http://w/metrics"]))
    assert (src.gateways, src.workers) == ([], ["http://w/metrics"])


def test_top_without_a_platform_is_a_one_line_usage_error(tmp_path, capsys):
    assert top.main(["--state-dir", str(tmp_path), "--once"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.json" in err
