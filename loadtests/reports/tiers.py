"""Side-by-side simulator report for priority tiers: an interactive tenant beside a background flood.

    python -m loadtests.reports.tiers [--workload tiers] [--profile PATH] [--seed 0] [--seeds 5] [--rate-scale 0.6261]

Runs the workload (`fairshare/workloads/tiers.py`) through the real engine loop on the simulated
runner, same seed, time model and rate scale, drained:

- the interactive tenant alone (its solo TTFT p99);
- VTC with tiers, the worker's defaults: strict priority, 5 % minimum shares, and while the
  interactive tenant has work (or had some in the last 1024 iterations) the background takes at most
  `--lower-tier-token-target` (1) tokens of an iteration unless owed its minimum share, so the
  iterations stay short
  (docs/fairness.md, "Tiers");
- VTC with tiers and `--lower-tier-token-target 0` (no limit: the background's 60-odd decodes ride
  in every iteration), to show what the limit buys and costs;
- VTC tier-blind (every tenant in one tier) and FCFS (tier-blind): the baselines.

Per run: the interactive tenant's TTFT mean and p99 (and the p99 over its solo p99), ITL, the
background tenants' share of the service charged in the arrival window and their minimum share,
tokens per busy second over the drained run, service units per second in the window, tier
preemptions. `fairshare sim report` writes this as a section (`section`) with its checks.
"""

from __future__ import annotations

import argparse
import math

from loadtests.profiles import DEFAULT_PROFILE
from fairshare.workloads import Workload, get_workload
from worker.scheduling.metrics import compute_metrics
from loadtests.sim.driver import run_workload
from loadtests.sim.runner import IterationTimeModel

RATIO_GOAL = 1.5     # interactive TTFT p99 within this multiple of its solo p99
SEEDS = tuple(range(10))  # the seeds the worker's defaults are checked over (`across_seeds`)


def runs() -> list[tuple[str, str, dict]]:
    """(name, policy, engine overrides) of the runs, the solo one first, the worker's defaults second."""
    return [("solo (interactive alone)", "vtc", {}),
            ("VTC, tiers", "vtc", {}),
            ("VTC, tiers, no lower-tier target", "vtc", {"lower_tier_token_target": 0}),
            ("VTC, tier-blind", "vtc", {"tier_scheduling": False}),
            ("FCFS, tier-blind", "fcfs", {"tier_scheduling": False})]


def compare(workload: Workload | str = "tiers", time_model: IterationTimeModel | None = None, seed: int = 0,
            rate_scale: float = 1.0, **engine_overrides) -> list[dict]:
    """One row per run (see `runs`). The interactive tenant is the workload's `returning_tenant`.
    Raises KeyError for an unknown workload name."""
    w = get_workload(workload) if isinstance(workload, str) else workload
    tm = time_model or IterationTimeModel.load(DEFAULT_PROFILE)
    rows = []
    for i, (name, policy, overrides) in enumerate(runs()):
        wl = w.only(w.returning_tenant) if i == 0 else w
        rows.append({"run": name, **_row(wl, w, policy, tm, seed, rate_scale, {**engine_overrides, **overrides})})
    solo = rows[0]["ttft_p99"]
    for r in rows:
        r["ratio"] = r["ttft_p99"] / solo if solo else float("nan")
    return rows


def _row(wl: Workload, w: Workload, policy: str, tm: IterationTimeModel, seed: int, rate_scale: float,
         overrides: dict) -> dict:
    """One drained run of `wl` (`w` itself, or its interactive tenant alone): the figures of a row."""
    chat = w.returning_tenant
    background = [t for t, tier in w.tiers().items() if tier != "interactive"]
    res = run_workload(wl, policy, tm, seed=seed, rate_scale=rate_scale, drain_s=math.inf, **overrides)
    m = compute_metrics(res.log, res.engine.cost, window=res.window)
    total = sum(t.service_units for t in m.tenants.values()) or 1.0
    c = m.tenants[chat]
    snap = res.engine.snapshot()
    return {"ttft_mean": c.ttft_mean_s, "ttft_p99": c.ttft_p99_s, "itl": c.itl_mean_s,
            "bg_share": sum(m.tenants[t].service_units for t in background if t in m.tenants) / total,
            "min_share": res.engine.tiers.min_share.get("background", 0.0),
            "tiers": res.config.tier_scheduling, "tok_s": m.busy_tokens_per_s,
            "units_s": m.service_units_per_s, "tier_preemptions": snap["preemptions_by_reason"]["tier"],
            "target": res.engine.scheduler.core.lower_tier_token_target}


def across_seeds(workload: Workload | str = "tiers", time_model: IterationTimeModel | None = None,
                 seeds=SEEDS, rate_scale: float = 1.0, first: list[dict] | None = None,
                 **engine_overrides) -> list[dict]:
    """The worker's defaults (VTC with tiers) against the interactive tenant alone, once per seed:
    one row per seed {seed, solo_p99, ttft_p99, ratio, bg_share, min_share} (TTFT in seconds).
    first: `compare`'s rows for the first seed, reused instead of running it again. The simulator is
    deterministic per seed: a seed's row is the same on every machine."""
    w = get_workload(workload) if isinstance(workload, str) else workload
    tm = time_model or IterationTimeModel.load(DEFAULT_PROFILE)
    out = []
    for k, seed in enumerate(seeds):
        if k == 0 and first is not None:
            solo, default = first[0], first[1]
        else:
            solo = _row(w.only(w.returning_tenant), w, "vtc", tm, seed, rate_scale, engine_overrides)
            default = _row(w, w, "vtc", tm, seed, rate_scale, engine_overrides)
        out.append({"seed": seed, "solo_p99": solo["ttft_p99"], "ttft_p99": default["ttft_p99"],
                    "ratio": default["ttft_p99"] / solo["ttft_p99"] if solo["ttft_p99"] else float("nan"),
                    "bg_share": default["bg_share"], "min_share": default["min_share"]})
    return out


def seeds_table(rows: list[dict]) -> str:
    lines = ["| seed | interactive solo TTFT p99 s | with the flood, the defaults: TTFT p99 s | p99 / solo p99 | "
             "background share (min) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['solo_p99']:.3f} | {r['ttft_p99']:.3f} | {r['ratio']:.2f}× | "
                     f"{r['bg_share']:.3f} ({r['min_share']:.2f}) |")
    return "\n".join(lines)


def seed_check_lines(rows: list[dict], name: str = "tiers", ttft_check: bool = True) -> list[str]:
    """Over every seed of `across_seeds`: the interactive TTFT p99 within RATIO_GOAL of its solo p99
    (a CHECK when `ttft_check`, else INFO) and the background at least its minimum share (a CHECK)."""
    worst = max(rows, key=lambda r: r["ratio"])
    seeds = f"seeds {rows[0]['seed']}-{rows[-1]['seed']}"
    ok = all(r["ratio"] <= RATIO_GOAL for r in rows)
    share_ok = all(r["bg_share"] >= r["min_share"] for r in rows)
    ratios = ", ".join(f"{r['ratio']:.2f}" for r in rows)
    return [f"{'CHECK' if ttft_check else 'INFO'} {name}, {seeds}: interactive TTFT p99 / solo p99 {ratios} "
            f"(worst {worst['ratio']:.2f}x, seed {worst['seed']}; want <= {RATIO_GOAL}x each): {'PASS' if ok else 'FAIL'}",
            f"CHECK {name}, {seeds}: background share min {min(r['bg_share'] for r in rows):.3f} >= its minimum "
            f"share {rows[0]['min_share']:.2f}: {'PASS' if share_ok else 'FAIL'}"]


def table(rows: list[dict]) -> str:
    lines = ["| run | interactive TTFT mean s | TTFT p99 s | p99 / solo p99 | ITL mean s | background share "
             "(min) | tokens / busy s | service units / s | tier preemptions |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = "–" if r["run"].startswith("solo") else f"{r['bg_share']:.3f} ({r['min_share']:.2f})"
        lines.append(f"| {r['run']} | {r['ttft_mean']:.3f} | {r['ttft_p99']:.3f} | {r['ratio']:.2f}× | "
                     f"{r['itl']:.3f} | {share} | {r['tok_s']:.0f} | {r['units_s']:.0f} | {r['tier_preemptions']} |")
    return "\n".join(lines)


def check_lines(rows: list[dict], name: str = "tiers", ttft_check: bool = True) -> list[str]:
    """The checks: with the worker's defaults the interactive TTFT p99 stays within RATIO_GOAL of
    solo (a CHECK when `ttft_check`, else an INFO line), and every tier-aware run gives the
    background at least its minimum share; plus what the run without the lower-tier target gives
    and what the target costs in throughput."""
    by = {r["run"]: r for r in rows}
    default, unlimited = rows[1], rows[2]
    out = [f"{'CHECK' if ttft_check else 'INFO'} {name}: interactive TTFT p99 {default['ttft_p99']:.3f} s = "
           f"{default['ratio']:.2f}x its solo p99 with the worker's defaults (--lower-tier-token-target "
           f"{default['target']}) (want <= {RATIO_GOAL}x): {'PASS' if default['ratio'] <= RATIO_GOAL else 'FAIL'}"]
    ok = all(r["bg_share"] >= r["min_share"] for r in rows[1:3])
    out.append(f"CHECK {name}: background share {default['bg_share']:.3f} / {unlimited['bg_share']:.3f} (defaults / "
               f"no lower-tier target) >= its minimum share {default['min_share']:.2f}: {'PASS' if ok else 'FAIL'}")
    out.append(f"INFO {name}: without the lower-tier target the interactive TTFT p99 is {unlimited['ratio']:.2f}x "
               f"solo (iterations swollen by the flood's decodes; tier-blind VTC {by['VTC, tier-blind']['ratio']:.2f}x, "
               f"FCFS {by['FCFS, tier-blind']['ratio']:.2f}x); the target costs "
               f"{1 - default['tok_s'] / unlimited['tok_s']:.1%} of tokens per busy second and "
               f"{1 - default['units_s'] / unlimited['units_s']:.1%} of service per second in the window")
    return out


def section(workload: Workload, rows: list[dict], seed: int = 0, rate_scale: float = 1.0,
            ttft_check: bool = True, seed_rows: list[dict] | None = None) -> list[str]:
    """Markdown lines of one tiers workload's section: what ran, the table, the seeds table
    (`across_seeds`, when given), the checks."""
    out = [f"## {workload.name}: priority tiers", "",
           f"{workload.description} ({workload.source}). Duration {workload.duration_s:g} s, drained. Seed {seed}, "
           f"rate scale {rate_scale:.4f}. Interactive tenant `{workload.returning_tenant}`; its solo run is the "
           "same arrivals alone. *background share* = the background tenants' share of the service charged in "
           "the arrival window (minimum share in brackets); *tokens / busy s* over the whole drained run; "
           "*lower-tier target* = `--lower-tier-token-target` (docs/fairness.md, \"Tiers\").", "",
           table(rows), ""]
    checks = check_lines(rows, workload.name, ttft_check)
    if seed_rows:
        out += [f"The worker's defaults over seeds {seed_rows[0]['seed']}-{seed_rows[-1]['seed']} (the p99 is over "
                "the interactive tenant's 30-120 requests, so it is its one or two worst):", "",
                seeds_table(seed_rows), ""]
        checks += seed_check_lines(seed_rows, workload.name, ttft_check)
    return out + ["```", *checks, "```", "",
            "Reading: with tiers the interactive tenant is never queued behind the flood (it is admitted in the "
            "iteration after its arrival; lower-tier work is preempted for it when slots or KV blocks are short). "
            "What is left of its TTFT is iteration time: the iteration in flight when it arrives, then its own. On "
            "this CPU time model an iteration's time grows with its batch and every decode's context, and without "
            "a limit the flood's 60-odd decodes ride in every iteration, making each one several times longer than "
            "the interactive tenant's own. With the defaults the background takes one token of an iteration while "
            "the interactive tenant has work or had some in the last 1024 iterations (all of it after that, and "
            "its minimum share always), at the price of the flood's throughput.", ""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.reports.tiers", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="tiers")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=len(SEEDS), help="also check the defaults over seeds SEED..SEED+N-1")
    ap.add_argument("--rate-scale", type=float, default=0.6261, help="multiplies every arrival rate")
    args = ap.parse_args(argv)
    try:
        workload = get_workload(args.workload)
    except KeyError as exc:
        ap.error(exc.args[0])
    tm = IterationTimeModel.load(args.profile)
    rows = compare(workload, tm, args.seed, args.rate_scale)
    seed_rows = across_seeds(workload, tm, range(args.seed, args.seed + args.seeds), args.rate_scale, first=rows) \
        if args.seeds > 1 else None
    print("\n".join(section(workload, rows, args.seed, args.rate_scale, workload.name == "tiers", seed_rows)).rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
