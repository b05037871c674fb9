"""Engine faults in process (worker/faults.py, Engine._fail_batch / _run): the simulated runner on a
virtual clock, whose forward raises when told to."""

from __future__ import annotations

import pytest

from worker.engine.engine import Engine, EngineConfig, EngineFailed
from worker.engine.sequence import SamplingParams
from worker.faults import FaultWindow
from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock

TIME = IterationTimeModel(0.01, 0.0001, 0.001, 0.0)


class FlakyRunner(SimulatedRunner):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fail_next = 0

    def forward(self, items):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("boom")
        return super().forward(items)


def engine(limit=3, max_running=2):
    clock = VirtualClock()
    runner = FlakyRunner(clock, TIME, num_kv_blocks=64, block_size=16)
    e = Engine(SimModel(), EngineConfig(max_running=max_running, fault_limit=limit, fault_window_s=60.0,
                                        prefix_cache=False), runner, clock=clock)
    return e, runner


def add(e, rid, tenant="t", max_tokens=4):
    outs = []
    e.add_request(rid, tenant, [5] * 20, SamplingParams(max_tokens=max_tokens, ignore_eos=True), outs.append)
    return outs


def test_fault_window_counts_faults_in_a_row_within_the_window():
    t = [0.0]
    w = FaultWindow(limit=3, window_s=10.0, clock=lambda: t[0])
    assert not w.failure("a") and not w.failure("b")
    w.success()  # the run is broken
    assert not w.failure("c") and not w.failure("d")
    t[0] = 20.0  # the first two of this run are now outside the window
    assert not w.failure("e") and not w.failure("f")
    assert w.failure("g") and w.tripped and "last: g" in w.reason
    assert not w.failure("h")  # trips once
    with pytest.raises(ValueError):
        FaultWindow(limit=0)


def test_a_fault_fails_exactly_its_batch_and_the_engine_serves_on():
    e, runner = engine(max_running=2)
    a, b, c = add(e, "a"), add(e, "b"), add(e, "c")
    assert e.step()  # a and b prefilled (max_running 2), c waits
    runner.fail_next = 1
    assert e.step()  # the fault: a and b fail
    for outs in (a, b):
        assert outs[-1].finish_reason.value == "abort" and "engine step failed: RuntimeError: boom" in outs[-1].error
        assert sum(len(o.token_ids) for o in outs) == 1  # the token of step 1 only
    assert e.block_manager.num_used <= 2  # only c's blocks (admitted by the next step) at most
    while not c or c[-1].finish_reason is None:
        e.step()
    assert c[-1].finish_reason.value == "length" and c[-1].error is None
    assert e.faults.total == 1 and e.failed is None and e.block_manager.num_used == 0
    acct = e.policy.accounts["t"]  # the failed ones keep what they consumed: 3 prefills, 1+1+4 tokens
    assert acct.charged_service == pytest.approx(3 * 20 * 1.0 + 6 * 2.0)


def test_faults_in_a_row_fail_the_engine():
    e, runner = engine(limit=3)
    heard = []
    e.on_failed = heard.append
    runner.fail_next = 3
    for i in range(3):
        outs = add(e, f"r{i}")
        e.step()
        assert outs[-1].error is not None
    assert e.failed and heard == [e.failed] and "3 engine faults in a row" in e.failed
    with pytest.raises(EngineFailed):
        add(e, "late")
    assert not e.step()  # a failed engine runs nothing


def test_fault_before_a_batch_is_counted_by_the_loop_and_backs_off():
    """A scheduler that raises (no batch yet): the loop counts it and backs off; in a row they fail the
    engine, which then fails what waits (the loop never spins with requests hanging)."""
    import threading

    e, _ = engine(limit=3)
    failed = threading.Event()
    e.on_failed = lambda reason: failed.set()

    def broken_schedule():
        raise RuntimeError("scheduler bug")

    outs = add(e, "stuck")
    e.scheduler.schedule = broken_schedule
    e.start()
    try:
        assert failed.wait(30), "the engine never failed"
        for _ in range(200):
            if outs and outs[-1].finish_reason is not None:
                break
            threading.Event().wait(0.01)
        assert outs[-1].error is not None and "has failed" in outs[-1].error
        assert e.faults.total >= 3
    finally:
        e.shutdown()
