"""Fairness metrics, the fluid GPS ideal and the seed's worked example (weights 1:3, costs 2 and 10)."""

import math

import pytest

from worker.scheduling.cost import LinearCost
from worker.scheduling.metrics import (EventLog, compute_metrics, gps_shares, jain_index, merge_intervals, percentile,
                                       vtc_bound)
from worker.scheduling.policy import VTCPolicy


def test_helpers():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))
    assert jain_index([1, 1, 1]) == pytest.approx(1.0) and jain_index([1, 0]) == pytest.approx(0.5)
    assert merge_intervals([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert vtc_bound(1, 2, 512, 1000) == 4000 and vtc_bound(1, 2, 512, 100, [2, 4]) == 512
    assert gps_shares(90, {"a": 1, "b": 2}, {"a": 10, "b": 1000}) == {"a": 10, "b": 80}
    with pytest.raises(ValueError):
        gps_shares(1, {"a": 0})


def test_seed_worked_example_fluid_ideal():
    """Weights 1:3 over a 120-unit interval, requests costing 2 and 10 units: the fluid GPS ideal
    gives 30 and 90 units, i.e. 15 and 9 requests."""
    shares = gps_shares(120, {"light": 1.0, "heavy": 3.0})
    assert shares == {"light": 30.0, "heavy": 90.0}
    assert shares["light"] / 2 == 15 and shares["heavy"] / 10 == 9


def test_seed_worked_example_discrete_vtc_stays_within_its_bound():
    """Whole requests (cost 2 for weight 1, cost 10 for weight 3) picked by weighted VTC: at every
    point of a 120-unit interval the weighted difference is within 2·max(c/w), and at the end the
    counts are 15 and 9 (±1 request)."""
    p = VTCPolicy()
    p.on_arrival("light", weight=1.0)
    p.on_arrival("heavy", weight=3.0)
    cost = {"light": 2.0, "heavy": 10.0}
    bound = 2 * max(cost["light"] / 1.0, cost["heavy"] / 3.0)
    served = {"light": 0.0, "heavy": 0.0}
    while sum(served.values()) < 120:
        t = p.pick(["light", "heavy"], {"light": 0.0, "heavy": 0.0})
        p.charge(t, cost[t])
        served[t] += cost[t]
        assert abs(served["light"] / 1.0 - served["heavy"] / 3.0) <= bound
    assert abs(served["light"] - 30) <= cost["light"] * 1 + 1e-9 or abs(served["heavy"] - 90) <= cost["heavy"]
    assert abs(served["light"] / 2 - 15) <= 1 and abs(served["heavy"] / 10 - 9) <= 1


def _log_two_tenants() -> EventLog:
    """a and b arrive at 0 with 10-token prompts and 2 output tokens (α=1, β=2: 14 units each).
    Step [0,1): a's prefill + first token. Step [1,2): a's 2nd token, b's prefill + first token.
    Step [2,3): b's 2nd token."""
    log = EventLog()
    log.on_arrival("a1", "a", 1.0, 0.0, 10, 2)
    log.on_arrival("b1", "b", 1.0, 0.0, 10, 2)
    log.on_admit("a1", 0.0)
    log.on_prefill_charge("a1", 10)
    log.on_token("a1", 1.0, 2.0)
    log.on_step(0.0, 1.0, {"a": 12.0}, {"a": 10}, {"a": 1})
    log.on_admit("b1", 1.0)
    log.on_prefill_charge("b1", 10)
    log.on_token("a1", 2.0, 2.0)
    log.on_finish("a1", 2.0, "length")
    log.on_token("b1", 2.0, 2.0)
    log.on_step(1.0, 2.0, {"a": 2.0, "b": 12.0}, {"b": 10}, {"a": 1, "b": 1})
    log.on_token("b1", 3.0, 2.0)
    log.on_finish("b1", 3.0, "length")
    log.on_step(2.0, 3.0, {"b": 2.0}, {}, {"b": 1})
    return log


def test_compute_metrics_on_a_hand_made_log():
    log = _log_two_tenants()
    m = compute_metrics(log, LinearCost(), window=(0.0, 3.0), ttft_slo_s=1.5, itl_slo_s=5.0)
    a, b = m.tenants["a"], m.tenants["b"]
    assert a.service_units == 14 and b.service_units == 14
    assert a.offered_units == 14 and a.requests == 1 and a.finished == 1
    assert a.ttft_mean_s == 1.0 and b.ttft_mean_s == 2.0 and b.queue_mean_s == 1.0
    assert a.itl_mean_s == 1.0 and b.itl_mean_s == 1.0
    assert a.backlogged_s == 1.0 and b.backlogged_s == 2.0     # arrival -> prefill done
    assert b.longest_starvation_s == 1.0                        # waited the whole first step
    # both backlogged during step 1 only: a got 12, b got 0
    assert m.max_pair_diff_units == 12.0
    assert m.max_pair_witness == ("a", "b", 0.0, 1.0)           # the pair, its stretch's start, the peak
    assert compute_metrics(log, LinearCost(), window=(2.0, 3.0)).max_pair_witness is None  # nobody co-backlogged
    assert m.goodput_rps == pytest.approx(1 / 3)                # only a met the 1.5 s TTFT SLO
    assert m.jain == pytest.approx(1.0) and a.gps_units == pytest.approx(14) and b.gps_units == pytest.approx(14)
    assert a.max_lag_units == 0 and b.max_lag_units == pytest.approx(6.0)   # GPS splits step 1 evenly
    assert m.busy_tokens_per_s == pytest.approx((10 + 10 + 4) / 3)
