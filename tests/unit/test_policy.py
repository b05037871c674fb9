"""VTC and FCFS policy behaviour (worker/scheduling, no torch, no grpc)."""

import sys

import pytest

from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import FCFSPolicy, VTCPolicy, make_policy


def test_scheduling_policy_imports_neither_torch_nor_grpc():
    import subprocess

    code = ("import sys, worker.scheduling, worker.scheduling.policy, worker.scheduling.cost; "
            "bad=[m for m in ('torch','grpc') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_linear_cost_defaults_and_cached_rate():
    c = LinearCost()
    assert c.prefill(100) == 100 and c.decode(3) == 6
    assert LinearCost(cached_rate=0.5).prefill(10, cached_tokens=20) == 20
    with pytest.raises(ValueError):
        LinearCost(alpha=0)


def test_weighted_charge_divides_by_weight():
    p = VTCPolicy()
    p.on_arrival("a", weight=1.0)
    p.on_arrival("b", weight=4.0)
    p.charge("a", 40)
    p.charge("b", 40)
    assert p.accounts["a"].virtual_counter == 40
    assert p.accounts["b"].virtual_counter == 10
    assert p.accounts["b"].charged_service == 40
    assert p.order(["a", "b"], {"a": 0, "b": 1}) == ["b", "a"]


def serve_then_idle(p: VTCPolicy, tenant: str, units: float) -> None:
    """`tenant` arrives, is charged `units` service units, and its queue empties."""
    p.on_arrival(tenant)
    p.charge(tenant, units)
    p.on_idle(tenant)


def test_returning_tenant_is_lifted_to_smallest_backlogged_counter():
    p = VTCPolicy()
    p.on_arrival("a")
    serve_then_idle(p, "b", 300)
    p.charge("a", 600)  # a keeps working while b idles
    p.on_arrival("b")   # b returns: no credit for idling
    assert p.accounts["b"].virtual_counter == 600
    # a tenant already above the floor keeps its counter (lifted to 600 on arrival, then served)
    serve_then_idle(p, "c", 10_000)
    p.on_arrival("c")
    assert p.accounts["c"].virtual_counter == 10_600


def test_lift_with_none_backlogged_uses_last_value_seen():
    p = VTCPolicy()
    serve_then_idle(p, "a", 250)
    p.on_arrival("b")
    assert p.accounts["b"].virtual_counter == 250


def test_ties_break_by_tenant_id_deterministically():
    p = VTCPolicy()
    for t in ("zeta", "alpha", "mid"):
        p.on_arrival(t)
    assert p.order(["zeta", "mid", "alpha"], {"zeta": 0, "mid": 0, "alpha": 0}) == ["alpha", "mid", "zeta"]


def test_fcfs_orders_by_head_arrival():
    p = FCFSPolicy()
    p.on_arrival("a")
    p.on_arrival("b")
    p.charge("a", 1000)
    assert p.order(["a", "b"], {"a": 1.0, "b": 2.0}) == ["a", "b"]


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        make_policy("lottery")
    p = VTCPolicy()
    with pytest.raises(ValueError):
        p.on_arrival("a", weight=0)
    with pytest.raises(ValueError):
        p.on_arrival("a", tier="gold")
