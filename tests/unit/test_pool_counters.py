"""Pool-wide VTC counters (worker/scheduling/pool.py and VTCPolicy.apply_pool): service charged on
other workers moves the counters, lifts merge as a max, a tenant is lifted when it becomes
backlogged anywhere in the pool, and two workers exchanging reports agree on every counter."""

from __future__ import annotations

from fairshare.pool_board import TenantReport, WorkerReport
from worker.scheduling.policy import FCFSPolicy, VTCPolicy
from worker.scheduling.pool import PoolCounters


def report(policy, worker_id: str, epoch: str = "e1") -> WorkerReport:
    return WorkerReport(worker_id, epoch, {t: TenantReport(*row) for t, row in PoolCounters.report(policy).items()})


def exchange(a: tuple, b: tuple) -> None:
    (pa, ca, ida), (pb, cb, idb) = a, b
    ra, rb = report(pa, ida), report(pb, idb)
    ca.apply([rb], pa)
    cb.apply([ra], pb)


def test_service_elsewhere_moves_the_counter_and_orders_the_tenants():
    w0, w1 = VTCPolicy(), VTCPolicy()
    c0, c1 = PoolCounters(), PoolCounters()
    w0.on_arrival("A", 2.0)
    w0.charge("A", 800)  # A: 400 weighted units on w0
    w1.on_arrival("A", 2.0)
    w1.on_arrival("B", 1.0)
    w1.charge("B", 300)
    exchange((w0, c0, "w0"), (w1, c1, "w1"))
    assert c1.elsewhere == {"A": 800} and w1.accounts["A"].virtual_counter == 400
    assert w1.pick(["A", "B"], {"A": 0, "B": 0}) == "B"  # B is behind pool-wide: it goes first on w1
    # the same report again adds nothing (cumulative service, not increments)
    c1.apply([report(w0, "w0")], w1)
    assert w1.accounts["A"].virtual_counter == 400
    # w0 restarts: a new epoch counts from zero again
    fresh = VTCPolicy()
    fresh.on_arrival("A", 2.0)
    fresh.charge("A", 100)
    c1.apply([report(fresh, "w0", "e2")], w1)
    assert c1.elsewhere["A"] == 900 and w1.accounts["A"].virtual_counter == 450


def test_a_tenant_known_only_from_the_pool_starts_at_its_pool_counter():
    w0, w1 = VTCPolicy(), VTCPolicy()
    c1 = PoolCounters()
    w0.on_arrival("A")
    w0.charge("A", 1000)
    w1.on_arrival("B")
    w1.charge("B", 1200)
    c1.apply([report(w0, "w0")], w1)
    assert "A" not in w1.accounts  # a shadow, not an account (GetLoad lists local tenants only)
    w1.on_arrival("A")  # backlogged on w0 as well: no lift, its counter is the pool's
    assert w1.accounts["A"].virtual_counter == 1000
    assert w1.pick(["A", "B"], {"A": 0, "B": 0}) == "A"


def test_lift_on_becoming_pool_backlogged_and_lifts_merge_across_workers():
    w0, w1 = VTCPolicy(), VTCPolicy()
    c0, c1 = PoolCounters(), PoolCounters()
    w1.on_arrival("B")
    w1.charge("B", 5000)
    exchange((w0, c0, "w0"), (w1, c1, "w1"))
    w0.on_arrival("C")  # returns from idle on w0: lifted to B's counter (backlogged on w1)
    assert w0.accounts["C"].virtual_counter == 5000 and w0.accounts["C"].lift == 5000
    exchange((w0, c0, "w0"), (w1, c1, "w1"))
    assert w1._shadow["C"][0] == 5000  # w1 takes the lift w0 made
    w1.on_arrival("C")
    assert w1.accounts["C"].virtual_counter == 5000  # not lifted again: backlogged on w0
    # the first read of a board lifts nobody (a tenant already backlogged is not returning)
    w2 = VTCPolicy()
    c2 = PoolCounters()
    w2.on_arrival("A")
    w2.charge("A", 100)
    c2.apply([report(w1, "w1")], w2)
    assert w2.accounts["A"].virtual_counter == 100 and w2._shadow["B"][0] == 5000


def run_two_workers(exchange_every: int | None) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """A and B backlogged on w0, B and D on w1; each worker serves 64 units per step to its smallest
    counter for 60 steps, exchanging reports every `exchange_every` steps (None: never). Returns
    each tenant's pool-wide service and both workers' counters."""
    w0, w1 = VTCPolicy(), VTCPolicy()
    c0, c1 = PoolCounters(), PoolCounters()
    for t in ("A", "B"):
        w0.on_arrival(t)
    for t in ("B", "D"):
        w1.on_arrival(t)
    served = {"A": 0.0, "B": 0.0, "D": 0.0}
    for step in range(60):
        for w, cands in ((w0, ["A", "B"]), (w1, ["B", "D"])):
            t = w.pick(cands, {})
            w.charge(t, 64)
            served[t] += 64
        if exchange_every and step % exchange_every == exchange_every - 1:
            exchange((w0, c0, "w0"), (w1, c1, "w1"))
    return served, {t: a.virtual_counter for t, a in w0.accounts.items()}, \
        {t: a.virtual_counter for t, a in w1.accounts.items()}


def test_two_workers_agree_on_every_counter_and_share_by_pool_service():
    served, v0, v1 = run_two_workers(exchange_every=5)
    assert v0["B"] == v1["B"]  # the same counter on both workers after an exchange
    # B, backlogged on both workers, gets its pool-wide share, not one share per worker: within one
    # charge plus what the other worker served in one exchange period (5 steps x 64 units)
    assert max(served.values()) - min(served.values()) <= 64 * (1 + 5)
    alone, _, _ = run_two_workers(exchange_every=None)  # per-worker counters: B gets twice A's
    assert alone["B"] == 2 * alone["A"] == 2 * alone["D"]


def test_policies_without_counters_ignore_the_pool():
    f = FCFSPolicy()
    f.on_arrival("A")
    PoolCounters().apply([WorkerReport("w0", "e", {"A": TenantReport(500.0)})], f)
    assert f.accounts["A"].virtual_counter == 0
