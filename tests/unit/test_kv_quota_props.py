"""Hypothesis state machine over random arrivals, aborts and engine steps with KV quotas on (and
off): blocks in use always equal the blocks held by requests (the reference engine has no shared
prefix cache, so the cache holds none), never negative, no block in two tables, no leak once every
request has ended; a tenant within its soft quota is never preempted while an over-quota tenant
holds blocks. Both quota modes must drain without a stall."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import make_policy
from worker.scheduling.quota import KVQuota, KVQuotaConfig

BLOCKS = 40
TENANTS = ("a", "b", "c")


class KVMachine(RuleBasedStateMachine):
    @initialize(quota=st.booleans(), budget=st.sampled_from([32, 128, 512]),
                soft=st.sampled_from([{}, {"a": 0.05, "b": 0.05, "c": 0.05}, {"a": 0.6}]))
    def setup(self, quota, budget, soft):
        self.bm = BlockManager(BLOCKS, 16)
        self.q = KVQuota(KVQuotaConfig(enabled=quota, soft=soft), BLOCKS)
        self.sched = Scheduler(make_policy("vtc"), LinearCost(), self.bm, budget, 8, quota=self.q)
        self.n = 0
        self.live: list[Sequence] = []
        self.bad_preemptions = []
        orig = self.sched._preempt
        sched, q = self.sched, self.q

        def record(victim):
            if sched.quota is not None:
                held = sched.held_by_tenant()
                over = {t for t, b in held.items() if q.over_soft(t, b)}
                if over and victim.tenant_id not in over:
                    self.bad_preemptions.append((victim.tenant_id, held))
            orig(victim)

        self.sched._preempt = record

    @rule(tenant=st.sampled_from(TENANTS), prompt=st.integers(1, 500), out=st.integers(1, 60),
          weight=st.sampled_from([1.0, 2.0]))
    def arrive(self, tenant, prompt, out, weight):
        self.n += 1
        s = Sequence(f"p{self.n}", tenant, [1] * prompt, SamplingParams(max_tokens=out), weight=weight,
                     max_tokens=out)
        self.sched.add(s)
        self.live.append(s)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def abort(self, i):
        s = self.live.pop(i % len(self.live))
        self.sched.finish(s, FinishReason.ABORT)

    @rule(k=st.integers(1, 8))
    def steps(self, k):
        for _ in range(k):
            self._step()

    def _step(self):
        for c in self.sched.schedule():
            s = c.seq
            s.num_computed_tokens += c.num_tokens
            if s.num_computed_tokens == s.num_tokens:
                s.output_token_ids.append(7)
                if len(s.output_token_ids) >= s.max_tokens:
                    self.sched.finish(s, FinishReason.LENGTH)
        self.live = [s for s in self.live if not s.is_finished]

    @invariant()
    def blocks_balance(self):
        if not hasattr(self, "sched"):
            return
        tables = [b for s in self.sched.by_id.values() for b in s.block_table]
        assert len(tables) == len(set(tables)) == self.bm.num_used
        assert 0 <= self.bm.num_free and self.bm.num_used >= 0
        for s in self.sched.by_id.values():
            if s.status is SequenceStatus.WAITING:
                assert not s.block_table
        assert not self.bad_preemptions

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(20000):  # everything still queued completes (no deadlock), then nothing leaks
            if not self.sched.has_work():
                break
            self._step()
        assert not self.sched.has_work(), "scheduler stalled"
        assert self.bm.num_used == 0 and self.bm.num_free == BLOCKS


KVMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestKVQuotaStateMachine = KVMachine.TestCase
