"""Deficit Round Robin across tenants, in service units.

Source: M. Shreedhar and G. Varghese, "Efficient Fair Queuing using Deficit Round Robin",
SIGCOMM 1995 (§3, the DRR algorithm): flows are visited in a fixed round-robin order; each visit
adds a quantum to the flow's deficit counter, the flow sends while its deficit covers the next
packet, and the unused deficit carries over to the next round (it is reset when the flow's queue
empties).

Adapted to iteration-level LLM scheduling:
- the "packets" are the prefill slices the scheduler hands out within an iteration, and the
  output tokens committed later; every charge (prefill or decode) is subtracted from the deficit,
  so it may go negative (a debt carried into later rounds);
- a visit adds `quantum · weight` service units (weighted DRR); a tenant keeps the pointer while
  its deficit is positive, then the pointer moves on;
- a tenant that is backlogged but cannot be served at the moment (its head does not fit memory or
  no running slot is free) still takes part in the rounds of its tier and banks its quanta, as a backlogged DRR
  flow whose head packet exceeds its deficit does, so it catches up once its head fits (as a VTC
  counter that did not move while it waited);
- when a tenant goes idle its positive deficit is dropped (no credit for idling), its debt kept;
- when no candidate can be served, whole rounds are fast-forwarded at once (same result as
  visiting them one by one).
Ring order is the order in which tenants first arrived, so decisions are deterministic.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

from worker.scheduling.cost import CostFunction
from worker.scheduling.policy import SchedulingPolicy, TenantAccount


class DRRPolicy(SchedulingPolicy):
    """Weighted deficit round robin (Shreedhar & Varghese, SIGCOMM 1995).

    quantum: service units added to a tenant's deficit per round, per unit of weight (> 0).
    Bound (what tests/unit/test_fairness_properties.py checks): between co-backlogged tenants the
    weighted service difference stays within
    `2·max(α·chunk, β·M)/w_min + 2·(quantum + α·chunk)·w_max/w_min` (VTC's bound for what a pick
    and the decodes already running can overdraw, plus, per side, a round's quantum and the chunk
    served to the others in an iteration in which a memory-blocked tenant's banked quanta cannot
    be spent yet). Raises ValueError for a non-positive quantum.
    """

    name = "drr"

    def __init__(self, cost: CostFunction | None = None, quantum: float = 512.0) -> None:
        super().__init__(cost)
        if not quantum > 0:
            raise ValueError(f"DRR quantum must be > 0 service units, got {quantum}")
        self.quantum = float(quantum)
        self.deficit: dict[str, float] = {}
        self._ring: list[str] = []
        self._ptr = 0
        self._fresh = True  # the pointed tenant has not received this visit's quantum yet

    def account(self, tenant_id: str, weight: float | None = None, tier: str | None = None) -> TenantAccount:
        if tenant_id not in self.deficit:
            self.deficit[tenant_id] = 0.0
            self._ring.append(tenant_id)
        return super().account(tenant_id, weight, tier)

    def charge(self, tenant_id: str, units: float, prompt_tokens: int = 0, output_tokens: int = 0,
               request_id: str | None = None) -> None:
        super().charge(tenant_id, units, prompt_tokens, output_tokens, request_id)
        self.deficit[tenant_id] -= units

    def on_idle(self, tenant_id: str) -> None:
        super().on_idle(tenant_id)
        if tenant_id in self.deficit:
            self.deficit[tenant_id] = min(self.deficit[tenant_id], 0.0)

    def _advance(self) -> None:
        self._ptr = (self._ptr + 1) % len(self._ring)
        self._fresh = True

    def _grant(self, tenant_id: str, rounds: int) -> None:
        """Add `rounds` quanta of `quantum · weight` service units to the tenant's deficit."""
        self.deficit[tenant_id] += rounds * self.quantum * self.accounts[tenant_id].weight

    def pick(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> str:
        cands = set(tenant_ids)
        if not cands:
            raise ValueError("pick() needs at least one candidate tenant")
        unknown = cands.difference(self.deficit)
        if unknown:
            raise KeyError(f"unknown tenants {sorted(unknown)}")
        # Backlogged tenants of the candidates' tier(s) that cannot be served right now (memory,
        # running slots) still take part in the rounds, as DRR flows with queued packets do; tenants
        # of other tiers do not (tiers are ordered by worker.scheduling.tiers, not by DRR rounds).
        tiers = {self.accounts[t].tier for t in cands}
        active = cands | {t for t, a in self.accounts.items() if a.backlogged and a.tier in tiers}
        ring = self._ring
        self._ptr %= len(ring)
        while True:
            for _ in range(len(ring)):
                t = ring[self._ptr]
                if t in active:
                    if self._fresh:
                        self._grant(t, 1)
                        self._fresh = False
                    if t in cands and self.deficit[t] > 0:
                        return t
                self._advance()
            # A whole round and nobody can send: grant the rounds everyone still needs at once.
            rounds = min(math.ceil(-self.deficit[t] / (self.quantum * self.accounts[t].weight)) for t in cands)
            if rounds > 1:
                for t in active:
                    self._grant(t, rounds - 1)

    def order(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> list[str]:
        """Ring order starting at the pointer (does not grant quanta). The order in which DRR would
        serve queued requests is `project`, not this list taken tenant by tenant."""
        cands = set(tenant_ids)
        n = len(self._ring)
        return [self._ring[(self._ptr + i) % n] for i in range(n) if self._ring[(self._ptr + i) % n] in cands]

    def project(self, costs: dict[str, list[float]]) -> Iterator[tuple[str, int]]:
        """The order in which DRR's rounds would serve queued requests, without changing any state.

        costs: per tenant, the estimated service units of its queued requests, head first. Yields
        (tenant id, index into its list), each request once, as `pick` followed by a charge of the
        estimated cost would: the pointed tenant receives its quantum once per visit and keeps the
        turn while its deficit is positive, then the pointer moves on (rounds nobody could spend
        are fast-forwarded). So an executor that sorts its own waiting queue (SGLang) interleaves
        tenants by their quanta, instead of one tenant's whole queue going first. Raises KeyError
        for a tenant the policy has not seen."""
        unknown = set(costs).difference(self.deficit)
        if unknown:
            raise KeyError(f"unknown tenants {sorted(unknown)}")
        deficit = {t: self.deficit[t] for t, c in costs.items() if c}
        nxt = {t: 0 for t in deficit}
        ring = [t for t in self._ring if t in deficit]
        if not ring:
            return
        # start at the pointer's tenant, or the first queued one after it in ring order
        pos = {t: i for i, t in enumerate(self._ring)}
        ptr_tenant = self._ring[self._ptr % len(self._ring)]
        start = next((i for i, t in enumerate(ring) if pos[t] >= pos[ptr_tenant]), 0)
        fresh = self._fresh or ring[start] != ptr_tenant
        ptr = start
        while ring:
            served = False
            for _ in range(len(ring)):
                t = ring[ptr]
                if fresh:
                    deficit[t] += self.quantum * self.accounts[t].weight
                    fresh = False
                while deficit[t] > 0 and nxt[t] < len(costs[t]):
                    yield t, nxt[t]
                    deficit[t] -= costs[t][nxt[t]]
                    nxt[t] += 1
                    served = True
                if nxt[t] >= len(costs[t]):  # its queue is served: out of the rounds
                    ring.pop(ptr)
                    if not ring:
                        return
                    ptr %= len(ring)
                else:
                    ptr = (ptr + 1) % len(ring)
                fresh = True
            if not served:  # a whole round and nobody could send: grant the rounds still needed at once
                skip = min(math.floor(-deficit[t] / (self.quantum * self.accounts[t].weight)) for t in ring)
                for t in ring:
                    deficit[t] += skip * self.quantum * self.accounts[t].weight

    def describe(self) -> str:
        return f"drr (quantum {self.quantum:g} service units per unit weight)"
