"""The simulator: same engine loop on a simulated runner and a virtual clock; workloads; report."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fairshare.workloads import TenantLoad, Workload, all_workloads, get_workload, quota_workloads
from tests.support.skips import require_module
from worker.scheduling.metrics import compute_metrics
from loadtests.sim.driver import run_workload
from loadtests.sim.runner import IterationTimeModel, SimItem, SimulatedRunner, VirtualClock

MATPLOTLIB_HINT = "pip install -e '.[loadtest]' (make install does)"

TIME = IterationTimeModel(a=0.02, b=1e-4, c=5e-4, d=5e-6, source="test")
# the report's CPU profile (loadtests/profiles/cpu-random-tiny.json), fixed here so that the test does
# not move when the profile is re-measured
CPU_TIME = IterationTimeModel(a=0.011567, b=152.34e-6, c=570.17e-6, d=5725.54e-9, source="test (cpu profile)")


def short(name: str, seconds: float = 40.0) -> Workload:
    return dataclasses.replace(get_workload(name), duration_s=seconds)


def test_time_model_runner_and_clock(tmp_path):
    clock = VirtualClock()
    runner = SimulatedRunner(clock, TIME, num_kv_blocks=10, block_size=16)
    out = runner.forward([SimItem([1] * 100, 0, [0] * 7), SimItem([5], 40, [1] * 3)])
    assert out == [1, 1]
    assert clock() == pytest.approx(TIME.step_time(100, 2, 141))
    path = tmp_path / "p.json"
    TIME.save(path)
    assert IterationTimeModel.load(path) == TIME
    with pytest.raises(ValueError):
        IterationTimeModel(-1, 0, 0, 0)
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_capacity_estimate_is_simulated_once_per_arguments(monkeypatch):
    """`estimate_capacity_rps` memoises its figure per arguments (the simulator is deterministic):
    the same arguments simulate once and give the same figure, other overrides simulate again."""
    from loadtests.sim import driver

    runs = []

    def counted(*args, **kwargs):
        runs.append(kwargs)
        return run_workload(*args, **kwargs)

    monkeypatch.setattr(driver, "run_workload", counted)
    tm = IterationTimeModel(0.012, 2e-5, 3e-4, 1e-7, "capacity memo test")  # a model no other test uses
    first = driver.estimate_capacity_rps(tm, seconds=20.0)
    assert first > 0 and driver.estimate_capacity_rps(tm, seconds=20.0) == first and len(runs) == 1
    assert driver.estimate_capacity_rps(tm, seconds=20.0, max_running=2) < first and len(runs) == 2
    assert driver.estimate_capacity_rps(tm, seconds=20.0, max_running=2) and len(runs) == 2


def test_simulation_is_deterministic_per_seed():
    w = short("overload", 30.0)
    runs = [run_workload(w, "vtc", TIME, seed=s, rate_scale=0.5) for s in (3, 3, 4)]
    first = [(st.start, st.end, st.service) for st in runs[0].log.steps]
    assert first == [(st.start, st.end, st.service) for st in runs[1].log.steps]
    assert first != [(st.start, st.end, st.service) for st in runs[2].log.steps]
    assert len(runs[0].log.steps) == runs[0].iterations > 10


def test_sim_run_imports_no_torch():
    code = ("import sys; from fairshare.cli.sim import main; "
            "rc = main(['run', 'proportional', '--rate-scale', '0.1', '--policy', 'drr']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "cost function: linear: c = 1*P + 2*O" in out.stdout and "weights: client1=1" in out.stdout


def test_workloads_are_deterministic_and_shaped_as_described():
    names = [w.name for w in all_workloads()]
    assert len(names) == len(set(names)) == 12
    # the memory-isolation workloads get their own KV-quota off/on section, not a fairness summary row
    assert [w.name for w in quota_workloads()] == ["memory-flood"] and "memory-flood" not in names
    for w in all_workloads():
        assert w.generate(seed=1) == w.generate(seed=1)
    on_off = get_workload("on-off").generate(0)
    assert all((r.arrival_s % 60) < 30 for r in on_off if r.tenant_id == "client2")
    inc = [r.arrival_s for r in get_workload("increasing").generate(0) if r.tenant_id == "client2"]
    assert sum(1 for t in inc if t > 150) > 2 * sum(1 for t in inc if t <= 150)
    cancels = [r for r in get_workload("cancel-half").generate(0) if r.tenant_id == "canceller"]
    assert 0.35 < sum(1 for r in cancels if r.cancel_at_s is not None) / len(cancels) < 0.65
    bursts = [r.arrival_s for r in get_workload("bursty-return").generate(0) if r.tenant_id == "bursty"]
    assert len(bursts) % 10 == 0 and len(set(bursts)) == len(bursts) // 10
    assert get_workload("weights-costs").weights() == {"light": 1.0, "heavy": 3.0}
    with pytest.raises(KeyError):
        get_workload("nope")
    with pytest.raises(ValueError):
        TenantLoad("x", 1.0, arrival="zipf").generate(10, 0)


def test_cancelled_requests_keep_what_they_consumed():
    res = run_workload(short("cancel-half", 60.0), "vtc", TIME, rate_scale=0.5)
    recs = res.log.requests.values()
    aborted = [r for r in recs if r.reason == "abort"]
    assert aborted and any(r.charged > 0 for r in aborted)
    service = {t: sum(sum(st.service.get(t, 0.0) for st in res.log.steps) for _ in [0]) for t in ("canceller", "patient")}
    for t in service:
        assert service[t] == pytest.approx(sum(r.charged for r in recs if r.tenant_id == t))
        assert service[t] == pytest.approx(res.engine.policy.accounts[t].charged_service)


def test_weighted_workload_serves_in_proportion_to_weights():
    res = run_workload(short("weighted", 120.0), "vtc", TIME, rate_scale=1.0)
    m = compute_metrics(res.log, res.engine.cost, window=(60.0, 120.0))  # past the ramp-up, all backlogged
    per_weight = [m.tenants[t].service_units / m.tenants[t].weight for t in ("w1", "w2", "w3", "w4")]
    assert max(per_weight) / min(per_weight) < 1.2


def test_report_writes_markdown_table_and_plots(tmp_path):
    require_module("matplotlib", MATPLOTLIB_HINT)
    from loadtests.reports.fairness import benchmark_lines, run_benchmark, write_report

    bench = run_benchmark([short("overload", 30.0), short("on-off", 30.0)], ["vtc", "fcfs"], TIME, rate_scale=1.0)
    files = write_report(bench, tmp_path / "r.md", tmp_path / "img")
    text = (tmp_path / "r.md").read_text()
    assert "| workload | max diff VTC | max diff FCFS |" in text and "linear: c = 1*P + 2*O" in text
    assert "Weights: client1=1, client2=1" in text
    assert all(f.exists() for f in files) and len(list((tmp_path / "img").glob("*.png"))) == 2
    lines = benchmark_lines(bench)
    assert any(line.startswith("CHECK throughput") for line in lines)
    assert any(line.startswith("cost function:") for line in lines)


def test_report_has_the_kv_quota_section_side_by_side(tmp_path):
    require_module("matplotlib", MATPLOTLIB_HINT)
    from loadtests.reports.fairness import run_benchmark, summary_rows, write_report

    flood = dataclasses.replace(get_workload("memory-flood"), duration_s=60.0)
    bench = run_benchmark([short("overload", 30.0)], ["vtc", "fcfs"], TIME, rate_scale=1.0, quota_workloads=[flood])
    assert [r["workload"] for r in summary_rows(bench)] == ["overload"]  # not a fairness row
    (w, off, on), = bench.quota
    assert w is flood and off["victim"]["preemptions"] > on["victim"]["preemptions"] == 0
    write_report(bench, tmp_path / "r.md", tmp_path / "img")
    text = (tmp_path / "r.md").read_text()
    assert text.index("## overload") < text.index("## memory-flood: KV quotas off / on")
    assert "| tenant | requests | served off / on | mean TTFT s off / on | p90 TTFT s off / on | preemptions off / on |" in text
    victim = next(line for line in text.splitlines() if line.startswith("| victim |"))
    cells = [c.strip() for c in victim.strip("|").split("|")]
    assert cells[-1] == f"{off['victim']['preemptions']} / 0"
    assert cells[3] == f"{off['victim']['ttft_mean']:.2f} / {on['victim']['ttft_mean']:.2f}"
    assert "Victim `victim`: mean TTFT" in text
    assert len(list((tmp_path / "img").glob("*.png"))) == 1  # plots for fairness workloads only


def test_sim_report_cli_refuses_a_quota_workload_alone(tmp_path):
    from fairshare.cli.sim import main

    with pytest.raises(SystemExit) as exc:
        main(["report", "--workloads", "memory-flood", "--out", str(tmp_path / "r.md")])
    assert exc.value.code == 2


def test_sim_run_with_kv_quotas(capsys):
    from fairshare.cli.sim import main

    assert main(["run", "memory-flood", "--kv-quota", "--rate-scale", "1"]) == 0
    out = capsys.readouterr().out
    assert "per-tenant KV quotas: on" in out and "victim" in out
    assert main(["run", "memory-flood", "--rate-scale", "1"]) == 0
    assert "KV quotas" not in capsys.readouterr().out


def test_report_has_the_tiers_section_side_by_side(tmp_path):
    """The tiers section (loadtests/reports/tiers.py) at the report's own rate scale: the interactive
    tenant beside a background flood. With the worker's defaults (tiers, lower-tier token target)
    its TTFT p99 stays within 1.5x its solo p99, and it does not without the lower-tier target
    (the flood's decodes swell every iteration); every tier-aware run leaves the background at
    least its minimum share; FCFS queues the interactive tenant behind the flood."""
    require_module("matplotlib", MATPLOTLIB_HINT)
    from loadtests.reports.fairness import benchmark_lines, run_benchmark, write_report
    from loadtests.reports.tiers import RATIO_GOAL

    tiers = get_workload("tiers")
    bench = run_benchmark([short("overload", 30.0)], ["vtc", "fcfs"], CPU_TIME, rate_scale=0.6261,
                          tier_workloads=[tiers], tier_seeds=2)
    (w, rows), = bench.tiers
    by = {r["run"]: r for r in rows}
    assert rows[0]["run"].startswith("solo") and rows[0]["ratio"] == 1.0
    default, unlimited = rows[1], rows[2]
    assert default["run"] == "VTC, tiers" and default["target"] == 1 and unlimited["target"] is None
    assert default["ratio"] <= RATIO_GOAL < unlimited["ratio"]
    assert all(r["bg_share"] >= r["min_share"] > 0 for r in rows[1:3])
    assert by["FCFS, tier-blind"]["ratio"] > 10 * default["ratio"]
    lines = benchmark_lines(bench)
    assert any(line.startswith("CHECK tiers: interactive TTFT p99") and line.endswith("PASS") for line in lines)
    assert [r["seed"] for r in bench.tier_seeds["tiers"]] == [0, 1]
    assert bench.tier_seeds["tiers"][0]["ratio"] == default["ratio"]  # seed 0's run reused
    assert any(line.startswith("CHECK tiers, seeds 0-1: interactive TTFT p99 / solo p99") and line.endswith("PASS")
               for line in lines)
    write_report(bench, tmp_path / "r.md", tmp_path / "img")
    text = (tmp_path / "r.md").read_text()
    assert "## tiers: priority tiers" in text and "| VTC, tier-blind |" in text
    assert "| seed | interactive solo TTFT p99 s |" in text


def test_tiers_keep_the_interactive_ttft_p99_within_goal_on_every_seed():
    """The tiers must-show over seeds 0-4, not one lucky seed (the simulator is deterministic per
    seed, so this asserts the same figures on every machine): with the worker's defaults the
    interactive tenant's TTFT p99 stays within 1.5x its solo p99 on each seed, and the background
    keeps at least its minimum share. Before the 1024-iteration grace and the one-token lower-tier
    target (a 64-iteration grace, 4 tokens) seed 4 gave 1.61x: an interactive arrival after an idle
    spell met a whole background iteration in flight (docs/fairness.md, "Tiers")."""
    from loadtests.reports.tiers import RATIO_GOAL, across_seeds

    rows = across_seeds("tiers", CPU_TIME, range(1, 5), rate_scale=0.6261)
    assert [r["seed"] for r in rows] == [1, 2, 3, 4]
    assert all(r["ratio"] <= RATIO_GOAL for r in rows), rows
    assert all(r["bg_share"] >= r["min_share"] > 0 for r in rows), rows


def test_tiers_serve_an_interactive_tenant_above_its_weight_share_first():
    """tiers-heavy: the interactive tenant sends 70 % of capacity. Tier-blind VTC gives it half and
    queues the rest; with tiers it is served first (its TTFT p99 an order of magnitude lower) and the
    flood still gets at least its minimum share."""
    from loadtests.reports.tiers import compare

    rows = {r["run"]: r for r in compare("tiers-heavy", CPU_TIME, rate_scale=0.6261)}
    tiers, blind = rows["VTC, tiers"], rows["VTC, tier-blind"]
    assert tiers["ttft_p99"] * 10 < blind["ttft_p99"]
    assert tiers["bg_share"] >= tiers["min_share"] and blind["bg_share"] >= 0.45
