"""Hypothesis state machine over random arrivals, aborts and engine steps with KV quotas on (and
off) and the radix prefix cache on (and off): blocks in use always equal the blocks held by
requests plus those only the cache holds, never negative; a block in two tables is a cached one
whose reference count is the number of tables holding it, a private block is in one table; no leak
once every request has ended and the cache is flushed; a tenant within its soft quota is never
preempted while an over-quota tenant holds blocks. Every mode must drain without a stall.

Prompts are drawn from a few shared prefixes (per tenant namespaces, one salt shared by two
tenants' namespaces never), so cache hits, splits and evictions happen."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from worker.cache.radix import RadixCache
from tests.unit.sched_steps import CancelAndStepRules
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import make_policy
from worker.scheduling.quota import KVQuota, KVQuotaConfig

BLOCKS = 40
TENANTS = ("a", "b", "c")
# shared prompt beginnings (tokens), so that requests hit, split and evict cached prefixes
PREFIXES = [[(7 * j) % 97 + 1 for j in range(300)], [(7 * j) % 97 + 1 for j in range(40)] + [5] * 260, [3] * 300]


class KVMachine(CancelAndStepRules, RuleBasedStateMachine):
    @initialize(quota=st.booleans(), budget=st.sampled_from([32, 128, 512]),
                soft=st.sampled_from([{}, {"a": 0.05, "b": 0.05, "c": 0.05}, {"a": 0.6}]),
                cache=st.booleans(), public=st.booleans())
    def setup(self, quota, budget, soft, cache, public):
        radix = RadixCache(16, public_prefixes=[PREFIXES[0][:40]] if public else []) if cache else None
        self.bm = BlockManager(BLOCKS, 16, cache=radix)
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
          weight=st.sampled_from([1.0, 2.0]), prefix=st.integers(0, len(PREFIXES) - 1), salt=st.sampled_from(["", "s"]))
    def arrive(self, tenant, prompt, out, weight, prefix, salt):
        self.n += 1
        tokens = (PREFIXES[prefix] + [self.n + 1000] * prompt)[:prompt]
        s = Sequence(f"p{self.n}", tenant, tokens, SamplingParams(max_tokens=out), weight=weight,
                     max_tokens=out, cache_namespace=tenant + "/" + salt)
        self.sched.add(s)
        self.live.append(s)

    def _step(self):
        for c in self.sched.schedule():
            s = c.seq
            s.num_computed_tokens += c.num_tokens
            self.bm.cache_computed(s)
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
        cache = self.bm.cache
        cached = set(cache._refs) if cache is not None else set()
        held = set(tables)
        # blocks in use (not on the free list) == blocks held by requests + blocks only the cache holds
        assert BLOCKS - self.bm.num_free_list == len(held | cached)
        assert self.bm.num_used == len(held)  # referenced blocks; evictable cached ones count as free
        assert 0 <= self.bm.num_free_list <= self.bm.num_free and self.bm.num_used >= 0
        for b in held - cached:
            assert tables.count(b) == 1  # a private block is in one table only
        if cache is not None:
            cache.check()
            for b in cached:
                assert cache.refcount(b) == tables.count(b) >= 0
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
        self.bm.flush_cache()
        assert self.bm.num_free_list == BLOCKS and self.bm.num_cached == 0


KVMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestKVQuotaStateMachine = KVMachine.TestCase


# The trace the state machine found (consecutive step rules merged): a number is that many engine
# steps; tenant/prompt/out/weight/prefix/salt is one arrival.
RECLAIM_LIVELOCK = """1 a/178/45/1/0/ 5 a/403/48/1/0/ 3 a/4/42/1/0/ 30 c/494/33/2/2/ c/388/8/2/2/ 3
c/287/34/1/0/ 13 c/442/60/1/1/ 6 a/296/45/1/1/s 1 a/447/47/2/2/s 2 b/434/22/1/1/ 6"""


def replay(machine: KVMachine, trace: str) -> None:
    """Run a trace written as RECLAIM_LIVELOCK is on `machine` (already set up)."""
    for word in trace.split():
        if word.isdigit():
            machine.steps(k=int(word))
            continue
        tenant, prompt, out, weight, prefix, salt = word.split("/")
        machine.arrive(tenant=tenant, prompt=int(prompt), out=int(out), weight=float(weight),
                       prefix=int(prefix), salt=salt)


def test_reclaimed_room_goes_to_the_tenant_it_was_reclaimed_for():
    """Regression (found by the state machine): reclaim preempted an over-quota tenant's request for
    a within-quota tenant's head, but a third tenant's burst took the freed blocks first; the
    next iteration reclaimed from that one, and so on: a livelock with no request finishing. The
    room made by reclaim is now held for the tenant it was made for during that iteration."""
    m = KVMachine()
    m.setup(quota=True, budget=32, public=True, cache=False, soft={'a': 0.6})
    replay(m, RECLAIM_LIVELOCK)
    m.teardown()  # asserts that everything drains and nothing leaks
