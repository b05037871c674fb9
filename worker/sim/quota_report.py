"""Side-by-side simulator report: per-tenant TTFT, preemptions and KV figures with KV quotas off and on.

    python -m worker.sim.quota_report [--workload memory-flood] [--profile PATH] [--seed 0] [--out PATH]

Runs the workload twice through the real engine loop on the simulated runner (same seed, same time
model): `kv_quota=False` (the quota-less behaviour) and `kv_quota=True` (defaults: soft quota =
weight share, watermark 0.8, headroom 0.05). Prints (and with --out writes) a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from loadtests.workloads import get_workload
from worker.sim.driver import run_workload
from worker.sim.runner import IterationTimeModel

DEFAULT_PROFILE = Path(__file__).resolve().parents[2] / "loadtests" / "profiles" / "cpu-random-tiny.json"


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


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
        row["ttft_p90"] = _pct(xs, 0.9)
        row["preemptions"] = res.engine.scheduler.preemptions_by_tenant.get(tenant, 0)
        del row["ttft"]
    return rows


def _first_tokens(res):
    log = res.log
    for rid, rec in log.requests.items():
        t = getattr(rec, "first_token", None)
        if t is not None:
            yield rid, t


def compare(workload_name: str = "memory-flood", time_model: IterationTimeModel | None = None, seed: int = 0,
            policy: str = "vtc") -> tuple[dict, dict]:
    w = get_workload(workload_name)
    tm = time_model or IterationTimeModel.load(DEFAULT_PROFILE)
    off = run_workload(w, policy, tm, seed=seed, keep_token_times=False, kv_quota=False)
    on = run_workload(w, policy, tm, seed=seed, keep_token_times=False, kv_quota=True)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.sim.quota_report", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="memory-flood")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE))
    ap.add_argument("--policy", default="vtc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    off, on = compare(args.workload, IterationTimeModel.load(args.profile), args.seed, args.policy)
    text = (f"## {args.workload}: KV quotas off / on (policy {args.policy}, seed {args.seed})\n\n" + table(off, on))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
