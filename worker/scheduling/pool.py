"""Pool-wide fair counters: each worker orders its tenants by the whole pool's service.

Framework-free (no torch, no grpc, no Redis): the reference engine (`worker.engine.engine.Engine`,
fed by `worker.pool_service.PoolService` through Redis) and the pool simulator
(`loadtests.sim.pool`, fed on the virtual clock) call the same code.

The rule (docs/fairness.md, "Fair shares over a pool"): every worker runs weighted VTC (Sheng et al.,
OSDI 2024, Algorithm 2) over *pool-wide* counters.

- Every worker publishes, per tenant, the service units charged to it there (cumulative), its
  weight and tier, whether it is backlogged there, and its counter (`report`). Publishing and reading
  happen every ~100 ms, so what a worker knows of the others is at most that stale (plus the
  board's round trip).
- Reading the others' reports (`PoolCounters.apply`), a worker adds to each tenant's counter the
  service charged to it *elsewhere* since the last read, divided by its weight: `v += Δc_elsewhere / w`
  (its own charges move `v` as before). A tenant unknown locally keeps a shadow counter (so it
  starts where the pool has it when its first request arrives here).
- A tenant is *pool-backlogged* while it is backlogged on some worker. VTC's lift (no credit for
  idling) applies when a tenant becomes pool-backlogged: the worker its request arrives at lifts it
  to the smallest counter among the other pool-backlogged tenants of its tier
  (`VTCPolicy.pool_lift_floor`); a request arriving for a tenant backlogged elsewhere is not lifted
  (it never left the pool's queue). The lifted part of a counter is published with it and every
  worker takes the largest it sees: counters are a sum of per-worker service (each worker adds its
  own, a grow-only sum) plus a lift (a grow-only maximum), so the workers' copies converge to the
  same values, whatever order the reports arrive in.

So two tenants backlogged together anywhere in the pool see the same counters on every worker (up
to the staleness), and a worker serving both gives the one behind pool-wide the next slice, even
when its service came from another worker. What ordering cannot do alone (a tenant whose
affinity keeps it on a crowded worker while another worker serves others) the ``fair`` routing
policy does: it spills the lagging tenant's requests to the worker where it would be first
(`gateway.routing_policy.FairRouting`).

Units: service units (`worker.scheduling.cost`); counters in service units / weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PoolInputs:
    """One read of the board, reduced: service units charged elsewhere since the previous read
    (per tenant), the largest lift (weighted units) any other worker reports per tenant, the
    tenants backlogged on some other worker, and their weights and tiers."""

    increments: dict[str, float] = field(default_factory=dict)
    lifts: dict[str, float] = field(default_factory=dict)
    backlogged: set[str] = field(default_factory=set)
    weights: dict[str, float] = field(default_factory=dict)
    tiers: dict[str, str] = field(default_factory=dict)


class PoolCounters:
    """What one worker knows of the others (module docstring).

    `apply(reports, policy)` takes the other workers' reports (objects with ``worker_id``, ``epoch``
    and ``tenants``: tenant id -> object with ``charged``, ``weight``, ``tier``, ``backlogged``;
    e.g. `fairshare.pool_board.WorkerReport`) and hands the reduced `PoolInputs` to
    ``policy.apply_pool``. Cumulative service per worker is kept per incarnation (``epoch``): a
    restarted worker starts again at 0 and is counted from there; a worker that left the board adds
    nothing more. `report(policy)` is what this worker publishes.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, dict[str, float]]] = {}  # worker id -> (epoch, tenant -> charged)
        self.elsewhere: dict[str, float] = {}  # tenant -> service units charged on other workers (seen so far)
        self.backlogged_elsewhere: set[str] = set()
        self.workers = 0  # other workers in the last read
        self.reads = 0
        self.boards: dict[str, dict] = {}  # other worker id -> its last report's tenants (last read only)

    def reduce(self, reports) -> PoolInputs:
        """Turn a read of the board into `PoolInputs` (and remember what was seen)."""
        out = PoolInputs()
        for r in reports:
            epoch, before = self._last.get(r.worker_id, (None, {}))
            if epoch != r.epoch:
                before = {}
            now = {}
            for tid, t in r.tenants.items():
                now[tid] = float(t.charged)
                delta = now[tid] - before.get(tid, 0.0)
                if delta > 0:
                    out.increments[tid] = out.increments.get(tid, 0.0) + delta
                if t.backlogged:
                    out.backlogged.add(tid)
                lift = float(getattr(t, "lift", 0.0))
                if lift > out.lifts.get(tid, 0.0):
                    out.lifts[tid] = lift
                out.weights.setdefault(tid, float(t.weight))
                out.tiers.setdefault(tid, str(t.tier))
            self._last[r.worker_id] = (r.epoch, now)
        for tid, units in out.increments.items():
            self.elsewhere[tid] = self.elsewhere.get(tid, 0.0) + units
        self.backlogged_elsewhere = set(out.backlogged)
        self.boards = {r.worker_id: r.tenants for r in reports}
        self.workers = len(reports)
        self.reads += 1
        return out

    def apply(self, reports, policy) -> PoolInputs:
        """Reduce `reports` and hand them to ``policy.apply_pool`` (a no-op for policies without
        counters). Returns the inputs."""
        inputs = self.reduce(reports)
        policy.apply_pool(inputs)
        return inputs

    def room_elsewhere(self, tenant_id: str, tier: str, counter: float) -> bool:
        """Whether, by the last read, some other worker is likely to serve a request of `tenant_id`
        (`tier`, pool-wide counter `counter`) sooner than a full worker: one where no tenant of that
        tier is backlogged (nobody queues: free slots), or where the tenant is not backlogged and
        every backlogged same-tier tenant's counter is above `counter` (it would be first in line).
        The hand-back rule's view of the board (`worker.scheduling.handback`); False before any
        other worker's report was read."""
        for tenants in self.boards.values():
            queued = [t.counter for t in tenants.values() if t.backlogged and str(t.tier) == tier]
            if not queued:
                return True
            mine = tenants.get(tenant_id)
            if (mine is None or not mine.backlogged) and min(queued) > counter:
                return True
        return False

    @staticmethod
    def report(policy, running: dict[str, int] | None = None) -> dict[str, tuple]:
        """This worker's figures per tenant: (charged service units here, weight, tier, backlogged
        here, pool-wide counter, requests running here, lift)."""
        running = running or {}
        return {t: (a.charged_service, a.weight, a.tier, a.backlogged, a.virtual_counter, running.get(t, 0), a.lift)
                for t, a in policy.accounts.items()}


__all__ = ["PoolCounters", "PoolInputs"]
