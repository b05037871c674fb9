"""Routing policies (gateway/routing_policy.py): least-loaded, prefix (rendezvous hashing with bounded
loads) and fair (spill by pool-wide deficit: spare capacity, first in line); the module has no grpc/fastapi imports."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from gateway.routing_policy import (FairRouting, LeastLoaded, PoolBoard, PrefixAffinity, RouteRequest, TenantOnWorker,
                                    make_routing, rendezvous_rank, route_key)
from tests.conftest import ROOT


@dataclass(eq=False)
class W:
    route_id: str
    load: int = 0

    def load_score(self) -> int:
        return self.load


def req(tenant="a", prompt=(1, 2, 3, 4), cost=100, ns=None, tier="interactive"):
    return RouteRequest(tenant, ns if ns is not None else tenant + "\x00", list(prompt), cost, tier)


def test_importing_the_policies_pulls_in_no_framework():
    code = ("import sys, gateway.routing_policy; bad = [m for m in ('grpc', 'fastapi', 'redis', 'torch') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_route_key_is_namespace_plus_prompt_head():
    assert route_key("ns", [1, 2, 3, 4], 2) == route_key("ns", [1, 2, 9, 9], 2)
    assert route_key("ns", [1, 2, 3], 2) != route_key("other", [1, 2, 3], 2)
    assert route_key("ns", [1, 2], 8) != route_key("ns", [1, 3], 8)
    assert route_key("ns", [1], 0) == route_key("ns", [7], 0)  # 0: tenant affinity only
    with pytest.raises(ValueError):
        route_key("ns", [1], -1)


def test_rendezvous_removing_a_worker_moves_only_its_keys():
    workers = [f"w{i}" for i in range(8)]
    keys = [route_key(f"t{k}", [k], 4) for k in range(400)]
    home = {k: rendezvous_rank(k, workers)[0] for k in keys}
    assert len(set(home.values())) == 8  # every worker is some key's home
    fewer = [w for w in workers if w != "w3"]
    for k in keys:
        new = rendezvous_rank(k, fewer)[0]
        assert new == home[k] or home[k] == "w3"
        if home[k] == "w3":  # its keys go to their second choice
            assert new == rendezvous_rank(k, workers)[1]
    more = workers + ["w8"]
    for k in keys:
        assert rendezvous_rank(k, more)[0] in (home[k], "w8")


def test_least_loaded_breaks_ties_in_turn():
    ws = [W("a", 5), W("b", 1), W("c", 1)]
    pol = LeastLoaded()
    assert {pol.choose(req(), ws).route_id for _ in range(4)} == {"b", "c"}
    with pytest.raises(ValueError):
        pol.choose(req(), [])


def test_prefix_keeps_a_namespace_on_its_home_until_the_load_bound():
    ws = [W(f"w{i}") for i in range(4)]
    pol = PrefixAffinity(prefix_tokens=4, load_factor=1.25, slack_tokens=0)
    r = req(cost=100)
    home = pol.ranked(r, ws)[0]
    assert all(pol.choose(r, ws) is home for _ in range(3))  # empty pool: always its home
    for w in ws:
        w.load = 1000
    home.load = 1500  # 1500 + 100 > bound 1.25 * (4500 + 100) / 4 = 1437.5: its second home
    second = pol.ranked(r, ws)[1]
    assert pol.choose(r, ws) is second
    home.load = 1300
    for w in ws:
        if w is not home:
            w.load = 1100
    assert pol.choose(r, ws) is home  # 1300 + 100 <= 1.25 * (4600 + 100) / 4 = 1468.75
    # every ranked worker over the bound: the least-loaded one
    pol0 = PrefixAffinity(prefix_tokens=4, load_factor=1.0, slack_tokens=0)
    ws2 = [W("x", 10), W("y", 0)]
    assert pol0.choose(req(cost=1000), ws2).route_id == "y"


def test_prefix_slack_keeps_affinity_in_a_lightly_loaded_pool():
    ws = [W(f"w{i}") for i in range(4)]
    r = req(cost=2000)
    home = PrefixAffinity(slack_tokens=4096).ranked(r, ws)[0]
    home.load = 2000  # one request already there: without slack the second would move
    assert PrefixAffinity(slack_tokens=4096).choose(r, ws) is home
    assert PrefixAffinity(slack_tokens=0).choose(r, ws) is not home


def board_of(rows: dict[str, dict[str, tuple]]) -> PoolBoard:
    """worker -> tenant -> (counter, backlogged, running)."""
    return PoolBoard({w: {t: TenantOnWorker(c, b, "interactive", n) for t, (c, b, n) in ts.items()}
                      for w, ts in rows.items()})


def test_fair_routes_like_prefix_without_a_board_or_contention():
    ws = [W(f"w{i}") for i in range(4)]
    r = req()
    prefix = PrefixAffinity().choose(r, ws)
    assert FairRouting(lambda: PoolBoard()).choose(r, ws) is prefix
    calm = board_of({w.route_id: {"a": (10.0, False, 1), "b": (5000.0, False, 3)} for w in ws})
    fair = FairRouting(lambda: calm)
    assert fair.choose(r, ws) is prefix and fair.spills == 0


def test_fair_spills_a_tenant_queued_at_home_to_spare_capacity():
    """From its first queued request on, a tenant backlogged at its affine worker goes to a worker
    with no queue that is lighter by at least the slack bound (D²LPM's locality bound), the
    least-loaded of them; a worker with a queue, or one within the bound, does not take it."""
    ws = [W(f"w{i}", 40_000) for i in range(4)]
    r = req("a", cost=512)
    home = PrefixAffinity().choose(r, ws)
    x, y, z = [w for w in ws if w is not home]
    rows = {home.route_id: {"a": (100.0, True, 20), "b": (100.0, True, 20)},
            x.route_id: {"d": (900.0, True, 64)}, y.route_id: {"e": (900.0, False, 50)}, z.route_id: {}}
    y.load, z.load = 30_000, 35_000  # y: its tenant runs but nobody queues, 10,000 tokens lighter than home
    fair = FairRouting(lambda: board_of(rows), slack_tokens=4096)
    seen = []
    fair.on_spill = seen.append
    assert fair.choose(r, ws) is y and fair.spills == 1 and seen == [r]
    y.load = 40_000 - 512 - 4096 + 1  # within the bound: locality wins over a few free slots
    assert fair.choose(r, ws) is z  # 35,000: lighter than home by the request plus the slack
    z.load = 40_000
    assert fair.spare_target(r, ws, home) is None
    # nobody queued at home and a backlogged nowhere: it starts at once there, so it stays home
    rows[home.route_id] = {"a": (100.0, False, 20), "b": (100.0, False, 20)}
    y.load = 0
    assert fair.choose(r, ws) is home and fair.spills == 2


def test_fair_sends_a_lagging_tenant_where_it_is_first_in_line():
    """No spare capacity anywhere: a tenant queued at home goes to the worker where every backlogged
    rival leads its pool-wide counter by the largest margin above `spill_units`; rivals that only
    run (no queue) do not count, and a worker where it is queued itself is skipped."""
    ws = [W(f"w{i}", 40_000) for i in range(4)]
    r = req("a", cost=512)
    home = PrefixAffinity().choose(r, ws)
    x, y, z = [w.route_id for w in ws if w is not home]
    rows = {home.route_id: {"a": (1000.0, True, 20), "b": (1000.0, True, 20)},
            x: {"c": (1500.0, True, 30), "s": (10.0, False, 10)},  # s only runs there: no rival in line
            y: {"d": (5000.0, True, 30), "e": (1200.0, True, 30)},  # e is in line at y: margin 200
            z: {"f": (4000.0, True, 30), "a": (1000.0, True, 2)}}  # a queues at z itself
    fair = FairRouting(lambda: board_of(rows))
    assert fair.spill_units == 0.0
    assert fair.choose(r, ws).route_id == x  # margin 500 at x, 200 at y, z skipped
    assert FairRouting(lambda: board_of(rows), spill_units=300).choose(r, ws).route_id == x
    assert FairRouting(lambda: board_of(rows), spill_units=600).choose(r, ws) is home  # no margin above 600
    rows[x]["c"] = (900.0, True, 30)
    assert fair.choose(r, ws).route_id == y
    # its home has nobody queued and it is backlogged nowhere: affinity
    rows[home.route_id] = {"a": (1000.0, False, 20), "b": (1000.0, False, 20)}
    rows[z]["a"] = (1000.0, False, 2)
    assert fair.choose(r, ws) is home


def test_fair_sends_a_handed_back_request_where_nobody_queues_else_where_it_is_first_in_line():
    """A request a worker handed back (worker/scheduling/handback.py; that worker is left out of the
    candidates by the gateway): to the least-loaded worker where nobody of its tier queues, else to
    where it is first in line, else routed as any request; other policies ignore the count."""
    ws = [W(f"w{i}", 40_000) for i in range(3)]
    x, y, z = ws
    back = RouteRequest("a", "a\x00", [1, 2, 3, 4], 512, handed_back=1)
    rows = {x.route_id: {"b": (900.0, True, 30)}, y.route_id: {"c": (2000.0, True, 30)},
            z.route_id: {"d": (50.0, True, 30)}}
    rows_with_a = {w: dict(ts) for w, ts in rows.items()}
    fair = FairRouting(lambda: board_of(rows))
    for ts in rows.values():
        ts["a"] = (1000.0, False, 0)
    assert fair.choose(back, ws) is y  # everyone queues; a is first in line at y only (2000 > 1000)
    rows[z.route_id] = {"d": (50.0, False, 30), "a": (1000.0, False, 0)}  # nobody queues at z now
    z.load = 45_000
    assert fair.choose(back, ws) is z  # spare beats first in line, heavier or not
    x.load = 10_000
    rows[x.route_id] = {"b": (900.0, False, 30)}
    assert fair.choose(back, ws) is x  # the least-loaded spare worker
    assert fair.spills == 3
    assert FairRouting(lambda: board_of(rows_with_a)).handed_back_target(
        RouteRequest("a", "a\x00", [1], 512, handed_back=1), [x, z], board_of(rows_with_a)) is None
    assert PrefixAffinity().choose(back, ws) is PrefixAffinity().choose(req("a", cost=512), ws)


def test_make_routing_names_and_errors():
    assert make_routing("least-loaded").name == "least-loaded"
    assert make_routing("prefix", spill_units=5, prefix_tokens=8).prefix_tokens == 8
    assert make_routing("fair", board=lambda: PoolBoard(), spill_units=64).spill_units == 64
    with pytest.raises(ValueError, match="unknown routing"):
        make_routing("random")
    with pytest.raises(ValueError):
        PrefixAffinity(load_factor=0.5)
    assert FairRouting(spill_units=0).spill_units == 0
    with pytest.raises(ValueError):
        FairRouting(spill_units=-1)
