"""Side-by-side simulator report: per-tenant TTFT, preemptions and KV figures with KV quotas off and on.

    python -m loadtests.reports.quota [--workload memory-flood] [--profile PATH] [--seed 0]
                                      [--rate-scale 1] [--out PATH]
    python -m loadtests.reports.quota --all [--rate-scale 0.6261]   (every workload, quotas off / on)

Runs the workload twice through the real engine loop on the simulated runner (same seed, same time
model, same rate scale): `kv_quota=KVQuotaConfig(enabled=False)` (the quota-less behaviour) and
`kv_quota=KVQuotaConfig()` (defaults: soft quota = weight share, watermark 0.8, headroom 0.05).
Prints (and with --out writes) a markdown table. `fairshare sim report` writes the same section
(`section`) for every workload of `fairshare.workloads.quota_workloads()`, at the benchmark's rate scale.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from loadtests.profiles import DEFAULT_PROFILE
from fairshare.workloads import Workload, get_workload
from worker.scheduling.metrics import percentile
from worker.scheduling.quota import KVQuotaConfig
from loadtests.sim.driver import run_workload
from loadtests.sim.runner import IterationTimeModel



def tenant_rows(res) -> dict[str, dict]:
    """Per tenant: requests, completed, mean/p90 TTFT (s), preemptions."""
    rows: dict[str, dict] = {}
    ttft: dict[str, list[float]] = {}
    arrivals = {r.request_id: r for r in res.requests}
    for r in res.requests:
        row = rows.setdefault(r.tenant_id, {"requests": 0, "ttft": [], "preemptions": 0})
        row["requests"] += 1
    for ev in _first_tokens(res):
        rid, t = ev
        spec = arrivals.get(rid)
        if spec is not None:
            ttft.setdefault(spec.tenant_id, []).append(t - spec.arrival_s)
    for tenant, row in rows.items():
        xs = ttft.get(tenant, [])
        row["served"] = len(xs)
        row["ttft_mean"] = statistics.fmean(xs) if xs else float("nan")
        row["ttft_p90"] = percentile(xs, 90)
        row["preemptions"] = res.engine.scheduler.core.stats.preemptions_by_tenant.get(tenant, 0)
        del row["ttft"]
    return rows


def _first_tokens(res):
    log = res.log
    for rid, rec in log.requests.items():
        t = getattr(rec, "first_token", None)
        if t is not None:
            yield rid, t


def compare(workload: Workload | str = "memory-flood", time_model: IterationTimeModel | None = None, seed: int = 0,
            policy: str = "vtc", rate_scale: float = 1.0, **engine_overrides) -> tuple[dict, dict]:
    """Run `workload` (a Workload or its name) with KV quotas off, then on; returns the two
    `tenant_rows` (off, on). engine_overrides: other EngineConfig fields (e.g. alpha, beta).
    Raises KeyError for an unknown workload name."""
    w = get_workload(workload) if isinstance(workload, str) else workload
    tm = time_model or IterationTimeModel.load(DEFAULT_PROFILE)
    off = run_workload(w, policy, tm, seed=seed, rate_scale=rate_scale, keep_token_times=False,
                       **{**engine_overrides, "kv_quota": KVQuotaConfig(enabled=False)})
    on = run_workload(w, policy, tm, seed=seed, rate_scale=rate_scale, keep_token_times=False,
                      **{**engine_overrides, "kv_quota": KVQuotaConfig()})
    return tenant_rows(off), tenant_rows(on)


def table(off: dict, on: dict) -> str:
    lines = ["| tenant | requests | served off / on | mean TTFT s off / on | p90 TTFT s off / on | preemptions off / on |",
             "|---|---|---|---|---|---|"]
    for tenant in sorted(off):
        a, b = off[tenant], on[tenant]
        lines.append(f"| {tenant} | {a['requests']} | {a['served']} / {b['served']} | {a['ttft_mean']:.2f} / "
                     f"{b['ttft_mean']:.2f} | {a['ttft_p90']:.2f} / {b['ttft_p90']:.2f} | {a['preemptions']} / "
                     f"{b['preemptions']} |")
    return "\n".join(lines)


def section(workload: Workload, off: dict, on: dict, policy: str = "vtc", seed: int = 0,
            rate_scale: float = 1.0) -> list[str]:
    """Markdown lines of one workload's side-by-side section: a heading, what ran, the table and,
    for the workload's victim (its `returning_tenant`), one line comparing TTFT and preemptions."""
    lines = [f"## {workload.name}: KV quotas off / on", "",
             f"{workload.description} ({workload.source}). Duration {workload.duration_s:g} s, drained for as long "
             f"again. Policy {policy.upper()}, seed {seed}, rate scale {rate_scale:.4f}; engine overrides "
             f"{workload.engine}. Off: the quota-less engine (admission by free blocks, newest-first preemption); "
             "on: per-tenant KV quotas with their defaults (soft quota = weight share, watermark 0.8, headroom "
             "0.05; docs/memory-isolation.md). *served* = requests that got a first token.", "", table(off, on), ""]
    victim = workload.returning_tenant
    if victim in off and victim in on:
        a, b = off[victim], on[victim]
        lines += [f"Victim `{victim}`: mean TTFT {a['ttft_mean']:.2f} s without quotas, {b['ttft_mean']:.2f} s with "
                  f"them; preemptions {a['preemptions']} without, {b['preemptions']} with.", ""]
    return lines


def every_workload(time_model: IterationTimeModel | None = None, seed: int = 0, policy: str = "vtc",
                   rate_scale: float = 1.0, **engine_overrides) -> list[dict]:
    """Every workload (fairness, tiers, memory isolation) drained with KV quotas off and on: per
    workload the max weighted service difference, Jain's index, tokens per busy second, the worst
    tenant's TTFT p99 and the preemptions, off and on (what docs/memory-isolation.md decides the
    default by)."""
    import math

    from fairshare.workloads import all_workloads, quota_workloads, tier_workloads
    from worker.scheduling.metrics import compute_metrics

    tm = time_model or IterationTimeModel.load(DEFAULT_PROFILE)
    rows = []
    for w in all_workloads() + tier_workloads() + quota_workloads():
        row = {"workload": w.name}
        for label, on in (("off", False), ("on", True)):
            res = run_workload(w, policy, tm, seed=seed, rate_scale=rate_scale, drain_s=math.inf, keep_token_times=False,
                               **{**engine_overrides, "kv_quota": KVQuotaConfig(enabled=on)})
            m = compute_metrics(res.log, res.engine.cost, window=res.window)
            row[label] = {"diff": m.max_pair_diff_units, "jain": m.jain, "tok_s": m.busy_tokens_per_s,
                          "ttft_p99": max(t.ttft_p99_s for t in m.tenants.values()),
                          "preemptions": res.engine.snapshot()["preemptions"]}
        rows.append(row)
    return rows


def every_workload_table(rows: list[dict]) -> str:
    lines = ["| workload | max weighted diff off / on | Jain off / on | tokens / busy s off / on | worst TTFT p99 s "
             "off / on | preemptions off / on |", "|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["off"], r["on"]
        lines.append(f"| {r['workload']} | {a['diff']:,.0f} / {b['diff']:,.0f} | {a['jain']:.3f} / {b['jain']:.3f} | "
                     f"{a['tok_s']:.0f} / {b['tok_s']:.0f} | {a['ttft_p99']:.2f} / {b['ttft_p99']:.2f} | "
                     f"{a['preemptions']} / {b['preemptions']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.reports.quota", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="memory-flood")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE))
    ap.add_argument("--policy", default="vtc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiplies every arrival rate (default 1)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--all", action="store_true", help="every workload, quotas off / on (one table)")
    args = ap.parse_args(argv)
    if args.all:
        text = every_workload_table(every_workload(IterationTimeModel.load(args.profile), args.seed, args.policy,
                                                   args.rate_scale))
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    try:
        workload = get_workload(args.workload)
    except KeyError as exc:
        ap.error(exc.args[0])
    off, on = compare(workload, IterationTimeModel.load(args.profile), args.seed, args.policy, args.rate_scale)
    text = "\n".join(section(workload, off, on, args.policy, args.seed, args.rate_scale)).rstrip()
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
