"""`fairshare sim`: the fairness simulator (the real engine loop on a simulated runner).

    fairshare sim list
    fairshare sim calibrate [--model random-tiny] [--device cpu] [--threads N] [--repeats 5] [--out PATH]
    fairshare sim run WORKLOAD [--policy vtc|vtc-pred|drr|fcfs] [--profile PATH] [--seed 0]
                               [--rate-scale auto|X] [--cost linear|profiled] [--alpha 1 --beta 2] [--quantum 512]
                               [--kv-quota] [--workers N] [--routing least-loaded|prefix|fair]
                               [--pool-counters auto|on|off] [--load 0.8] [--duration S]
    fairshare sim report [--workloads all|a,b] [--policies vtc,drr,fcfs] [--out docs/fairness-report.md]
                         [--img-dir docs/img] [--profile PATH] [--seed 0] [--rate-scale auto|X] [--no-pool]
    fairshare sim skew [--seeds 0-4] [--profile PATH] [--rate-scale auto|X]

`calibrate` fits the iteration time model `a + b·prefill_tokens + c·batch_size + d·context_tokens`
from the real runner on this machine (needs torch; `--device cuda` on a GPU) and saves it as JSON.
`run` simulates one workload under one policy and prints the per-tenant metrics; with `--workers N`
(or `--routing`) it runs a pool of N simulated workers behind the gateway's routing code
(`loadtests/sim/pool.py`) and also prints the pool-wide prefix hit rate, the p99 queue time and what
each worker got. `--load X` sizes the rates to X of the pool's capacity. `report` runs
every workload under every policy side by side, writes the markdown report and PNG plots, and
prints the benchmark figures; the priority-tier workloads (`tiers`, `tiers-heavy`) are run alone,
with tiers, with tiers and an iteration token target, tier-blind and under FCFS, and the
memory-isolation workloads (`memory-flood`) with KV quotas off and on, each written as their own
sections (not in the fairness summary); then the pool section (prefix hit rates on 4 and 8 workers,
fairness under a skewed overload; loadtests/reports/pool.py). `skew` runs that skewed overload at
several seeds and prints one row per seed (fair, single-worker VTC, per-worker VTC, FCFS, the two
checks, and where fair's max difference builds up). Every command that
reports prints the cost function and weights.
`run` and `report` import no torch.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from loadtests.profiles import DEFAULT_PROFILE, PROFILES_DIR
from worker.scheduling.quota import KVQuotaConfig

ROOT = Path(__file__).resolve().parents[2]



def _profile(path: str | None):
    from loadtests.sim.runner import IterationTimeModel

    p = Path(path) if path else DEFAULT_PROFILE
    try:
        return IterationTimeModel.load(p)
    except OSError as exc:
        raise SystemExit(f"fairshare sim: cannot read time profile {p}: {exc} (run `fairshare sim calibrate`)")


def _engine_overrides(args) -> dict:
    out = {"cost": args.cost, "alpha": args.alpha, "beta": args.beta, "drr_quantum": args.quantum,
           "kv_quota": KVQuotaConfig() if args.kv_quota else None}
    return {k: v for k, v in out.items() if v is not None}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help=f"iteration time model JSON (default {DEFAULT_PROFILE.relative_to(ROOT)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate-scale", default="auto", help="'auto' (scale rates to the simulated capacity) or a factor")
    p.add_argument("--cost", choices=["linear", "profiled"], default=None)
    p.add_argument("--alpha", type=float, default=None, help="service units per prompt token (linear cost)")
    p.add_argument("--beta", type=float, default=None, help="service units per output token (linear cost)")
    p.add_argument("--quantum", type=float, default=None, help="DRR quantum, service units")
    p.add_argument("--kv-quota", action="store_true",
                   help="run with per-tenant KV quotas on (default off, as `fairshare worker`; docs/memory-isolation.md)")


def cmd_list(argv: list[str]) -> int:
    from fairshare.workloads import all_workloads, pool, quota_workloads, shared_prefix, tier_workloads

    prompted = list(shared_prefix.WORKLOADS.values()) + list(pool.WORKLOADS.values())
    for w in all_workloads() + tier_workloads() + quota_workloads() + [p.base for p in prompted]:
        weights = ", ".join(f"{t.tenant_id}={t.weight:g}" for t in w.tenants[:8]) + (", ..." if len(w.tenants) > 8 else "")
        print(f"{w.name:<20} {w.description}  [weights {weights}; {w.source}]")
    return 0


def cmd_calibrate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fairshare sim calibrate", description="Fit the iteration time model.")
    p.add_argument("--model", default="random-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="where to save (default loadtests/profiles/<device>-<model>.json)")
    args = p.parse_args(argv)
    from loadtests.sim.calibrate import calibrate

    model, _ = calibrate(args.model, args.device, args.repeats, args.threads)
    out = Path(args.out) if args.out else PROFILES_DIR / f"{args.device.split(':')[0]}-{args.model}.json"
    model.save(out)
    print(f"saved {out}")
    return 0


def cmd_run(argv: list[str]) -> int:
    from gateway.routing_policy import ROUTING_POLICIES

    p = argparse.ArgumentParser(prog="fairshare sim run", description="Simulate one workload under one policy, on one "
                                "worker or on a pool of workers behind the gateway's routing.")
    p.add_argument("workload")
    p.add_argument("--policy", choices=["vtc", "vtc-pred", "drr", "fcfs"], default="vtc")
    p.add_argument("--drain", action="store_true", help="run until every request finished")
    p.add_argument("--workers", type=int, default=1, help="simulated workers behind the router (default 1)")
    p.add_argument("--routing", choices=ROUTING_POLICIES, default=None,
                   help="routing policy of the pool (default: least-loaded; gateway/routing_policy.py)")
    p.add_argument("--pool-counters", choices=["auto", "on", "off"], default="auto",
                   help="workers order by pool-wide counters through the pool board (auto: on for fair routing)")
    p.add_argument("--load", type=float, default=None,
                   help="offered load as a fraction of the pool's capacity for the workload's mean request "
                        "(overrides --rate-scale)")
    p.add_argument("--duration", type=float, default=None, help="play the workload for this long at the same rates")
    _add_common(p)
    args = p.parse_args(argv)
    from dataclasses import replace

    from fairshare.workloads import get_workload
    from worker.scheduling.metrics import compute_metrics
    from loadtests.reports.fairness import resolve_rate_scale

    try:
        workload = get_workload(args.workload)
    except KeyError as exc:
        print(f"fairshare sim: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.workers < 1:
        p.error("--workers must be >= 1")
    prompted = hasattr(workload, "base")
    if args.duration is not None:
        if not args.duration > 0:
            p.error("--duration must be > 0")
        workload = workload.lasting(args.duration) if prompted else replace(workload, duration_s=args.duration)
    tm = _profile(args.profile)
    overrides = _engine_overrides(args)
    pooled = args.workers > 1 or args.routing is not None or prompted or args.load is not None
    if args.load is not None:
        from loadtests.sim.pool import pool_rate_scale

        scale, per_worker = pool_rate_scale(workload, tm, args.workers, args.load, args.seed, **overrides)
        cap = per_worker * args.workers
    else:
        scale, cap = resolve_rate_scale(args.rate_scale, tm, **overrides)
    drain = math.inf if args.drain else None
    if not pooled:
        from loadtests.sim.driver import run_workload

        res = run_workload(workload, args.policy, tm, seed=args.seed, rate_scale=scale, drain_s=drain, **overrides)
        m = compute_metrics(res.log, res.engine.cost, window=res.window)
        _print_run(workload, res.engine, res.config, tm, scale, cap, res.iterations, res.end_s, m)
        return 0
    from loadtests.sim.pool import run_pool

    counters = None if args.pool_counters == "auto" else args.pool_counters == "on"
    res = run_pool(workload, args.policy, tm, workers=args.workers, routing=args.routing or "least-loaded",
                   seed=args.seed, rate_scale=scale, drain_s=drain, pool_counters=counters, **overrides)
    m = compute_metrics(res.log, res.cost, window=res.window)
    base = workload.base if prompted else workload
    _print_run(base, res.workers[0].engine, res.config, tm, scale, cap, res.iterations, res.end_s, m)
    print(f"pool: {args.workers} worker(s), routing {res.routing_policy.describe()}; pool-wide counters "
          f"{'on' if res.pool_counters else 'off'}; pool-wide prefix hit rate {res.hit_rate:.3f} "
          f"({res.prefix_hits.hit_tokens} of {res.prefix_hits.lookup_tokens} prompt tokens cached); queue p99 {res.queue_percentile(99):.3f} s; "
          f"{res.spills} spills")
    for w in res.workers:
        print(f"  worker {w.route_id}: {w.requests} requests, hit rate {w.prefix_hits.hit_rate:.3f}, "
              f"{w.runner.steps} iterations")
    return 0


def _print_run(workload, engine, config, tm, scale: float, cap, iterations: int, end_s: float, m) -> None:
    """What `sim run` prints: the run's settings, the per-tenant table and the summary line."""
    from loadtests.reports.fairness import TENANT_COLUMNS, _f

    print(f"workload {workload.name}: {workload.description}")
    print(f"policy: {engine.policy.describe()}")
    print(f"cost function: {engine.cost.describe()}")
    if config.kv_quota.enabled:
        print("per-tenant KV quotas: on (defaults; docs/memory-isolation.md)")
    print("weights: " + ", ".join(f"{t}={w:g}" for t, w in workload.weights().items()))
    print(f"time model: {tm.describe()}")
    print(f"rate scale {scale:.4f}" + (f" (capacity {cap:.3f} req/s)" if cap else "")
          + f"; {iterations} iterations, simulated {end_s:.1f} s")
    cols = [("tenant", 12)] + [(c[1], max(9, len(c[1]))) for c in TENANT_COLUMNS]
    print("  ".join(f"{name:>{w}}" for name, w in cols))
    for t, tm_ in m.tenants.items():
        vals = [t] + [_f(getattr(tm_, k), d) for k, _, d in TENANT_COLUMNS]
        print("  ".join(f"{v:>{w}}" for v, (_, w) in zip(vals, cols)))
    print(f"max weighted service difference over co-backlogged intervals: {m.max_pair_diff_units:.0f} units; "
          f"Jain {m.jain:.3f}; {m.service_units_per_s:.1f} units/s; {m.output_tokens_per_s:.1f} output tokens/s; "
          f"{m.busy_tokens_per_s:.1f} tokens per busy second; goodput {m.goodput_rps:.3f} req/s "
          f"(TTFT <= {m.slo[0]:g} s, ITL <= {m.slo[1]:g} s)")


def cmd_report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fairshare sim report", description="Run the fairness benchmark and write the report.")
    p.add_argument("--workloads", default="all")
    p.add_argument("--policies", default="vtc,drr,fcfs")
    p.add_argument("--out", default=str(ROOT / "docs" / "fairness-report.md"))
    p.add_argument("--img-dir", default=str(ROOT / "docs" / "img"))
    p.add_argument("--no-pool", dest="pool", action="store_false",
                   help="leave out the pool section (loadtests/reports/pool.py)")
    _add_common(p)
    args = p.parse_args(argv)
    from fairshare.workloads import all_workloads, get_workload, quota_workloads, tier_workloads
    from loadtests.reports.quota import table
    from loadtests.reports.fairness import benchmark_lines, run_benchmark, write_report

    quota_names = {w.name for w in quota_workloads()}
    tier_names = {w.name for w in tier_workloads()}
    if args.workloads == "all":
        workloads, quota, tiers = all_workloads(), quota_workloads(), tier_workloads()
    else:
        try:
            chosen = [get_workload(n.strip()) for n in args.workloads.split(",") if n.strip()]
        except KeyError as exc:
            p.error(exc.args[0])
        workloads = [w for w in chosen if w.name not in quota_names | tier_names]
        quota = [w for w in chosen if w.name in quota_names]
        tiers = [w for w in chosen if w.name in tier_names]
    if not workloads:
        p.error("--workloads needs at least one fairness workload (memory-flood and the tiers workloads only add "
                "their own sections)")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    tm = _profile(args.profile)
    bench = run_benchmark(workloads, policies, tm, seed=args.seed, rate_scale=args.rate_scale,
                          progress=lambda s: print(s, flush=True), quota_workloads=quota, tier_workloads=tiers,
                          **_engine_overrides(args))
    if args.pool:
        from loadtests.reports.pool import run_pool_benchmark

        bench.pool = run_pool_benchmark(tm, bench.rate_scale, seed=args.seed, progress=lambda s: print(s, flush=True))
    command = "fairshare sim report " + " ".join(argv)
    files = write_report(bench, Path(args.out), Path(args.img_dir), command.strip())
    print()
    for line in benchmark_lines(bench):
        print(line)
    for wr in bench.results:
        print(f"weights {wr.workload.name}: " + ", ".join(f"{t}={w:g}" for t, w in wr.workload.weights().items()))
    for w, off, on in bench.quota:
        print(f"\n{w.name}: KV quotas off / on (policy {policies[0]}; weights "
              + ", ".join(f"{t}={x:g}" for t, x in w.weights().items()) + ")")
        print(table(off, on))
    if bench.pool is not None:
        from loadtests.reports.pool import lines as pool_lines

        print()
        for line in pool_lines(bench.pool):
            print(line)
    print(f"wrote {len(files)} files: {files[-1]} and {len(files) - 1} plots under {args.img_dir}")
    return 0


def _seeds(text: str) -> list[int]:
    """`0-4` or `0,2,5` -> seeds. Raises argparse.ArgumentTypeError."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            seeds = list(range(lo, hi + 1))
        else:
            seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"seeds: a range like 0-4 or a list like 0,2,5 of seeds >= 0, got {text!r}")
    return seeds


def cmd_skew(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fairshare sim skew", description="The pool's skewed overload "
                                "(fairshare/workloads/pool.py) at several seeds, one row per seed.")
    p.add_argument("--seeds", type=_seeds, default=_seeds("0-4"), help="a range (0-4) or a list (0,2,5); default 0-4")
    p.add_argument("--profile", default=None, help=f"iteration time model JSON (default {DEFAULT_PROFILE.relative_to(ROOT)})")
    p.add_argument("--rate-scale", default="auto", help="'auto' (the fairness report's scale) or a factor")
    args = p.parse_args(argv)
    from loadtests.reports.fairness import resolve_rate_scale
    from loadtests.reports.pool import SKEW_SHAPED, SKEW_SINGLE, skew_checks, run_skew

    tm = _profile(args.profile)
    scale = resolve_rate_scale(args.rate_scale, tm)[0]
    print(f"pool skew, 4 workers, rate scale {scale:.4f}; max weighted service difference (units) / Jain; "
          "'pool-shaped' = one worker with the pool's slots (not the goal's reference)")
    print(f"{'seed':>4}  {'fair':>14}  {'single-worker VTC':>17}  {'per-worker VTC':>14}  {'FCFS':>14}  "
          f"{'fair/single':>11}  {'per-worker/fair':>15}  {'pool-shaped':>14}  {'fair/shaped':>11}")
    passed = 0
    for seed in args.seeds:
        rows = run_skew(tm, scale, seed=seed)
        fair, single, per, fcfs = rows["fair"], rows[SKEW_SINGLE], rows["per-worker VTC"], rows["FCFS"]
        shaped = rows[SKEW_SHAPED]
        ok = skew_checks(rows)
        passed += all(ok.values())
        print(f"{seed:>4}  {fair.diff:>6,.0f} / {fair.jain:.3f}  {single.diff:>9,.0f} / {single.jain:.3f}  "
              f"{per.diff:>6,.0f} / {per.jain:.3f}  {fcfs.diff:>6,.0f} / {fcfs.jain:.3f}  "
              f"{fair.diff / max(single.diff, 1e-9):>10.1f}x{' ' if ok['within 2x'] else '!'} "
              f"{per.diff / max(fair.diff, 1e-9):>14.1f}x{' ' if ok['10x below'] else '!'}  "
              f"{shaped.diff:>6,.0f} / {shaped.jain:.3f}  {fair.diff / max(shaped.diff, 1e-9):>10.1f}x  {fair.where()}")
    print(f"goal (fair <= 2x single-worker VTC, >= 10x below per-worker VTC) met at {passed} of {len(args.seeds)} "
          "seeds ('!' marks a miss)")
    return 0


_SUB = {"list": cmd_list, "calibrate": cmd_calibrate, "run": cmd_run, "report": cmd_report, "skew": cmd_skew}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare sim`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _SUB:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return _SUB[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
