"""The hand-back rule (worker/scheduling/handback.py) on the real Scheduler and BlockManager (no
model): which waiting, never-admitted requests a full worker gives back, when, how many, and only
those the gateway lets go; and the pool board's say (`PoolCounters.room_elsewhere`)."""

import pytest

from fairshare.pool_board import TenantReport, WorkerReport
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from worker.scheduling.cost import LinearCost
from worker.scheduling.handback import HandBackRule
from worker.scheduling.pool import PoolCounters
from worker.scheduling.policy import make_policy
from tests.unit.sched_steps import step


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(max_running=1, blocks=64):
    clock = Clock()
    bm = BlockManager(blocks, 16)
    # (no returning-tenant preemption: a queued tenant must not take the running slot here)
    return Scheduler(make_policy("vtc"), LinearCost(), bm, 512, max_running, clock=clock,
                     returning_preemption=False), bm, clock


_n = [0]


def seq(tenant, t, may=True, prompt_len=20, max_tokens=100):
    _n[0] += 1
    s = Sequence(f"h{_n[0]}", tenant, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                 max_tokens=max_tokens, arrival_time=t, may_hand_back=may)
    return s


def full_worker(n_waiting=3, may=True):
    """One slot, taken by tenant r's running request; `n_waiting` requests of tenant a queued at t=0..n-1."""
    sched, bm, clock = make()
    running = seq("r", 0.0, may=False)
    sched.add(running)
    step(sched)  # its prefill is computed: it decodes from now on
    assert running.status is SequenceStatus.RUNNING
    waiting = [seq("a", float(i), may=may) for i in range(n_waiting)]
    for s in waiting:
        sched.add(s)
    step(sched)  # no slot: they stay queued
    assert all(s.status is SequenceStatus.WAITING for s in waiting)
    return sched, bm, clock, running, waiting


def test_a_full_worker_hands_back_what_waited_long_enough_oldest_first_bounded_per_iteration():
    sched, bm, clock, running, waiting = full_worker(3)
    rule = HandBackRule(after_s=1.0, per_iteration=2)
    clock.t = 0.99
    assert sched.hand_back(rule) == []  # none waited 1 s yet
    clock.t = 2.5  # the first two waited >= 1 s, the third 0.5 s
    used = bm.num_used
    out = sched.hand_back(rule)
    assert out == waiting[:2]
    assert all(s.finish_reason is FinishReason.HANDED_BACK and s.is_finished for s in out)
    assert [s.request_id for s in sched.waiting["a"]] == [waiting[2].request_id]
    assert bm.num_used == used  # they held nothing
    assert sched.policy.accounts["a"].charged_service == 0
    assert sched.core.stats.handed_back_by_tenant == {"a": 2} and "a" not in sched.core.stats.finished_by_tenant
    clock.t = 3.0
    assert sched.hand_back(rule) == [waiting[2]]
    assert not sched.policy.accounts["a"].backlogged  # nothing of it is left here


def test_only_requests_the_gateway_lets_go_and_never_when_off():
    sched, _, clock, _, waiting = full_worker(2, may=False)
    clock.t = 10.0
    assert sched.hand_back(HandBackRule(after_s=1.0)) == []  # may_hand_back unset: they wait here
    let_go = seq("a", 2.0, may=True)  # (the gateway sets the flag per request, before the worker sees it)
    sched.add(let_go)
    assert HandBackRule(after_s=0).enabled is False
    assert sched.hand_back(HandBackRule(after_s=0)) == []
    assert sched.hand_back(HandBackRule(after_s=1.0)) == [let_go]
    assert all(s.status is SequenceStatus.WAITING for s in waiting)


def test_a_request_with_room_here_stays():
    sched, bm, clock = make(max_running=4)
    s = seq("a", 0.0)
    sched.add(s)  # queued, not scheduled yet: a slot and KV room are free
    clock.t = 5.0
    assert sched.hand_back(HandBackRule(after_s=1.0)) == []
    sched.schedule()
    assert s.status is SequenceStatus.RUNNING


def test_a_request_admitted_once_is_never_handed_back():
    """A preempted request waits again, but it was admitted (it holds computed work and charges)."""
    sched, _, clock, running, _ = full_worker(0)
    running.may_hand_back = True
    entry = sched.core.entries[running.request_id]
    sched.core.preempt(entry, "out-of-blocks")
    assert running.status is SequenceStatus.WAITING
    clock.t = 10.0
    assert sched.hand_back(HandBackRule(after_s=1.0)) == []
    with pytest.raises(ValueError, match="admitted"):
        sched.core.hand_back(running.request_id)


def test_the_board_must_show_a_worker_likely_to_start_it_sooner():
    sched, _, clock, _, waiting = full_worker(1)
    clock.t = 5.0
    asked = []

    def nowhere(tenant_id, tier):
        asked.append((tenant_id, tier))
        return False

    assert sched.hand_back(HandBackRule(after_s=1.0), nowhere) == []
    assert asked == [("a", "interactive")]
    assert sched.hand_back(HandBackRule(after_s=1.0), lambda t, tier: True) == waiting


def report(worker, **tenants):
    return WorkerReport(worker, "e1", {t: TenantReport(0.0, backlogged=b, counter=c) for t, (b, c) in tenants.items()})


def test_room_elsewhere_reads_spare_workers_and_first_in_line_from_the_board():
    pool = PoolCounters()
    assert not pool.room_elsewhere("a", "interactive", 0.0)  # no board read: nothing known
    pool.reduce([report("w1", b=(True, 100.0)), report("w2", a=(True, 10.0), c=(True, 50.0))])
    assert pool.room_elsewhere("a", "interactive", 50.0)       # first in line at w1 (b leads it)
    assert not pool.room_elsewhere("a", "interactive", 150.0)  # behind b at w1; backlogged itself at w2
    assert pool.room_elsewhere("a", "batch", 150.0)             # nobody of the batch tier queues anywhere
    pool.reduce([report("w1", b=(True, 100.0)), report("w2", c=(False, 50.0))])
    assert pool.room_elsewhere("a", "interactive", 150.0)      # w2: nobody queues (spare)
