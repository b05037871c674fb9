"""Fair-scheduling policies: which tenant's work is admitted next.

Imports neither torch nor grpc; the reference engine, the simulator and the SGLang plugin all use
these classes.

A policy keeps one `TenantAccount` per tenant and answers one question per scheduling decision:
`order(candidates)` — the order in which tenants with pending work may take the next slice of the
iteration's token budget. The engine tells it what happens: `on_arrival` (a request arrives),
`on_idle` (a tenant has nothing left queued or running), and `charge` (service units consumed).

- `VTCPolicy`: weighted Virtual Token Counter (Sheng et al., OSDI 2024, Algorithm 2 with weights,
  section 4.3). Counter `v_t += Δc / w_t` on every charge; admit from the backlogged tenant with the
  smallest counter; a tenant becoming backlogged is lifted to the smallest counter among backlogged
  tenants (no credit for idling), or, with none backlogged, to the last counter value seen.
  Ties break by tenant id (deterministic: every tensor-parallel rank decides the same way).
- `FCFSPolicy`: first come, first served across tenants (the baseline); it still keeps counters so
  that the service each tenant got can be reported the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

TIERS = ("interactive", "batch", "background")


@dataclass
class TenantAccount:
    """Per-tenant scheduling state.

    weight: share weight (> 0). virtual_counter: weighted service units (Σ Δc / w).
    charged_service: unweighted service units charged. prompt_tokens / output_tokens: tokens
    charged. backlogged: whether the tenant has queued or running work right now.
    """

    tenant_id: str
    weight: float = 1.0
    tier: str = "interactive"
    virtual_counter: float = 0.0
    charged_service: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    backlogged: bool = False


class SchedulingPolicy:
    """Base class: tenant accounts, charging and backlog tracking shared by all policies."""

    name = "base"

    def __init__(self) -> None:
        self.accounts: dict[str, TenantAccount] = {}
        self._last_counter = 0.0  # counter value of the last tenant to leave the backlogged set

    def account(self, tenant_id: str, weight: float | None = None, tier: str | None = None) -> TenantAccount:
        """Return the tenant's account, creating it (and updating weight/tier when given).

        Raises ValueError for a non-positive weight or an unknown tier.
        """
        acct = self.accounts.get(tenant_id)
        if acct is None:
            acct = self.accounts[tenant_id] = TenantAccount(tenant_id)
        if weight is not None:
            if not weight > 0:
                raise ValueError(f"tenant {tenant_id!r}: weight must be > 0, got {weight}")
            acct.weight = float(weight)
        if tier is not None:
            if tier not in TIERS:
                raise ValueError(f"tenant {tenant_id!r}: unknown tier {tier!r}")
            acct.tier = tier
        return acct

    def backlogged(self) -> list[TenantAccount]:
        """Accounts of tenants that currently have queued or running work."""
        return [a for a in self.accounts.values() if a.backlogged]

    def on_arrival(self, tenant_id: str, weight: float = 1.0, tier: str = "interactive") -> None:
        """A request of `tenant_id` arrived. Marks the tenant backlogged (lifting it in VTC)."""
        acct = self.account(tenant_id, weight, tier)
        if not acct.backlogged:
            self._lift(acct)
            acct.backlogged = True

    def on_idle(self, tenant_id: str) -> None:
        """The tenant has no queued or running request left."""
        acct = self.accounts.get(tenant_id)
        if acct is not None and acct.backlogged:
            acct.backlogged = False
            if not self.backlogged():
                self._last_counter = acct.virtual_counter

    def charge(self, tenant_id: str, units: float, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Charge `units` service units (already computed by a cost function) to the tenant.

        Adds `units / weight` to its virtual counter. Raises KeyError for an unknown tenant.
        """
        acct = self.accounts[tenant_id]
        acct.charged_service += units
        acct.virtual_counter += units / acct.weight
        acct.prompt_tokens += prompt_tokens
        acct.output_tokens += output_tokens

    def _lift(self, acct: TenantAccount) -> None:
        """Hook: adjust a tenant's counter when it becomes backlogged. No-op by default."""

    def order(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> list[str]:
        """Order tenants with pending work for the next admission.

        tenant_ids: tenants that have an admissible request. arrival: arrival time (seconds) of
        each tenant's head request. Returns the tenant ids, most deserving first.
        """
        raise NotImplementedError


class VTCPolicy(SchedulingPolicy):
    """Weighted Virtual Token Counter (Sheng et al., OSDI 2024, §4.2 Algorithm 2; weights §4.3).

    Fairness bound (paper Theorem 4.4, with the chunked-prefill quantum in place of the longest
    prompt): for continuously backlogged tenants the weighted service difference stays within
    `2·max(α·chunk, β·M)`, M the most tokens one batch can hold.
    """

    name = "vtc"

    def _lift(self, acct: TenantAccount) -> None:
        others = [a.virtual_counter for a in self.accounts.values() if a.backlogged and a is not acct]
        floor = min(others) if others else self._last_counter
        if acct.virtual_counter < floor:
            acct.virtual_counter = floor

    def order(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> list[str]:
        return sorted(tenant_ids, key=lambda t: (self.accounts[t].virtual_counter, t))


class FCFSPolicy(SchedulingPolicy):
    """First come, first served across all tenants (baseline; counters kept for reporting)."""

    name = "fcfs"

    def order(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> list[str]:
        return sorted(tenant_ids, key=lambda t: (arrival[t], t))


POLICIES = {"vtc": VTCPolicy, "fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    """Build a policy by name (`vtc` or `fcfs`). Raises ValueError for an unknown name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {sorted(POLICIES)}") from None
