"""The pool section of the fairness report (`fairshare sim report`, `loadtests.sim.pool`).

Two experiments, each printed as figures with their checks and written as a markdown section:

- **Locality** (`run_locality`): the shared-system-prompt workload
  (`fairshare.workloads.shared_prefix.SHARED_SYSTEM_PROMPTS`, played over `duration_s` at the same
  rates, so that tenants repeat their prefixes often enough for hit rates to mean something) at
  `load` (default 80 %) of the pool's capacity, on 4 and 8 workers under ``least-loaded``,
  ``prefix`` and ``fair`` routing, and on one worker with the pool's total capacity (N times as
  fast, N times the KV pool: the same total KV). Figures: pool-wide prefix hit rate (cached prompt
  tokens / prompt tokens) and p99 queue time. Checks: ``prefix`` and ``fair`` hit rates >= 90 % of
  the single worker's; their p99 queue time <= 1.2x ``least-loaded``'s.
- **Fairness under skew** (`run_skew`): `fairshare.workloads.pool.SKEWED_OVERLOAD` on 4 workers:
  per-worker VTC (``prefix`` routing, each worker its own counters), ``fair`` (pool-wide counters
  and spill), FCFS (``prefix`` routing), and three single-worker references: VTC on one worker with
  the pool's capacity (one worker's batch, N times as fast: the checks' reference), VTC on one worker
  of the pool's kind carrying a quarter of the traffic, and VTC on one worker of the pool's shape
  (N times the slots, KV and prefill chunk, each iteration as long as a pool worker's: the pool's
  batches under one scheduler, `loadtests.sim.pool.pool_shaped_worker`).
  Figures: pool-wide max weighted service difference over co-backlogged intervals and Jain's index
  (whole window and its second half). Checks: ``fair`` <= 2x the single worker's difference and
  >= 10x below per-worker VTC's.

Deterministic per seed (the simulator is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fairshare.workloads.pool import SKEWED_OVERLOAD
from fairshare.workloads.shared_prefix import SHARED_SYSTEM_PROMPTS
from worker.scheduling.metrics import compute_metrics
from loadtests.sim.pool import (PoolResult, base_workload, pool_rate_scale, pool_shaped_worker, run_pool,
                                single_worker_equivalent)
from loadtests.sim.runner import IterationTimeModel

ROUTINGS = ("least-loaded", "prefix", "fair")
SINGLE = "single"


@dataclass
class LocalityRow:
    """One run of the locality experiment. hit_rate: cached / prompt tokens; queue_p99_s / mean."""

    workers: int
    routing: str
    hit_rate: float
    queue_p99_s: float
    queue_mean_s: float
    finished: int
    spills: int


@dataclass
class SkewRow:
    """One run of the skew experiment: max weighted service difference (units) and Jain's index,
    over the whole window and its second half."""

    label: str
    diff: float
    jain: float
    diff_late: float
    jain_late: float
    spills: int
    hit_rate: float
    # where the max difference comes from (`FairnessMetrics.max_pair_witness`): the pair, the start
    # of their co-backlogged stretch and when it peaked (s); None without co-backlogged pairs
    witness: tuple[str, str, float, float] | None = None
    # the tenant of the pair that got less in that stretch and the longest queue time (s) of its
    # requests queued during it: a request waiting for a slot while its rival is served elsewhere
    longest_wait: tuple[str, float] | None = None
    handed_back: int = 0  # requests a worker handed back and the router sent elsewhere (worker/scheduling/handback.py)

    def where(self) -> str:
        """Where the max difference builds up, in words (empty without a witness)."""
        if self.witness is None:
            return ""
        i, j, since, peak = self.witness
        text = f"{i} vs {j}, co-backlogged from {since:.1f} s, peak at {peak:.1f} s"
        if self.longest_wait is not None:
            text += f"; {self.longest_wait[0]} (behind) queued up to {self.longest_wait[1]:.1f} s"
        return text


@dataclass
class PoolBench:
    time_model: IterationTimeModel
    seed: int
    load: float
    duration_s: float
    locality: dict[int, dict[str, LocalityRow]] = field(default_factory=dict)
    scales: dict[int, float] = field(default_factory=dict)
    skew: dict[str, SkewRow] = field(default_factory=dict)
    skew_scale: float = 1.0
    skew_workers: int = 4


def _locality_row(workers: int, routing: str, res: PoolResult) -> LocalityRow:
    qs = res.queue_times()
    return LocalityRow(workers, routing, res.hit_rate, res.queue_percentile(99),
                       sum(qs) / len(qs) if qs else math.nan, res.finished, res.spills)


def run_locality(time_model: IterationTimeModel, workers: int, *, seed: int = 0, load: float = 0.8,
                 duration_s: float = 300.0, progress=None) -> tuple[dict[str, LocalityRow], float]:
    """The locality experiment on `workers` workers (module docstring). Returns (rows by routing
    and ``single``, rate scale)."""
    w = SHARED_SYSTEM_PROMPTS.lasting(duration_s)
    scale, _ = pool_rate_scale(w, time_model, workers, load, seed)
    rows = {}
    for routing in ROUTINGS:
        res = run_pool(w, "vtc", time_model, workers=workers, routing=routing, seed=seed, rate_scale=scale,
                       drain_s=math.inf)
        rows[routing] = _locality_row(workers, routing, res)
        if progress:
            progress(f"pool locality {workers} workers {routing:<12} hit {rows[routing].hit_rate:.3f}")
    eq = single_worker_equivalent(workers, time_model, "vtc", w)
    res = run_pool(w, "vtc", eq["time_model"], workers=1, routing="least-loaded", seed=seed, rate_scale=scale,
                   drain_s=math.inf, num_kv_blocks=eq["num_kv_blocks"])
    rows[SINGLE] = _locality_row(1, SINGLE, res)
    return rows, scale


def _skew_row(label: str, res: PoolResult) -> SkewRow:
    t1 = res.window[1]
    whole = compute_metrics(res.log, res.cost, window=(0.0, t1))
    late = compute_metrics(res.log, res.cost, window=(t1 / 2, t1))
    return SkewRow(label, whole.max_pair_diff_units, whole.jain, late.max_pair_diff_units, late.jain, res.spills,
                   res.hit_rate, whole.max_pair_witness, _longest_wait(res, whole.max_pair_witness), res.handed_back)


def _longest_wait(res: PoolResult, witness) -> tuple[str, float] | None:
    """(tenant, queue time s) for the witness's pair: of the tenant that got less weighted service over
    the stretch, the longest queue time of its requests that were queued during it (one not admitted
    by the window's end counts as queued until then), or None."""
    if witness is None:
        return None
    i, j, since, peak = witness
    got = {i: 0.0, j: 0.0}
    for st in res.log.steps:
        if since < st.end <= peak:
            for t in got:
                got[t] += st.service.get(t, 0.0) / res.log.weights[t]
    behind = min(got, key=lambda t: (got[t], t))
    t1 = res.window[1]
    waits = [(r.admitted if r.admitted is not None else t1) - r.arrival for r in res.log.requests.values()
             if r.tenant_id == behind and r.arrival <= peak and (r.admitted is None or r.admitted >= since)]
    return (behind, max(waits)) if waits else None


SKEW_RUNS = (  # label, policy, routing, pool counters
    ("per-worker VTC", "vtc", "prefix", False),
    ("fair", "vtc", "fair", True),
    ("FCFS", "fcfs", "prefix", False),
)
SKEW_SINGLE = "single-worker VTC (pool capacity)"
SKEW_QUARTER = "one worker VTC (1/N of the traffic)"
SKEW_SHAPED = "one worker VTC, the pool's shape (Nx slots)"


SKEW_LABELS = tuple(label for label, *_ in SKEW_RUNS) + (SKEW_SINGLE, SKEW_QUARTER, SKEW_SHAPED)
CHECKED = ("per-worker VTC", "fair", "FCFS", SKEW_SINGLE)  # the rows `skew_checks` and `side_by_side` read


def run_skew(time_model: IterationTimeModel, rate_scale: float, *, seed: int = 0, workload=SKEWED_OVERLOAD,
             workers: int = 4, progress=None, labels=SKEW_LABELS) -> dict[str, SkewRow]:
    """The skew experiment (module docstring). `rate_scale`: the fairness benchmark's (capacity /
    the reference 2 req/s). labels: the runs to make (default all six, `SKEW_LABELS`; `CHECKED`:
    the four the checks read). Returns rows by label, in `SKEW_LABELS` order. Raises ValueError for
    an unknown label."""
    unknown = set(labels) - set(SKEW_LABELS)
    if unknown:
        raise ValueError(f"unknown skew runs {sorted(unknown)}; known: {SKEW_LABELS}")
    rows = {}
    for label, policy, routing, pool in SKEW_RUNS:
        if label not in labels:
            continue
        res = run_pool(workload, policy, time_model, workers=workers, routing=routing, seed=seed,
                       rate_scale=rate_scale, drain_s=0.0, pool_counters=pool)
        rows[label] = _skew_row(label, res)
        if progress:
            progress(f"pool skew {label:<16} max weighted difference {rows[label].diff:10.0f} units")
    def one_worker(label: str, tm: IterationTimeModel, scale: float, **engine) -> None:
        """A single-worker reference run: VTC on one worker of model `tm` at `scale`."""
        res = run_pool(workload, "vtc", tm, workers=1, routing="least-loaded", seed=seed, rate_scale=scale,
                       drain_s=0.0, **engine)
        rows[label] = _skew_row(label, res)

    if SKEW_SINGLE in labels:
        eq = single_worker_equivalent(workers, time_model, "vtc", workload)
        one_worker(SKEW_SINGLE, eq["time_model"], rate_scale, num_kv_blocks=eq["num_kv_blocks"])
    if SKEW_QUARTER in labels:
        one_worker(SKEW_QUARTER, time_model, rate_scale / workers)
    if SKEW_SHAPED in labels:
        shaped = pool_shaped_worker(workers, time_model, "vtc", workload)
        one_worker(SKEW_SHAPED, shaped.pop("time_model"), rate_scale, **shaped)
    return rows


def run_pool_benchmark(time_model: IterationTimeModel, rate_scale: float, *, seed: int = 0, load: float = 0.8,
                       workers: tuple[int, ...] = (4, 8), duration_s: float = 300.0, progress=None) -> PoolBench:
    """Both experiments (module docstring)."""
    pb = PoolBench(time_model, seed, load, duration_s, skew_scale=rate_scale)
    for n in workers:
        pb.locality[n], pb.scales[n] = run_locality(time_model, n, seed=seed, load=load, duration_s=duration_s,
                                                    progress=progress)
    pb.skew = run_skew(time_model, rate_scale, seed=seed, workers=pb.skew_workers, progress=progress)
    return pb


def side_by_side(pb: PoolBench) -> str:
    """One line: the pool-wide max weighted service difference and Jain's index of per-worker VTC,
    ``fair``, FCFS and single-worker VTC at the pool's capacity, side by side."""
    names = {SKEW_SINGLE: "single-worker VTC"}
    return (f"pool skew, {pb.skew_workers} workers: max weighted diff / Jain: "
            + " | ".join(f"{names.get(k, k)} {pb.skew[k].diff:,.0f} / {pb.skew[k].jain:.3f}" for k in CHECKED))


def checks(pb: PoolBench) -> list[str]:
    """CHECK lines of the pool section."""
    out = []
    for n, rows in pb.locality.items():
        single, ll = rows[SINGLE], rows["least-loaded"]
        for routing in ("prefix", "fair"):
            r = rows[routing]
            ratio = r.hit_rate / single.hit_rate
            out.append(f"CHECK pool {n} workers {routing}: hit rate {r.hit_rate:.3f} = {ratio:.2f} of one worker's "
                       f"{single.hit_rate:.3f} at the same total KV (want >= 0.90): {'PASS' if ratio >= 0.9 else 'FAIL'}")
            q = r.queue_p99_s / ll.queue_p99_s
            out.append(f"CHECK pool {n} workers {routing}: p99 queue {r.queue_p99_s:.3f} s = {q:.2f}x least-loaded's "
                       f"{ll.queue_p99_s:.3f} s (want <= 1.2x): {'PASS' if q <= 1.2 else 'FAIL'}")
    if pb.skew:
        fair, per, single = pb.skew["fair"], pb.skew["per-worker VTC"], pb.skew[SKEW_SINGLE]
        ok = skew_checks(pb.skew)
        out.append(f"CHECK pool skew: fair max difference {fair.diff:.0f} = {fair.diff / max(single.diff, 1e-9):.1f}x "
                   f"single-worker VTC's {single.diff:.0f} (want <= 2x): {'PASS' if ok['within 2x'] else 'FAIL'}")
        out.append(f"CHECK pool skew: fair max difference {per.diff / max(fair.diff, 1e-9):.1f}x below per-worker "
                   f"VTC's {per.diff:.0f} (want >= 10x): {'PASS' if ok['10x below'] else 'FAIL'}")
    return out


def skew_checks(rows: dict[str, SkewRow]) -> dict[str, bool]:
    """The skew experiment's two checks on `run_skew`'s rows: ``within 2x`` (fair's max difference
    <= 2x single-worker VTC's at the pool's capacity) and ``10x below`` (per-worker VTC's >= 10x fair's)."""
    fair, per, single = rows["fair"], rows["per-worker VTC"], rows[SKEW_SINGLE]
    return {"within 2x": fair.diff <= 2 * single.diff, "10x below": per.diff >= 10 * fair.diff}


def lines(pb: PoolBench) -> list[str]:
    """The printed figures of the pool section, then its checks."""
    out = [f"pool: shared-system-prompts over {pb.duration_s:g} s at {pb.load:.0%} load (rate scale per pool size: "
           + ", ".join(f"{n} workers {s:.4f}" for n, s in pb.scales.items()) + ")"]
    for n, rows in pb.locality.items():
        for key in (SINGLE,) + ROUTINGS:
            r = rows[key]
            name = f"one worker x{n}" if key == SINGLE else key
            out.append(f"  {n} workers {name:<14} hit rate {r.hit_rate:.3f}  queue p99 {r.queue_p99_s:.3f} s "
                       f"mean {r.queue_mean_s:.3f} s  finished {r.finished}  spills {r.spills}")
    if pb.skew:
        out.append(f"pool skew: {SKEWED_OVERLOAD.base.description} (rate scale {pb.skew_scale:.4f})")
        out.append("  " + side_by_side(pb))
        for r in pb.skew.values():
            out.append(f"  {r.label:<36} max weighted diff {r.diff:9.0f} units  Jain {r.jain:.3f}  "
                       f"(second half {r.diff_late:.0f} / {r.jain_late:.3f})  spills {r.spills}  "
                       f"hand-backs {r.handed_back}"
                       + (f"  [{r.where()}]" if r.witness else ""))
    return out + checks(pb)


def section(pb: PoolBench) -> list[str]:
    """The markdown section."""
    w = base_workload(SHARED_SYSTEM_PROMPTS)
    out = ["## A pool of workers", "",
           "N simulated workers behind the gateway's own routing code (`gateway/routing_policy.py`, the module the "
           "gateway runs), on one virtual time line (`loadtests/sim/pool.py`). With `fair` routing the workers order by "
           "pool-wide counters exchanged every 0.1 s of virtual time (`worker/scheduling/pool.py`) and the router "
           "spills a tenant queued at its affine worker to spare capacity or to where its pool-wide counter puts "
           "it first in line, and a worker hands back a queued request it never admitted and has no room for "
           "(after 0.5 s, when the board shows a worker likely to start it sooner: `worker/scheduling/handback.py`), "
           "which the router sends elsewhere; `prefix` and `least-loaded` run each worker's own VTC. "
           "The single-worker reference is one worker N times as fast with N times the KV pool (the same total "
           "capacity and KV).", "",
           f"### Locality: {w.name} at {pb.load:.0%} load", "",
           f"{w.description}; played over {pb.duration_s:g} s at the same rates. Load = offered requests over "
           "N times one worker's saturated throughput for the mean request, prefix hits not counted. Hit rate = "
           "cached prompt tokens / prompt tokens, pool-wide.", ""]
    head = ["workers", "routing", "hit rate", "vs one worker", "queue p99 s", "vs least-loaded", "queue mean s",
            "finished", "spills"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, rows in pb.locality.items():
        single, ll = rows[SINGLE], rows["least-loaded"]
        for key in (SINGLE,) + ROUTINGS:
            r = rows[key]
            name = f"one worker ×{n}" if key == SINGLE else f"`{key}`"
            out.append(f"| {n} | {name} | {r.hit_rate:.3f} | {r.hit_rate / single.hit_rate:.2f} | {r.queue_p99_s:.3f} | "
                       f"{r.queue_p99_s / ll.queue_p99_s:.2f}× | {r.queue_mean_s:.3f} | {r.finished} | {r.spills} |")
    if pb.skew:
        sw = SKEWED_OVERLOAD.base
        out += ["", f"### Fairness under skew: {sw.name}, {pb.skew_workers} workers", "",
                f"{sw.description}. Tenants: " + ", ".join(f"{t.tenant_id} ({t.rate:g} req/s)" for t in sw.tenants)
                + f"; {sw.duration_s:g} s; rate scale {pb.skew_scale:.4f}. Max diff = pool-wide max weighted service "
                "difference over co-backlogged intervals (a tenant is backlogged while any of its requests, on any "
                "worker, is queued or prefilling).", ""]
        head = ["run", "max diff (units)", "Jain", "max diff, 2nd half", "Jain, 2nd half", "spills", "hand-backs",
                "hit rate", "where the max diff builds up"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in pb.skew.values():
            out.append(f"| {r.label} | {r.diff:,.0f} | {r.jain:.3f} | {r.diff_late:,.0f} | {r.jain_late:.3f} | "
                       f"{r.spills} | {r.handed_back} | {r.hit_rate:.3f} | {r.where()} |")
    out += ["", "```", side_by_side(pb), *checks(pb), "```", "",
            "What is left of the difference under `fair` comes from the batches filling (the \"where\" column): "
            "while they fill nobody queues, so each tenant holds slots in proportion to its arrivals (a tenant alone "
            "on a worker holds that whole worker), and those slots turn over only as their long decodes finish "
            "(N workers hold N times the running requests of one, so this takes N times as long as on one worker "
            "with the pool's capacity); the pool-wide counters then make the tenants that led give way, and "
            "hand-back moves the queued requests of the tenants owed service to where they are first in line. "
            "See docs/architecture.md, \"What fair means across a pool\".", ""]
    return out


__all__ = ["PoolBench", "SkewRow", "checks", "skew_checks", "lines", "run_locality", "run_pool_benchmark", "run_skew", "section", "side_by_side"]
