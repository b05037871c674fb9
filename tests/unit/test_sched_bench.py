"""`fairshare bench scheduler` (loadtests/bench/scheduler.py): the steady state it times really is one
(the queue kept at `waiting`, every running slot busy), and what it subtracts for its own
timers never exceeds what they add. No timing is asserted (figures are the bench's to print)."""

from __future__ import annotations

from loadtests.bench import scheduler as sched_bench


def test_the_timer_correction_subtracts_at_most_what_the_timer_adds():
    recorded, whole = sched_bench._timer_cost(2000)
    assert 0.0 <= recorded <= whole


def test_a_steady_state_keeps_the_queue_full_and_times_every_iteration():
    r = sched_bench.run(12, 60, iterations=40, warmup=10, max_running=8)
    assert len(r["core"]) == len(r["schedule"]) == 40
    assert all(c >= 0.0 for c in r["core"]) and all(s >= 0.0 for s in r["schedule"])
    assert r["running"] == 8          # every slot busy: the state the figures are for
    assert sum(r["core"]) > 0.0       # the core's calls were timed at all
