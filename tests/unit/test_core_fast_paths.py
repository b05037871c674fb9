"""The scheduling core's fast structures make the same decisions as straightforward code.

The core keeps incremental structures so that an iteration's work follows what changed, not the
number of tenants (worker/scheduling/core.py, policy.py): VTC's lift reads a per-tier backlog index
(a lazy min-heap of counters) instead of scanning every account; an idle tenant reads the index's
per-tier count; the lower tier owed its minimum share finds its first head on the tier's candidate
heap; the partial-prefill heap is built from the tenants admitted with prefill to do, not from the
running set; the "no free slot" answer is cached until a slot or a hold changes; VTC keys are
computed without finding the tenant's head; the decodes an iteration keeps are marked in place and
collected in one pass, and `water_fill` skips the whole-share pass when no share reaches one slot.

Here a reference scheduler has each of those replaced by the plain scan it stands for, and the
same random trace (tenants in random tiers and weights, arrivals, cancels, steps, pool sizes,
policies, the lower-tier token target) is driven through both: every iteration must schedule the
same chunks, preempt the same requests for the same reasons, and leave the same counters.
"""

from __future__ import annotations

import types

from hypothesis import HealthCheck, given, settings, strategies as st

from tests.unit.sched_steps import step as sched_step
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence
from worker.scheduling import decode_share
from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import TIERS, BacklogIndex, TenantAccount, make_policy

BETA = 2.0


# ---- the straightforward versions ------------------------------------------------------------------
def _ref_lift_floor(policy, tenant_id, tier):
    """VTC's lift floor by scanning every account (what `BacklogIndex` replaces)."""
    others = [a.virtual_counter for a in policy.accounts.values()
              if a.tenant_id != tenant_id and a.tier == tier and (a.backlogged or a.tenant_id in policy._elsewhere)]
    return min(others) if others else policy._last_counter_by_tier.get(tier, 0.0)


def _ref_on_idle(policy, tenant_id):
    acct = policy.accounts.get(tenant_id)
    if acct is not None and acct.backlogged:
        acct.backlogged = False
        if not any(a.backlogged and a.tier == acct.tier for a in policy.accounts.values()):
            policy._last_counter_by_tier[acct.tier] = acct.virtual_counter


def _ref_partial_heap(core, tier):
    """The partial-prefill candidates from a scan of the whole running set, as a sorted list (a
    sorted list is a heap), built once per round: every tenant with a running request that has
    prefill left beyond this round's slices, then every slot holder with queued work, leaving out
    the tenants taken out this round and the one holding the turn."""
    if core._partial_heaps is None:
        left, alloc = core.executor.prefill_left, core._alloc
        states = {e.tenant.tenant_id: e.tenant for e in core.running.values()
                  if left(e.handle) - alloc.get(e.request_id, 0) > 0}
        states.update({t: core.tenants[t] for t in core._slot_holders()
                       if t not in states and t in core.tenants and core.tenants[t].waiting})
        for t in {*core._out, *((core._sticky.tenant_id,) if core._sticky is not None else ())}:
            states.pop(t, None)
        core._partial_heaps = {t: sorted((core._key(ts), tid) for tid, ts in states.items() if ts.sched_tier == t)
                               for t in TIERS}
    return core._partial_heaps[tier]


_WATER_FILL = decode_share.water_fill  # the real one (`_ref_plan_iteration` swaps the module's name)


def _ref_water_fill(demand, weight, capacity, first=None):
    """Weighted max-min water-filling, every pass made (what `decode_share.water_fill` shortcuts)."""
    return _WATER_FILL(demand, weight, capacity, first, shortcuts=False)


def _ref_plan_iteration(core, decoding, budget):
    """`decode_share.plan_iteration` with the decodes collected through an id set and the plain
    water-filling (the fast version marks them in place and collects them in one pass)."""
    fast_fill = decode_share.water_fill
    chosen = set()

    def fill(demand, weight, capacity, first=None):
        return _ref_water_fill(demand, weight, capacity, first)

    decode_share.water_fill = fill
    try:
        before = {id(e): e.last_decode for e in decoding}
        out, prefill = decode_share.plan_iteration(core, decoding, budget)
    finally:
        decode_share.water_fill = fast_fill
    chosen = {id(e) for e in out}
    assert all((before[id(e)] != core.iteration) for e in decoding), "a decode marked before its iteration"
    assert [e for e in decoding if id(e) in chosen] == out
    return out, prefill


def _ref_no_slot(core):
    led = core.ledger
    return led.running + sum(h.slots for h in led.holds if h.slots > 0) >= led.max_running


def reference(sched: Scheduler) -> Scheduler:
    """Swap the fast structures of `sched`'s core and policy for the plain scans."""
    core, policy = sched.core, sched.core.policy
    if hasattr(policy, "pool_lift_floor"):
        policy.pool_lift_floor = types.MethodType(_ref_lift_floor, policy)
    if policy.name != "drr":  # (DRR's own on_idle adds its deficit rule on top of the base one)
        policy.on_idle = types.MethodType(_ref_on_idle, policy)
    core._partial_heap = types.MethodType(_ref_partial_heap, core)
    core._no_slot = types.MethodType(_ref_no_slot, core)
    core.first_waiting_head = lambda tier: next(core.projected_heads(tier), None)
    core._key_uses_arrival = True
    core.plan_iteration = types.MethodType(_ref_plan_iteration, core)
    return sched


def _build(policy, blocks, chunk, max_running, lower_target, fast):
    cost = LinearCost(1.0, BETA)
    sched = Scheduler(make_policy(policy, cost), cost, BlockManager(blocks, 16), chunk, max_running,
                      returning_preemption=policy != "fcfs", lower_tier_token_target=lower_target)
    return sched if fast else reference(sched)


# a trace: ("arrive", tenant, prompt, output) | ("cancel", index) | ("steps", k)
event = st.one_of(st.tuples(st.just("arrive"), st.integers(0, 7), st.integers(1, 300), st.integers(1, 24)),
                  st.tuples(st.just("cancel"), st.integers(0, 1000)),
                  st.tuples(st.just("steps"), st.integers(1, 6)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_tenants=st.integers(2, 8), tiers=st.lists(st.sampled_from(TIERS), min_size=8, max_size=8),
       weights=st.lists(st.integers(1, 4), min_size=8, max_size=8), blocks=st.sampled_from([32, 64, 256]),
       chunk=st.sampled_from([64, 128]), max_running=st.sampled_from([2, 4, 8]),
       lower_target=st.sampled_from([None, 1, 4]), policy=st.sampled_from(["vtc", "vtc", "vtc-pred", "fcfs", "drr"]),
       trace=st.lists(event, min_size=5, max_size=60))
def test_fast_structures_decide_as_the_plain_scans(n_tenants, tiers, weights, blocks, chunk, max_running,
                                                  lower_target, policy, trace):
    fast, ref = (_build(policy, blocks, chunk, max_running, lower_target, f) for f in (True, False))
    logs = {id(fast): [], id(ref): []}
    for s in (fast, ref):
        s.core.subscribe(lambda v, why, req, _log=logs[id(s)]: _log.append((v.request_id, why)))
    live = {id(fast): [], id(ref): []}
    n = 0
    max_prompt = blocks * 16 // 2 - 32

    def step(s):
        chunks = sched_step(s)
        live[id(s)][:] = [q for q in live[id(s)] if not q.is_finished]
        return [(c.seq.request_id, c.num_tokens) for c in chunks]

    for ev in trace + [("steps", 400)]:
        if ev[0] == "arrive":
            n += 1
            t = ev[1] % n_tenants
            for s in (fast, ref):
                q = Sequence(f"r{n}", f"t{t}", [1000 + n] + [1] * (min(ev[2], max_prompt) - 1),
                             SamplingParams(max_tokens=ev[3]), weight=float(weights[t]), tier=tiers[t],
                             max_tokens=ev[3], cache_namespace=f"t{t}")
                s.add(q)
                live[id(s)].append(q)
        elif ev[0] == "cancel":
            if live[id(fast)]:
                i = ev[1] % len(live[id(fast)])
                for s in (fast, ref):
                    s.finish(live[id(s)].pop(i), FinishReason.ABORT)
        else:
            for _ in range(ev[1]):
                if not (fast.has_work() or ref.has_work()):
                    break
                it = fast.core.iteration + 1
                assert step(fast) == step(ref), f"iteration {it}: different chunks"
                assert logs[id(fast)] == logs[id(ref)], f"iteration {it}: different preemptions"
        counters = {t: a.virtual_counter for t, a in fast.policy.accounts.items()}
        assert counters == {t: a.virtual_counter for t, a in ref.policy.accounts.items()}
        assert {t: a.backlogged for t, a in fast.policy.accounts.items()} == \
               {t: a.backlogged for t, a in ref.policy.accounts.items()}
    assert not fast.has_work() and not ref.has_work()


@settings(max_examples=300, deadline=None)
@given(demand=st.dictionaries(st.sampled_from([f"t{i}" for i in range(12)]), st.integers(0, 9), max_size=12),
       weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0, 4.0]), min_size=12, max_size=12),
       capacity=st.integers(0, 40), waited=st.one_of(st.none(), st.lists(st.integers(-1, 5), min_size=12, max_size=12)))
def test_water_fill_is_the_plain_water_filling(demand, weights, capacity, waited):
    """`water_fill`'s shortcuts (no whole-share pass when no share reaches a slot; the fractional
    slots by tenant id while none is given) give what every pass of the plain version gives, with
    and without a `first` order for the fractional slots."""
    weight = {f"t{i}": w for i, w in enumerate(weights)}
    first = None if waited is None else {t: waited[int(t[1:])] for t in demand}
    got = decode_share.water_fill(demand, weight, capacity, first)
    assert got == _ref_water_fill(demand, weight, capacity, first)
    assert sum(got.values()) == min(capacity, sum(demand.values()))


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["arrive", "idle", "charge", "refund", "retier"]), st.integers(0, 9),
                              st.floats(0.0, 50.0), st.sampled_from(TIERS)), min_size=1, max_size=120))
def test_backlog_index_minimum_is_the_scan(ops):
    """`BacklogIndex.min_counter` and `count` against a scan of the accounts after every change
    (rising charges, falling refunds, tier changes, tenants going idle and coming back)."""
    accounts: dict[str, TenantAccount] = {}
    index = BacklogIndex(accounts)
    for op, i, x, tier in ops:
        tid = f"t{i}"
        a = accounts.setdefault(tid, TenantAccount(tid, tier=tier))
        if op == "arrive" and not a.backlogged:
            a.backlogged = True
            index.add(a)
        elif op == "idle" and a.backlogged:
            a.backlogged = False
            index.remove(a)
        elif op in ("charge", "refund"):
            a.virtual_counter += x if op == "charge" else -x
            if a.backlogged:
                index.changed(a)
        elif op == "retier":
            a.tier = tier
            if a.backlogged:
                index.changed(a)
        for t in TIERS:
            scan = [b.virtual_counter for b in accounts.values() if b.backlogged and b.tier == t]
            assert index.min_counter(t) == (min(scan) if scan else None)
            assert index.count[t] == len(scan)
