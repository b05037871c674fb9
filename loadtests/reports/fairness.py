"""The fairness benchmark: every workload under every policy, side by side, in one simulator run.

`run_benchmark` simulates each workload (fairshare/workloads) under each policy with the same seed,
time model and rate scale, draining every request (so all policies complete the same requests),
plus a solo run of each workload's returning tenant. Fairness figures are taken over the arrival
window [0, duration]; throughput is tokens per busy second over the whole drained run.
`write_report` writes the markdown report (the summary table, then every metric per tenant per
policy, then the priority-tier workloads with and without tiers side by side, from
`loadtests.reports.tiers`, then the memory-isolation workloads with KV quotas off and on side by side, from
`loadtests.reports.quota`) and one PNG per fairness workload (service rate per tenant over time,
accumulated service difference over time, TTFT per tenant); `benchmark_lines` are the printed
figures and checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.reports import quota as quota_report
from loadtests.reports import tiers as tier_report
from loadtests.reports.common import cell, pyplot
from fairshare.workloads import REFERENCE_CAPACITY_RPS, Workload
from worker.scheduling.metrics import FairnessMetrics, compute_metrics, vtc_bound
from loadtests.sim.driver import SimResult, estimate_capacity_rps, run_workload
from loadtests.sim.runner import IterationTimeModel


@dataclass
class WorkloadResult:
    workload: Workload
    runs: dict[str, SimResult]
    metrics: dict[str, FairnessMetrics]
    solo_ttft_s: float | None = None


@dataclass
class Benchmark:
    time_model: IterationTimeModel
    rate_scale: float
    capacity_rps: float | None
    seed: int
    policies: list[str]
    results: list[WorkloadResult] = field(default_factory=list)
    engine_overrides: dict = field(default_factory=dict)
    # memory-isolation workloads, each run with KV quotas off and on: (workload, rows off, rows on)
    quota: list[tuple[Workload, dict, dict]] = field(default_factory=list)
    # priority-tier workloads, each run solo / tiers / tiers + iteration target / tier-blind / FCFS
    tiers: list[tuple[Workload, list]] = field(default_factory=list)
    # the same workloads' defaults over several seeds (`tier_report.across_seeds`), by workload name
    tier_seeds: dict[str, list] = field(default_factory=dict)
    pool: object | None = None  # loadtests.reports.pool.PoolBench, when the pool section is run


def resolve_rate_scale(rate_scale: str | float, time_model: IterationTimeModel, **engine_overrides):
    """`auto` → (capacity / REFERENCE_CAPACITY_RPS, capacity); a number → (it, None)."""
    if isinstance(rate_scale, str) and rate_scale == "auto":
        cap = estimate_capacity_rps(time_model, **engine_overrides)
        return cap / REFERENCE_CAPACITY_RPS, cap
    return float(rate_scale), None


def run_benchmark(workloads: list[Workload], policies: list[str], time_model: IterationTimeModel, *, seed: int = 0,
                  rate_scale: str | float = "auto", progress=None, quota_workloads: list[Workload] = (),
                  tier_workloads: list[Workload] = (), tier_seeds: int = len(tier_report.SEEDS),
                  **engine_overrides) -> Benchmark:
    """Simulate every workload under every policy (and each returning tenant alone), then each of
    `quota_workloads` under the first policy with KV quotas off and on (`loadtests.reports.quota`),
    then each of `tier_workloads` with and without tiers (`loadtests.reports.tiers`), at the same
    seed and rate scale, and the worker's defaults on them over `tier_seeds` seeds from `seed` on
    (`across_seeds`; 1: only `seed`)."""
    scale, cap = resolve_rate_scale(rate_scale, time_model, **engine_overrides)
    bench = Benchmark(time_model, scale, cap, seed, list(policies), engine_overrides=dict(engine_overrides))
    for w in workloads:
        runs, metrics = {}, {}
        for policy in policies:
            res = run_workload(w, policy, time_model, seed=seed, rate_scale=scale, drain_s=math.inf, **engine_overrides)
            runs[policy] = res
            metrics[policy] = compute_metrics(res.log, res.engine.cost, window=res.window)
            if progress:
                progress(f"{w.name:<20} {policy:<8} {res.iterations:6d} iterations, "
                         f"max weighted difference {metrics[policy].max_pair_diff_units:10.0f} units")
        solo = None
        if w.returning_tenant:
            res = run_workload(w.only(w.returning_tenant), policies[0], time_model, seed=seed, rate_scale=scale,
                               drain_s=math.inf, **engine_overrides)
            solo = compute_metrics(res.log, res.engine.cost, window=res.window).tenants[w.returning_tenant].ttft_mean_s
        bench.results.append(WorkloadResult(w, runs, metrics, solo))
    for w in quota_workloads:
        off, on = quota_report.compare(w, time_model, seed, policies[0], scale, **engine_overrides)
        bench.quota.append((w, off, on))
        if progress and w.returning_tenant in off:
            v_off, v_on = off[w.returning_tenant], on[w.returning_tenant]
            progress(f"{w.name:<20} KV quotas off/on: {w.returning_tenant} TTFT {v_off['ttft_mean']:.2f}/"
                     f"{v_on['ttft_mean']:.2f} s, preemptions {v_off['preemptions']}/{v_on['preemptions']}")
    for w in tier_workloads:
        rows = tier_report.compare(w, time_model, seed, scale, **engine_overrides)
        bench.tiers.append((w, rows))
        if progress:
            progress(f"{w.name:<20} interactive TTFT p99 / solo: " + ", ".join(
                f"{r['run']} {r['ratio']:.2f}x" for r in rows[1:]))
        if tier_seeds <= 1:
            continue
        seeds = range(seed, seed + tier_seeds)
        bench.tier_seeds[w.name] = tier_report.across_seeds(w, time_model, seeds, scale, first=rows, **engine_overrides)
        if progress:
            progress(f"{w.name:<20} the defaults over seeds {seeds.start}-{seeds.stop - 1}, p99 / solo: " + ", ".join(
                f"{r['ratio']:.2f}x" for r in bench.tier_seeds[w.name]))
    return bench


def _f(x: float, digits: int = 0) -> str:
    return cell(x, digits, thousands=True)


def _bound(res: SimResult) -> float:
    cfg = res.config
    weights = list(res.workload.weights().values())
    return vtc_bound(cfg.alpha, cfg.beta, cfg.max_num_batched_tokens, cfg.num_kv_blocks * cfg.block_size, weights)


def summary_rows(bench: Benchmark) -> list[dict]:
    """One row per workload: max weighted service differences, their ratio, throughput ratios and
    the returning tenant's TTFT."""
    rows = []
    for wr in bench.results:
        m = wr.metrics
        row = {"workload": wr.workload.name, "bound": _bound(next(iter(wr.runs.values())))}
        for p in bench.policies:
            row[f"diff_{p}"] = m[p].max_pair_diff_units
            row[f"tput_{p}"] = m[p].busy_tokens_per_s
            row[f"jain_{p}"] = m[p].jain
        if "vtc" in m and "fcfs" in m:
            row["ratio"] = m["fcfs"].max_pair_diff_units / max(m["vtc"].max_pair_diff_units, 1e-9)
            row["tput_ratio"] = m["vtc"].busy_tokens_per_s / m["fcfs"].busy_tokens_per_s
        rt = wr.workload.returning_tenant
        if "vtc" in wr.runs:
            steps = [st for st in wr.runs["vtc"].log.steps if st.end <= wr.workload.duration_s]
            row["iteration_vtc"] = sum(st.end - st.start for st in steps) / max(len(steps), 1)
        if rt:
            row["returning"] = rt
            row["ttft_solo"] = wr.solo_ttft_s
            for p in bench.policies:
                row[f"ttft_{p}"] = m[p].tenants[rt].ttft_mean_s
        rows.append(row)
    return rows


def summary_table(bench: Benchmark) -> str:
    """The main markdown table."""
    pols = bench.policies
    head = (["workload"] + [f"max diff {p.upper()}" for p in pols] + ["FCFS/VTC diff", "bound"]
            + [f"Jain {p.upper()}" for p in pols] + ["tput VTC/FCFS"] + ["returning tenant TTFT s (solo / " +
                                                                          " / ".join(p.upper() for p in pols) + ")"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary_rows(bench):
        cells = [r["workload"]] + [_f(r[f"diff_{p}"]) for p in pols]
        cells += [_f(r.get("ratio"), 1) + "×" if "ratio" in r else "–", _f(r["bound"])]
        cells += [_f(r[f"jain_{p}"], 3) for p in pols]
        cells += [_f(r.get("tput_ratio"), 3) if "tput_ratio" in r else "–"]
        if "returning" in r:
            cells.append(f"{r['returning']}: " + " / ".join(_f(r[k], 2) for k in ["ttft_solo"] + [f"ttft_{p}" for p in pols]))
        else:
            cells.append("–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TENANT_COLUMNS = [
    ("weight", "w", 1), ("requests", "req", 0), ("finished", "done", 0), ("aborted", "cancel", 0),
    ("offered_units_per_s", "offered u/s", 0), ("backlogged_s", "backlogged s", 0),
    ("backlogged_intervals", "intervals", 0), ("service_units", "service u", 0), ("gps_units", "GPS ideal u", 0),
    ("max_lag_units", "max lag u", 0), ("max_pair_diff_units", "max pair diff u", 0),
    ("longest_starvation_s", "starved s", 1), ("queue_mean_s", "queue s", 2), ("ttft_mean_s", "TTFT s", 2),
    ("ttft_p99_s", "TTFT p99 s", 2), ("itl_mean_s", "ITL s", 3), ("itl_p99_s", "ITL p99 s", 3),
    ("goodput_rps", "goodput req/s", 3),
]


def tenant_table(wr: WorkloadResult, policies: list[str]) -> str:
    head = ["policy", "tenant"] + [c[1] for c in TENANT_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in policies:
        m = wr.metrics[p]
        for t, tm in m.tenants.items():
            lines.append("| " + " | ".join([p, t] + [_f(getattr(tm, k), d) for k, _, d in TENANT_COLUMNS]) + " |")
        lines.append("| " + " | ".join([p, "**all**"] + [""] * 10 + [f"**{_f(m.max_pair_diff_units)}**"] + [""] * 6
                                       + [_f(m.goodput_rps, 3)]) + " |")
    return "\n".join(lines)


def benchmark_lines(bench: Benchmark) -> list[str]:
    """The printed benchmark: figures side by side and the three checks of the issue."""
    rows = summary_rows(bench)
    out = [f"time model: {bench.time_model.describe()}",
           f"rate scale: {bench.rate_scale:.4f}" + (f" (capacity {bench.capacity_rps:.3f} req/s of 256/256)"
                                                     if bench.capacity_rps else "")]
    any_run = next(iter(bench.results[0].runs.values())) if bench.results else None
    if any_run is not None:
        out.append(f"cost function: {any_run.engine.cost.describe()}")
    for r in rows:
        diffs = "  ".join(f"{p}={r[f'diff_{p}']:>9.0f}" for p in bench.policies)
        extra = f"  FCFS/VTC={r['ratio']:6.1f}x  tput VTC/FCFS={r['tput_ratio']:.3f}" if "ratio" in r else ""
        ttft = ""
        if "returning" in r:
            ttft = "  TTFT " + r["returning"] + " solo=" + _f(r["ttft_solo"], 2) + "".join(
                f" {p}={_f(r[f'ttft_{p}'], 2)}" for p in bench.policies)
        out.append(f"{r['workload']:<20} max weighted diff (units): {diffs}{extra}{ttft}")
    over = [r for r in rows if r["workload"] == "overload"]
    if over and "ratio" in over[0]:
        ok = over[0]["ratio"] >= 25
        out.append(f"CHECK overload: VTC max difference {over[0]['ratio']:.1f}x lower than FCFS (want >= 25x): "
                   f"{'PASS' if ok else 'FAIL'}")
    tputs = [r["tput_ratio"] for r in rows if "tput_ratio" in r]
    if tputs:
        out.append(f"CHECK throughput VTC/FCFS >= 0.98 on every workload (min {min(tputs):.3f}): "
                   f"{'PASS' if min(tputs) >= 0.98 else 'FAIL'}")
    for w, trows in bench.tiers:
        out += tier_report.check_lines(trows, w.name, ttft_check=w.name == "tiers")
        if bench.tier_seeds.get(w.name):
            out += tier_report.seed_check_lines(bench.tier_seeds[w.name], w.name, ttft_check=w.name == "tiers")
    for r in rows:
        if "returning" in r and "ttft_vtc" in r:
            out.append(f"INFO returning tenant {r['workload']}/{r['returning']}: TTFT VTC {r['ttft_vtc']:.2f} s vs "
                       f"solo {r['ttft_solo']:.2f} s ({r['ttft_vtc'] / r['ttft_solo']:.1f}x)"
                       + (f", FCFS {r['ttft_fcfs']:.2f} s" if "ttft_fcfs" in r else "")
                       + f"; mean iteration under VTC {r['iteration_vtc']:.3f} s")
    return out


# ---- plots ---------------------------------------------------------------------------------------
def plot_workload(wr: WorkloadResult, policies: list[str], path: Path, bin_s: float = 10.0) -> None:
    """One PNG: service rate per tenant over time (one panel per policy), accumulated service
    difference over time (all policies), TTFT per tenant against arrival time (one panel per policy)."""
    plt = pyplot()
    n = len(policies)
    fig = plt.figure(figsize=(4.2 * n, 9.5))
    grid = fig.add_gridspec(3, n, hspace=0.45, wspace=0.25)
    duration = wr.workload.duration_s
    tenants = sorted(wr.workload.weights())
    colors = {t: f"C{i % 10}" for i, t in enumerate(tenants)}
    for j, p in enumerate(policies):
        ax = fig.add_subplot(grid[0, j])
        log = wr.runs[p].log
        nbins = int(math.ceil(duration / bin_s))
        for t in tenants:
            rate = [0.0] * nbins
            for st in log.steps:
                k = int(st.end // bin_s)
                if k < nbins and t in st.service:
                    rate[k] += st.service[t] / bin_s
            ax.plot([(k + 0.5) * bin_s for k in range(nbins)], rate, color=colors[t], label=t, lw=1.2)
        ax.set_title(f"{p.upper()}: service rate (units/s)", fontsize=9)
        ax.set_xlabel("time (s)", fontsize=8)
        ax.tick_params(labelsize=7)
        if j == 0:
            ax.legend(fontsize=6, ncol=2)
    ax = fig.add_subplot(grid[1, :])
    for p in policies:
        series = wr.metrics[p].diff_series
        ax.plot([t for t, _ in series], [d for _, d in series], label=p.upper(), lw=1.2)
    ax.set_title("accumulated weighted service difference between co-backlogged tenants (units)", fontsize=9)
    ax.set_xlabel("time (s)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    for j, p in enumerate(policies):
        ax = fig.add_subplot(grid[2, j])
        for t in tenants:
            pts = [(r.arrival, r.first_token - r.arrival) for r in wr.runs[p].log.requests.values()
                   if r.tenant_id == t and r.first_token is not None and r.arrival <= duration]
            ax.scatter([a for a, _ in pts], [b for _, b in pts], s=4, color=colors[t], label=t)
        ax.set_title(f"{p.upper()}: TTFT per request (s)", fontsize=9)
        ax.set_xlabel("arrival time (s)", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{wr.workload.name}: {wr.workload.description}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72, bbox_inches="tight")
    plt.close(fig)


# ---- the markdown report --------------------------------------------------------------------------
def write_report(bench: Benchmark, out: Path, img_dir: Path, command: str = "fairshare sim report") -> list[Path]:
    """Write the markdown report to `out` and the plots under `img_dir`; returns the files written."""
    out = Path(out)
    img_dir = Path(img_dir)
    written = []
    first = next(iter(bench.results[0].runs.values()))
    cfg = first.config
    lines = [
        "# FairShare fairness report",
        "",
        f"Generated by `{command}` (seed {bench.seed}): every workload in `fairshare/workloads` under "
        f"{', '.join(p.upper() for p in bench.policies)}, in one run of the simulator (the real engine loop and "
        "scheduler on a simulated runner and a virtual clock, `loadtests/sim`).",
        "",
        f"- **Cost function:** {first.engine.cost.describe()}",
        f"- **Iteration time model:** {bench.time_model.describe()}",
        f"- **Rate scale:** {bench.rate_scale:.4f}" + (
            f" (simulated capacity {bench.capacity_rps:.3f} req/s of 256/256; workloads are written for "
            f"{REFERENCE_CAPACITY_RPS:g} req/s)" if bench.capacity_rps else ""),
        f"- **Engine:** chunk (token budget per iteration) {cfg.max_num_batched_tokens}, prefill slice "
        f"{cfg.prefill_slice}, max running {cfg.max_running}, KV pool {cfg.num_kv_blocks} blocks × {cfg.block_size} "
        f"tokens (unless a workload says otherwise), DRR quantum {cfg.drr_quantum:g} units, memory skips before a "
        f"reservation {cfg.max_skips}" + (", **per-tenant KV quotas on** (defaults; docs/memory-isolation.md)"
                                          if cfg.kv_quota.enabled else ""),
        f"- **Bound** (VTC, DESIGN.md): `2·max(α·chunk, β·M) / w_min` with M = KV pool tokens.",
        "- **Columns:** *max diff* = max over co-backlogged tenant pairs and sub-intervals of "
        "|W_i/w_i − W_j/w_j| (service units; backlogged = queued or prefilling); *Jain* over actual/GPS-ideal "
        "service; *tput* = tokens per busy second over the whole drained run (same requests for every policy); "
        "*returning tenant TTFT* = mean TTFT of the workload's returning tenant, alone and under each policy.",
        "",
        "## Summary",
        "",
        summary_table(bench),
        "",
        "Printed by the same run:",
        "",
        "```",
        *benchmark_lines(bench),
        "```",
        "",
        "## Reading the results",
        "",
        "- *Max diff* is measured only while both tenants of a pair have queued or prefilling work. VTC keeps it "
        "near one request's cost wherever the tenants compete for admission; where one tenant's already-running "
        "requests keep decoding for a long time (long outputs, memory-bound pools) it grows towards the β·M part of "
        "the bound, because VTC charges output tokens as they are committed, not at admission.",
        "- *Returning tenants* are lifted to the smallest backlogged counter, so they are served ahead of the other "
        "tenant's backlog but earn nothing for the time they were away. When the other tenant's decodes hold every "
        "running slot (or the KV room), a returning tenant below its weighted slot share preempts that tenant's "
        "latest admissions (recompute) up to its share (worker/scheduling/returning.py; not under FCFS). What is "
        "left of its TTFT is the iteration in flight and its own prefill, in iterations of a full batch: compare it "
        "with the solo TTFT plus the mean iteration time printed above. A burst is prefilled at the speed of the "
        "prefill budget a full batch leaves (chunk minus one token per running decode).",
        "- *Throughput* is tokens per busy second over the same, fully drained set of requests: work-conserving "
        "policies differ only in how well their batches pack (and in recompute after preemption).",
        "- DRR's deficits are also debited by output tokens committed after a tenant's turn, so its rounds even out "
        "more slowly than VTC's counters.",
        "",
        "Reproduce: `fairshare sim calibrate --threads 1` (writes `loadtests/profiles/cpu-random-tiny.json`; on a GPU "
        "`--device cuda --out loadtests/profiles/gpu.json`), then `fairshare sim report` (add `--profile PATH` for "
        "another time model, `--policies vtc,vtc-pred,drr,fcfs` for the length-prediction variant). One workload: "
        "`fairshare sim run overload --policy fcfs`.",
        "",
    ]
    for wr in bench.results:
        w = wr.workload
        img = img_dir / f"fairness-{w.name}.png"
        plot_workload(wr, bench.policies, img)
        written.append(img)
        weights = ", ".join(f"{t}={x:g}" for t, x in w.weights().items())
        rel = Path(__import__("os").path.relpath(img, out.parent)).as_posix()
        lines += [f"## {w.name}", "", f"{w.description} ({w.source}). Duration {w.duration_s:g} s. Weights: {weights}. "
                  f"Cost: {first.engine.cost.describe()}."
                  + (f" Engine overrides: {w.engine}." if w.engine else ""), ""]
        if wr.solo_ttft_s is not None:
            lines += [f"Returning tenant `{w.returning_tenant}` alone: mean TTFT {wr.solo_ttft_s:.2f} s.", ""]
        lines += [tenant_table(wr, bench.policies), "", f"![{w.name}]({rel})", ""]
    for w, trows in bench.tiers:  # priority tiers: their own sections
        lines += tier_report.section(w, trows, bench.seed, bench.rate_scale, ttft_check=w.name == "tiers",
                                     seed_rows=bench.tier_seeds.get(w.name))
    for w, off, on in bench.quota:  # memory isolation: its own sections, not in the summary
        lines += quota_report.section(w, off, on, bench.policies[0], bench.seed, bench.rate_scale)
    if bench.pool is not None:  # a pool of workers: loadtests/reports/pool.py
        from loadtests.reports import pool as pool_report

        lines += pool_report.section(bench.pool)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    written.append(out)
    return written
