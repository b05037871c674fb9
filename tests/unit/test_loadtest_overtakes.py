"""`loadtests.reports.loadtest.overtakes`: the order count the noisy-neighbour verdict rests on."""

from __future__ import annotations

from loadtests.reports.loadtest import Run, overtakes


def _rec(tenant: str, t_send: float, ttft_s: float | None, outcome: str = "ok") -> dict:
    return {"tenant": tenant, "t_send": t_send, "ttft_s": ttft_s, "outcome": outcome}


def test_counts_other_tenants_first_tokens_inside_the_wait_only():
    recs = [
        _rec("trickle", 10.0, 3.0),            # waits 10 -> 13
        _rec("flood", 5.0, 5.5),               # first token 10.5: passes it
        _rec("flood", 6.0, 6.9),               # 12.9: passes it
        _rec("flood", 1.0, 8.0),               # 9.0: before it was sent
        _rec("flood", 11.0, 2.5),              # 13.5: after its first token
        _rec("flood", 11.0, None, "cut"),      # never had a first token
        _rec("trickle", 10.5, 1.0),            # the same tenant never counts
        _rec("trickle", 20.0, None, "cut"),    # no first token: no count of its own
    ]
    run = Run("fcfs", {"records": recs})
    assert overtakes(run, "trickle") == [2, 0]
    assert overtakes(run, "flood") == [0, 1, 0, 2]
