"""Fast admission for returning tenants: running slots by weighted share, with preemption.

VTC (Sheng et al., OSDI 2024, Algorithm 2) decides *whose* waiting work is admitted next, and lifts
a tenant that becomes backlogged again to the smallest counter, so a returning tenant is first in
line. But in a continuous-batching engine admission also needs a running slot (`max_running`) and
KV room, and both may be held by another tenant's long decodes: the returning tenant's first token
then waits for one of those to finish (about `output_len / max_running` iterations), however low
its counter. This module closes that gap with one rule (docs/fairness.md, "Returning tenants"):

- A tenant is *returning* when a request arrives while it is not backlogged (nothing queued and no
  prefill left). It stays returning until its queue empties or it reaches its slot share once.
- Slot share: `share_t = N · w_t / Σ_u w_u` over the tenants with running or queued work (the
  returning tenant included), `N` the batch the pool holds now (the number of running requests:
  `max_running` when slots bind, fewer when KV memory does).
- When a returning tenant's head finds no free slot or not enough KV room, and the tenant runs
  at most `share_t − 1` requests, the scheduler preempts (recompute) the latest-admitted request
  of the *victim tenant*: among tenants that would still hold at least their own share after losing
  one request (`running_u − 1 ≥ share_u`) and are not of a higher-priority tier than the requester,
  the one holding the most running slots per unit weight (ties: tenant id). The freed slot and
  blocks are reserved for the returning tenant for that iteration, so the victim's own queue cannot
  take them back.
- Order is kept: room is held for a head only while the policy would serve the returning tenant
  first among the tenants whose heads could take a free slot now, counting the heads already held
  for it this iteration as charged, less one prefill chunk of slack (VTC: its counter plus those
  units over its weight stays at or below theirs). When every slot is taken, the other tenants'
  heads could not be admitted anyway, so heads are held up to the returning tenant's share at the
  speed of the prefill budget. What it gains that way is at most its share of the batch's prompts,
  `≤ α·M`, inside VTC's bound `2·max(α·chunk, β·M)`.

Why it cannot ping-pong: the requester ends at most at its share, the victim at least at its own,
so neither side meets the condition to preempt the other back. A continuously backlogged tenant is
never returning, so tenants that compete all the time (overload, short-prompt vs long-output) are
balanced by VTC alone and pay no recompute. The preempted request keeps what it was charged (the
recompute is not charged again: `Sequence.num_charged_prefill`); it re-enters the front of its
tenant's queue. FCFS does not use the rule (it has no notion of share).

Pure bookkeeping on tenant ids, weights, tiers and counts (no engine types, no torch, no grpc).
"""

from __future__ import annotations

from worker.scheduling.policy import TIERS


class ReturningAdmission:
    """Which tenants are returning, their slot shares, and whom to preempt for them."""

    def __init__(self) -> None:
        self.returning: dict[str, None] = {}   # insertion-ordered set of tenant ids
        self.preemptions = 0                   # preemptions made on behalf of returning tenants

    def on_arrival(self, tenant_id: str, was_backlogged: bool) -> None:
        """A request of `tenant_id` arrived; `was_backlogged`: the policy's state just before."""
        if not was_backlogged:
            self.returning[tenant_id] = None

    def done(self, tenant_id: str) -> None:
        """The tenant stops being returning (its queue emptied or it reached its share)."""
        self.returning.pop(tenant_id, None)

    @staticmethod
    def slot_shares(weights: dict[str, float], batch: int) -> dict[str, float]:
        """Running slots per tenant: `batch · w_t / Σ w` over `weights` (the active tenants)."""
        total = sum(weights.values())
        if total <= 0:
            return {t: 0.0 for t in weights}
        return {t: batch * w / total for t, w in weights.items()}

    @staticmethod
    def below_share(running: int, share: float) -> bool:
        """Whether one more running request keeps the tenant within its share."""
        return running + 1 <= share + 1e-9

    def victim_tenant(self, requester: str, running: dict[str, int], weights: dict[str, float],
                      tiers: dict[str, str], batch: int, allowed: set[str] | None = None) -> str | None:
        """The tenant to preempt one request from, or None.

        running: running requests per tenant. weights: active tenants' weights and batch: running
        slots to share (define the shares). tiers: tenant -> tier name. allowed: when given, only these tenants may be victims
        (the KV-quota rule: over-quota tenants first).
        """
        shares = self.slot_shares(weights, batch)
        rank = {name: i for i, name in enumerate(TIERS)}
        req_rank = rank.get(tiers.get(requester, TIERS[0]), 0)
        best: tuple[float, str] | None = None
        for tenant, n in running.items():
            if tenant == requester or n < 1 or (allowed is not None and tenant not in allowed):
                continue
            if rank.get(tiers.get(tenant, TIERS[0]), 0) < req_rank:
                continue  # never preempt a higher-priority tier for a lower one
            if n - 1 < shares.get(tenant, 0.0) - 1e-9:
                continue  # it would drop below its own share
            key = (-n / weights.get(tenant, 1.0), tenant)
            if best is None or key < best:
                best = key
        return None if best is None else best[1]
