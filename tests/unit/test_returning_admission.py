"""Fast admission for returning tenants (worker/scheduling/returning.py) on the real Scheduler.

Tenant `a` fills every running slot with long decodes; tenant `b` returns. With the rule, `b`'s
head gets a slot within two iterations by preempting `a`'s latest admission; without it, `b` waits
for one of `a`'s requests to finish. Continuously backlogged tenants never trigger it, FCFS never
uses it (the engine turns it off), and nobody is pushed below their slot share.
"""

import pytest

from tests.unit.sched_steps import step
from worker.engine.block_manager import BlockManager
from worker.engine.engine import Engine, EngineConfig
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import make_policy
from worker.scheduling.returning import ReturningAdmission
from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock

_n = [0]


def seq(tenant, prompt_len=32, max_tokens=200, weight=1.0, tier="interactive"):
    _n[0] += 1
    return Sequence(f"r{_n[0]}", tenant, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    weight=weight, tier=tier, max_tokens=max_tokens)


def saturated(policy="vtc", returning=True, max_running=8, blocks=4000, a_requests=20):
    sched = Scheduler(make_policy(policy), LinearCost(), BlockManager(blocks, 16), 512, max_running,
                      returning_preemption=returning)
    for _ in range(a_requests):
        sched.add(seq("a"))
    for _ in range(5):
        step(sched)
    assert sum(s.tenant_id == "a" for s in sched.running) == min(max_running, a_requests)  # a holds the pool
    return sched


def iterations_until_running(sched, s, limit=300):
    for i in range(1, limit + 1):
        step(sched)
        if s.status is not SequenceStatus.WAITING:
            return i
    return None


def test_returning_tenant_gets_a_slot_at_once_by_preempting_the_latest_admission():
    sched = saturated()
    newest_a = sched.running[-1]
    b = seq("b")
    sched.add(b)
    assert iterations_until_running(sched, b) <= 2
    assert newest_a.num_preemptions == 1 and newest_a.status is SequenceStatus.WAITING
    assert sched.waiting["a"][0] is newest_a          # re-admitted before a's newer work
    assert sched.returning.preemptions == 1


def test_without_the_rule_the_returning_tenant_waits_for_a_slot_to_free():
    sched = saturated(returning=False)
    b = seq("b")
    sched.add(b)
    waited = iterations_until_running(sched, b)
    assert waited is not None and waited > 100        # until one of a's 200-token decodes ends
    assert sched.stats.preemptions == 0


@pytest.mark.parametrize("policy, on", [("vtc", True), ("vtc-pred", True), ("drr", True), ("fcfs", False)])
def test_engine_turns_the_rule_off_for_fcfs(policy, on):
    clock = VirtualClock()
    runner = SimulatedRunner(clock, IterationTimeModel(0.01, 0.0, 0.0, 0.0), 64)
    engine = Engine(SimModel(), EngineConfig(policy=policy), runner, clock=clock)
    assert (engine.scheduler.returning is not None) is on


def test_returning_tenant_stops_at_its_slot_share_and_victims_keep_theirs():
    sched = saturated(max_running=8)
    burst = [seq("b") for _ in range(10)]
    for s in burst:
        sched.add(s)
    for _ in range(40):
        step(sched)
        running = {t: sum(s.tenant_id == t for s in sched.running) for t in ("a", "b")}
        assert running["a"] >= 4                       # a never drops below its share (8 * 1/2)
    assert sum(s.status is not SequenceStatus.WAITING for s in burst) >= 4
    assert sched.returning.preemptions == 4            # exactly up to b's share, no more


def test_weights_set_the_slot_share():
    sched = saturated(max_running=8)
    burst = [seq("b", weight=3.0) for _ in range(10)]
    for s in burst:
        sched.add(s)
    for _ in range(60):
        step(sched)
    # b's share is 8 * 3/4 = 6 slots; a keeps 2
    assert sched.returning.preemptions == 6
    assert sum(s.tenant_id == "a" for s in sched.running) >= 2


def test_continuously_backlogged_tenants_never_preempt_each_other():
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(4000, 16), 512, 8)
    for _ in range(30):
        sched.add(seq("a", max_tokens=40))
        sched.add(seq("b", prompt_len=300, max_tokens=4))  # different shapes: slots drift apart
    for _ in range(5):
        step(sched)
    before = sched.returning.preemptions
    for _ in range(200):
        step(sched)
    assert sched.returning.preemptions == before


def test_lower_tier_never_preempts_a_higher_tier():
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(4000, 16), 512, 4)
    for _ in range(8):
        sched.add(seq("a", tier="interactive"))
    for _ in range(3):
        step(sched)
    b = seq("b", tier="background")
    sched.add(b)
    for _ in range(10):
        step(sched)
    assert b.status is SequenceStatus.WAITING and sched.returning.preemptions == 0


def test_memory_bound_pool_frees_enough_blocks_and_leaks_none():
    # 8 slots but KV for only 4 of a's requests (14 blocks each after 5 steps): b needs blocks, not a slot
    sched = Scheduler(make_policy("vtc"), LinearCost(), BlockManager(56, 16), 512, 8)
    for _ in range(4):
        sched.add(seq("a", prompt_len=208))
    for _ in range(5):
        step(sched)
    assert len(sched.running) == 4 and sched.blocks.num_free == 0
    b = seq("b", prompt_len=100)
    sched.add(b)
    assert iterations_until_running(sched, b) <= 2
    for s in list(sched.running) + [s for q in sched.waiting.values() for s in q]:
        sched.finish(s, FinishReason.ABORT)
    assert sched.blocks.num_free == 56


@pytest.mark.parametrize("running, weights, tiers, allowed, want", [
    ({"a": 6, "c": 2}, {"a": 1, "b": 1, "c": 1}, {}, None, "a"),           # most slots per weight
    ({"a": 3, "c": 3}, {"a": 1, "b": 1, "c": 1}, {}, None, None),          # 8/3 each: nobody can give one
    ({"a": 5, "c": 2}, {"a": 3, "b": 1, "c": 1}, {}, None, None),          # a (4.8) and c (1.6) at their shares
    ({"a": 6, "c": 2}, {"a": 1, "b": 1, "c": 1}, {"a": "interactive", "b": "batch"}, None, None),
    ({"a": 6, "c": 2}, {"a": 1, "b": 1, "c": 1}, {"a": "background", "b": "batch"}, None, "a"),
    ({"a": 4, "c": 4}, {"a": 1, "b": 1, "c": 1}, {}, {"c"}, "c"),          # KV quota: over-quota first
])
def test_victim_tenant(running, weights, tiers, allowed, want):
    assert ReturningAdmission().victim_tenant("b", running, weights, tiers, 8, allowed) == want
