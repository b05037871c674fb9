"""Parity: the same scripted workloads through the reference scheduler and through SGLang 0.5.23's
own scheduler (with the FairShare plugin) on CPU must make the same decisions.

Executors: `tests/parity/reference_driver.py` (worker/engine/scheduler.py, fake runner) and
`tests/sglang/sglang_driver.py` (SGLang's `Scheduler` loop, `SchedulePolicy`, `PrefillAdder`,
`RadixCache`, retraction, batch-result processing; fake forward). Workloads:
`tests/parity/workloads.py`. Figures: `.venv-sglang/bin/python -m tests.sglang.parity_report`.

Two checks per workload:

- **Admission order, iteration by iteration**, against the reference run at SGLang's prefill
  granularity (`prefill_slice` = the iteration's chunk). Where this is the right comparison: SGLang's
  `PrefillAdder` (`add_one_req` in `Scheduler._get_new_batch_prefill_raw`, scheduler.py l. 4199-4300)
  admits whole requests in waiting-queue order, truncating only the last one, and keeps one
  chunked request (`Scheduler.chunked_req`), continued first in the next pass (l. 4160-4167,
  `PrefillAdder.add_chunked_req`); it cannot hand an iteration's budget out in 16-token slices
  among tenants as the reference does by default. At `prefill_slice` = chunk the reference picks
  whole requests too, so the same decisions give the same admitted lists.
- **Per-tenant service within 5 %**, against the reference at its defaults (16-token slices), where
  SGLang's batching differs by design: each tenant's share of the service the backlogged tenants
  received, in each quarter of the workload's backlog window, within 5 % (relative) of the
  reference's. Slicing changes which request runs in which iteration, not (under a working
  policy) who gets how much over tens of iterations.

Plus the tiers workload against DESIGN itself (strict priority with a minimum share), on both
executors, and DRR on SGLang (the plugin's DRR never grants a quantum).

The plugin delegates every decision to the scheduling core (FairShareState.begin_pass runs the
core's iteration; FairSharePrefillAdder carries out its plan). Cases that still differ are marked
`xfail(strict=True)` with the SGLang 0.5.23 limit behind them (docs/sglang-backend.md, "cannot"):
when one starts passing, strict xfail fails the run, and the mark must be removed.
"""

from __future__ import annotations

import pytest

from tests.parity.reference_driver import run_reference
from tests.parity.trace import compare, share_error, split_window
from tests.parity.workloads import TIERS_WORKLOAD, WORKLOADS
from tests.sglang.sglang_driver import run_sglang

TOLERANCE = 0.05   # relative error on a tenant's service share
PARTS = 4          # the backlog window is compared quarter by quarter

_cache: dict[tuple, object] = {}


def trace(executor: str, workload: str, policy: str = "vtc", **options):
    """Each run once per session (the drivers are deterministic)."""
    key = (executor, workload, policy, tuple(sorted(options.items())))
    if key not in _cache:
        w = WORKLOADS[workload]
        _cache[key] = (run_sglang if executor == "sglang" else run_reference)(w, policy, **options)
    return _cache[key]


# ---- what blocks each case today (figures: tests.sglang.parity_report, VTC) ------------------------
# Each cause was isolated by removing it in a scratch run (the plugin's projection given the chunked
# request's prefill; the reference without returning-tenant preemption): see docs/sglang-backend.md.
CHUNK_ESTIMATE = ("FairShareState.order_waiting (AFTER SchedulePolicy.calc_priority) projects a tenant's counter "
                  "over its waiting requests only, leaving out the prefill of Scheduler.chunked_req, which "
                  "PrefillAdder.add_chunked_req schedules first in the same pass")
CHUNK_FIRST = ("SGLang continues Scheduler.chunked_req before any waiting request (PrefillAdder.add_chunked_req, "
               "called unconditionally in _get_new_batch_prefill_raw), where the reference pauses a partial "
               "prefill whose tenant's counter is higher and serves the lower one first")
NO_RETURNING = ("the plugin has no returning-tenant preemption: the reference preempts an over-share tenant's newest "
                "request for a returning tenant below its slot share (worker.scheduling.returning); SGLang retracts "
                "only when decode runs out of KV (ScheduleBatch.retract_decode)")
MEMORY_ADMISSION = ("SGLang admits only within room for the running requests' remaining decode tokens times "
                    "new_token_ratio (PrefillAdder.__init__: memory_budget.total_offset), stops the prefill loop at "
                    "a head that does not fit (AddReqResult.NO_TOKEN -> break: 6 times at a flood head with victims "
                    "queued behind) and then latches running_batch.batch_is_full until a request leaves (237 "
                    "iterations with victims waiting and nothing admitted); the reference admits when the prefill "
                    "fits now, skips a head that does not (EligibilityGate) and preempts on decode shortage (3 "
                    "victim preemptions; SGLang retracts none)")

ORDER_BLOCKERS = {
    "tiers": ("first difference at iteration 1 (75 % of iterations equal): the reference admits an interactive head "
              "while a lower tier's partial prefill is paused and a second request is truncated; SGLang keeps one "
              "Scheduler.chunked_req (_get_new_batch_prefill_raw asserts it before taking the adder's "
              "new_chunked_req), so FairSharePrefillAdder refuses the second partial prefill "
              "(docs/sglang-backend.md, cannot 1)"),
    "memory-flood": ("first difference at iteration 3 (75 % equal): the reference gives a victim request the rest "
                     "of the chunk while flood's partial prefill is paused; SGLang keeps one Scheduler.chunked_req, so "
                     "FairSharePrefillAdder refuses the second partial prefill (cannot 1: 11 of the 25 planned "
                     "admissions SGLang did not carry out); the other 14 are PrefillAdder.add_one_req answering "
                     "NO_TOKEN: beside the decode reserve the core is told, SGLang's budget reserves each admission's "
                     "own max_new_tokens plus a page (PrefillAdder._update_prefill_budget, cannot 4); telling the "
                     "core that too (admission need + max_new + a page) made the shares worse (34-36 %)"),
}
SERVICE_BLOCKERS = {
    "on-off": ("6.8 % in iterations 141-199 against the reference's 16-token slices (at SGLang's granularity the "
               "order is identical): SGLang's fairness granularity is a request's chunk (cannot 1)"),
    "tiers": ("14.8 % in iterations 8-55 (background 0.044 vs 0.038 of service): the refused second partial "
              "prefill (cannot 1) shifts background's minimum-share slices"),
    "memory-flood": ("12.1 % in iterations 86-157 (flood 0.423 vs 0.474; the other quarters 0.5 %, 4.7 %, 3.6 %): "
                     "the core is told SGLang's decode reserve for the running batch (FairShareState.free_blocks, "
                     "PrefillAdder.__init__ memory_budget.total_offset), but SGLang still refuses planned victim "
                     "admissions for their own max_new_tokens (cannot 4) and retracts none of the reference's 3 "
                     "victim preemptions"),
}


def _case(name: str, blockers: dict[str, str]):
    if name in blockers:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=blockers[name]))
    return name


PARITY = ("overload", "weighted", "on-off", "tiers", "memory-flood")


@pytest.mark.parametrize("name", [_case(n, ORDER_BLOCKERS) for n in PARITY])
def test_admission_order_matches_reference_iteration_by_iteration(name):
    w = WORKLOADS[name]
    ref = trace("reference", name, prefill_slice=w.engine.chunk_tokens)
    sgl = trace("sglang", name)
    d = compare(ref, sgl)
    assert d.first_order_difference is None, (
        f"{name}: iteration {d.first_order_difference}: reference admitted "
        f"{ref.records[d.first_order_difference].admitted}, SGLang "
        f"{sgl.records[d.first_order_difference].admitted}\n{d.describe()}")


@pytest.mark.parametrize("name", [_case(n, SERVICE_BLOCKERS) for n in PARITY])
def test_service_shares_match_reference_within_5_percent(name):
    w = WORKLOADS[name]
    ref, sgl = trace("reference", name), trace("sglang", name)
    first, last = w.backlog_window
    for t in (ref, sgl):  # the window means what it says in both runs
        assert t.backlog_end(first, w.backlogged) >= last, (
            f"{t.executor}: some of {w.backlogged} ran out of queued work before iteration {last}")
    d = compare(ref, sgl, w.backlog_window, w.backlogged, parts=PARTS)
    bad = [(win, err) for win, err in zip(d.windows, d.share_errors) if err > TOLERANCE]
    assert not bad, f"{name}: share error over {TOLERANCE:.0%} in {bad}\n{d.describe()}"


# ---- tiers against DESIGN ("Tiers": strict priority, 5 % minimum share) -----------------------------
def _tier_violations(t) -> list[str]:
    """What the trace does against DESIGN's tiers on the tiers workload: an interactive request that
    waited more than one iteration for admission while lower tiers ran, a background share outside
    [4 %, 15 %] of the window's service (its 5 % minimum, less one chunk's worth, and no more than a
    minimum share's neighbourhood while batch is backlogged), or batch not ahead of background."""
    w = TIERS_WORKLOAD
    arrival = {r.request_id: r.arrival_iter for r in w.requests}
    admitted_at: dict[str, int] = {}
    for i, rec in enumerate(t.records):
        for rid in rec.admitted:
            admitted_at.setdefault(rid, i)
    out = []
    late = [(rid, admitted_at.get(rid, len(t.records)) - arrival[rid]) for rid in arrival
            if rid.startswith("inter-") and admitted_at.get(rid, len(t.records)) - arrival[rid] > 1]
    if late:
        out.append(f"interactive requests waited > 1 iteration: {late[:5]} ({len(late)} in all)")
    shares = t.service_shares(*w.backlog_window, [x.tenant_id for x in w.tenants])
    if not 0.04 <= shares["bg"] <= 0.15:
        out.append(f"background share {shares['bg']:.3f} outside [0.04, 0.15]")
    if shares["batch"] < 3 * shares["bg"]:
        out.append(f"batch share {shares['batch']:.3f} not strictly ahead of background {shares['bg']:.3f}")
    return out


@pytest.mark.parametrize("executor", ["reference", "sglang"])  # both: the scheduling core's tiers
def test_tiers_follow_design(executor):
    violations = _tier_violations(trace(executor, "tiers"))
    assert not violations, "\n".join(violations)


# ---- DRR: quanta are granted in SGLang as in the reference --------------------------------------------
def test_drr_alternates_heads_in_sglang():
    """Weighted DRR (quantum 512 units per unit of weight): a round gives w1 (weight 1) about two
    192/32 requests' worth, w3 (weight 3) six; so w3 must be admitted among the first six requests,
    as in the reference, and w3 must end up with more service than w1 over the backlog window."""
    w = WORKLOADS["weighted"]
    ref, sgl = trace("reference", "weighted", "drr"), trace("sglang", "weighted", "drr")
    assert any(r.startswith("w3-") for r in ref.first_admissions()[:6]), ref.first_admissions()[:8]
    assert any(r.startswith("w3-") for r in sgl.first_admissions()[:6]), sgl.first_admissions()[:8]
    shares = sgl.service_shares(*w.backlog_window, w.backlogged)
    assert shares["w3"] > shares["w1"], shares


# ---- the comparison itself --------------------------------------------------------------------------
def test_comparison_detects_a_changed_admission_and_a_share_shift():
    """The checks above can fail: a copy of a trace with one admission moved, or one tenant's
    service doubled in a quarter, is reported as such."""
    import copy

    ref = trace("reference", "overload")
    same = compare(ref, copy.deepcopy(ref), WORKLOADS["overload"].backlog_window, ("a", "b"))
    assert same.first_order_difference is None and same.max_share_error == 0.0
    moved = copy.deepcopy(ref)
    i = next(k for k, rec in enumerate(moved.records) if len(rec.admitted) >= 2)
    moved.records[i].admitted.reverse()
    assert compare(ref, moved).first_order_difference == i
    shifted = copy.deepcopy(ref)
    first, last = split_window(WORKLOADS["overload"].backlog_window, PARTS)[1]
    gain = shifted.records[last].service["b"] - shifted.records[first].service["b"]
    for rec in shifted.records[last:]:
        rec.service["b"] += gain
    d = compare(ref, shifted, WORKLOADS["overload"].backlog_window, ("a", "b"))
    assert d.share_errors[1] > TOLERANCE and d.share_errors[0] == 0.0
    assert share_error({"a": 0.5, "b": 0.5}, {"a": 0.52, "b": 0.48}) == pytest.approx(0.04)
