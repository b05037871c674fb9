"""Fair-scheduling policies: whose work takes the next slice of an iteration's token budget.

Imports neither torch nor grpc; the reference engine, the simulator and the SGLang plugin all use
these classes.

A policy keeps one `TenantAccount` per tenant and answers one question, asked repeatedly while the
scheduler hands out an iteration's prefill budget in small slices: `pick(candidates, arrival)` —
which of the tenants with admissible prefill work gets the next slice. Because each slice is
charged at once (`charge`), counters move between picks and the budget is split among tenants
(water-filling), not handed whole to one of them. The engine tells the policy what happens:
`on_arrival` (a request arrives), `on_admit` (a request's first chunk is scheduled), `charge`
(service units consumed: prefill chunks when scheduled, output tokens when committed),
`on_request_finish` (finished, cancelled or failed) and `on_idle` (nothing queued and no prefill
left: the scheduler's definition of backlogged; running decodes do not count).

- `VTCPolicy`: weighted Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
  Models", OSDI 2024: Algorithm 2 in §4.2, weights in §4.3). Counter `v_t += Δc / w_t` on every
  charge; pick the candidate with the smallest counter; a tenant becoming backlogged is lifted to
  the smallest counter among the backlogged tenants *of its tier* (no credit for idling), or, with
  none backlogged there, to the last counter value seen in that tier. Ties break by tenant id
  (every tensor-parallel rank decides the same way). Tiers themselves are ordered by
  `worker.scheduling.tiers` (strict priority with minimum shares); a policy only ever compares
  tenants of one tier.
- `VTCPredictPolicy`: VTC with output-length prediction (same paper, §4.4): at admission the
  counter is charged the *predicted* output cost; as tokens arrive, only tokens beyond the
  prediction are charged; at the end the unused part of the prediction is refunded. The
  prediction is a per-tenant exponential moving average of past output lengths.
- Pool-wide counters (`worker.scheduling.pool`): `apply_pool` adds the service a tenant got on
  other workers to its VTC counter and lifts tenants that became backlogged elsewhere; a local
  arrival of a tenant backlogged elsewhere is not lifted. Policies without counters ignore it.
- `FCFSPolicy`: first come, first served across tenants (the baseline); counters are still kept so
  that every policy's service is reported the same way.
- `DRRPolicy` (worker/scheduling/drr.py): deficit round robin.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable

from fairshare.tiers import TIERS  # noqa: F401 (re-exported: the tier order, highest first)
from worker.scheduling.cost import CostFunction, LinearCost


@dataclass
class TenantAccount:
    """Per-tenant scheduling state.

    weight: share weight (> 0). virtual_counter: weighted service units (Σ Δc / w; for
    `VTCPredictPolicy` it also holds outstanding predicted charges). charged_service: unweighted
    service units actually consumed. prompt_tokens / output_tokens: tokens charged. backlogged:
    whether the tenant has queued work or prefill left right now (set by on_arrival / on_idle).
    lift: the part of the counter that VTC's lifts added (weighted units; pool-wide counters merge
    it across workers, `worker.scheduling.pool`).
    """

    tenant_id: str
    weight: float = 1.0
    tier: str = "interactive"
    virtual_counter: float = 0.0
    charged_service: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    backlogged: bool = False
    lift: float = 0.0


class BacklogIndex:
    """Per tier: how many tenants are backlogged and the smallest virtual counter among them, kept
    as changes happen so that a VTC lift and an idle tenant cost O(log tenants), not a scan of
    every account (what made the lift linear in tenants).

    A lazy min-heap per tier of (counter, tenant id). Each backlogged tenant has one *current*
    entry (`_low[tid]`, the counter it was pushed with), at most its counter now: a charge only
    raises the counter, so the entry stays valid and is re-keyed when it reaches the top; a counter
    that falls (a VTC-pred refund) gets a new current entry at once. Entries that are not current
    are dropped when they reach the top; the heap is rebuilt when stale entries outnumber live ones
    four to one. accounts: the policy's tenant id -> `TenantAccount` (read, never written).
    """

    def __init__(self, accounts: dict[str, "TenantAccount"]) -> None:
        self.accounts = accounts
        self.count: dict[str, int] = {t: 0 for t in TIERS}
        self._heaps: dict[str, list] = {t: [] for t in TIERS}
        self._low: dict[str, float] = {}
        self._tier: dict[str, str] = {}

    def add(self, acct: "TenantAccount") -> None:
        """`acct` became backlogged (in its tier)."""
        self.count[acct.tier] = self.count.get(acct.tier, 0) + 1
        self._tier[acct.tenant_id] = acct.tier
        self._push(acct)

    def remove(self, acct: "TenantAccount") -> None:
        """`acct` stopped being backlogged."""
        tier = self._tier.pop(acct.tenant_id, None)
        if tier is not None:
            self.count[tier] -= 1
            self._low.pop(acct.tenant_id, None)

    def changed(self, acct: "TenantAccount") -> None:
        """`acct`'s counter or tier may have changed."""
        tier = self._tier.get(acct.tenant_id)
        if tier is None:
            return
        if tier != acct.tier:
            self.remove(acct)
            self.add(acct)
        elif acct.virtual_counter < self._low[acct.tenant_id]:
            self._push(acct)

    def _push(self, acct: "TenantAccount") -> None:
        self._low[acct.tenant_id] = c = acct.virtual_counter
        heap = self._heaps.setdefault(acct.tier, [])
        heapq.heappush(heap, (c, acct.tenant_id))
        if len(heap) > 4 * self.count[acct.tier] + 64:
            live = [(self._low[t], t) for t, tier in self._tier.items() if tier == acct.tier]
            heapq.heapify(live)
            self._heaps[acct.tier] = live

    def min_counter(self, tier: str) -> float | None:
        """The smallest virtual counter among the backlogged tenants of `tier` (None: none)."""
        heap = self._heaps.get(tier)
        accounts, low = self.accounts, self._low
        while heap:
            c, tid = heap[0]
            if low.get(tid) != c or self._tier.get(tid) != tier:
                heapq.heappop(heap)  # not the tenant's current entry, or it left the tier
                continue
            now = accounts[tid].virtual_counter
            if now > c:  # charged since: re-key it
                low[tid] = now
                heapq.heapreplace(heap, (now, tid))
                continue
            return c
        return None


class SchedulingPolicy:
    """Base class: tenant accounts, charging and backlog tracking shared by all policies.

    cost: the service cost function (needed by policies that charge predictions; default linear).
    """

    name = "base"

    def __init__(self, cost: CostFunction | None = None) -> None:
        self.cost = cost or LinearCost()
        self.accounts: dict[str, TenantAccount] = {}
        # per tier: counter value of the last tenant of that tier to leave the backlogged set
        self._last_counter_by_tier: dict[str, float] = {}
        self._listeners: list = []
        self.backlog = BacklogIndex(self.accounts)

    def subscribe(self, listener) -> None:
        """Call `listener(account, units)` after every charge (`units` service units) and after
        any other change of a tenant's counter (`units` 0: a lift, a predicted charge, a refund).
        The scheduling core uses it to keep its candidate heaps and tier deficits current."""
        self._listeners.append(listener)

    def _changed(self, acct: TenantAccount, units: float = 0.0) -> None:
        if acct.backlogged:
            self.backlog.changed(acct)
        for listener in self._listeners:
            listener(acct, units)

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
            if acct.backlogged:
                self.backlog.changed(acct)
        return acct

    def backlogged(self) -> list[TenantAccount]:
        """Accounts of tenants that are backlogged right now."""
        return [a for a in self.accounts.values() if a.backlogged]

    @property
    def _last_counter(self) -> float:
        """The last counter seen in the top tier (kept for callers written before tiers)."""
        return self._last_counter_by_tier.get(TIERS[0], 0.0)

    # ---- events from the engine ---------------------------------------------------------------
    def on_arrival(self, tenant_id: str, weight: float = 1.0, tier: str = "interactive") -> None:
        """A request of `tenant_id` arrived. Marks the tenant backlogged (lifting it in VTC)."""
        acct = self.account(tenant_id, weight, tier)
        if not acct.backlogged:
            self._lift(acct)
            acct.backlogged = True
            self.backlog.add(acct)
            self._changed(acct)

    def on_idle(self, tenant_id: str) -> None:
        """The tenant has nothing queued and no prefill left (decodes may still run)."""
        acct = self.accounts.get(tenant_id)
        if acct is not None and acct.backlogged:
            acct.backlogged = False
            self.backlog.remove(acct)
            if not self.backlog.count.get(acct.tier, 0):
                self._last_counter_by_tier[acct.tier] = acct.virtual_counter

    def on_admit(self, tenant_id: str, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        """A request's first prefill chunk is being scheduled (once per request). No-op here."""

    def on_request_finish(self, tenant_id: str, request_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """A request ended (any reason), before `on_idle`. No-op here."""

    def charge(self, tenant_id: str, units: float, prompt_tokens: int = 0, output_tokens: int = 0,
               request_id: str | None = None) -> None:
        """Charge `units` service units (already computed by the cost function) to the tenant.

        Adds `units` to its charged service and `units / weight` to its virtual counter (subclasses
        may change the counter part). Raises KeyError for an unknown tenant.
        """
        acct = self.accounts[tenant_id]
        acct.charged_service += units
        acct.prompt_tokens += prompt_tokens
        acct.output_tokens += output_tokens
        acct.virtual_counter += self._counter_units(acct, units, prompt_tokens, output_tokens, request_id) / acct.weight
        self._changed(acct, units)

    def _counter_units(self, acct: TenantAccount, units: float, prompt_tokens: int, output_tokens: int,
                       request_id: str | None) -> float:
        """Units of this charge that move the virtual counter (all of them by default)."""
        return units

    def _lift(self, acct: TenantAccount) -> None:
        """Hook: adjust a tenant's counter when it becomes backlogged. No-op by default."""

    def apply_pool(self, inputs) -> None:
        """Pool-wide counters (`worker.scheduling.pool.PoolInputs`: service charged elsewhere since
        the last read, tenants backlogged elsewhere). No-op for policies without counters."""

    # ---- decisions ----------------------------------------------------------------------------
    # Whether a charge can only raise `key` (the core then re-keys a charged tenant lazily, when it
    # reaches the top of its heap, instead of at every charge). Lifts, refunds and head changes are
    # announced through `subscribe` and re-keyed at once.
    key_rises_with_charges = False
    # Whether `key` reads `head_arrival` (FCFS); a policy whose key does not (VTC: the counter)
    # saves the core from finding the tenant's head each time it re-keys the tenant.
    key_uses_arrival = True

    def key(self, tenant_id: str, head_arrival: float) -> tuple | None:
        """A sort key that ranks this tenant among candidates of its tier (smallest first), or None
        when the policy has no static key (its `pick` must then be asked). `head_arrival`: arrival
        time of the tenant's head request (seconds). The scheduling core keeps candidates in a heap
        by this key and re-keys a tenant whenever it is charged or its head changes."""
        return None

    def order(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> list[str]:
        """Order tenants with pending work, most deserving first.

        tenant_ids: tenants that have admissible work. arrival: arrival time (seconds) of each
        tenant's head request. Returns the tenant ids.
        """
        raise NotImplementedError

    def pick(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> str:
        """The tenant that gets the next slice of the prefill budget. Raises ValueError when empty."""
        ordered = self.order(tenant_ids, arrival)
        if not ordered:
            raise ValueError("pick() needs at least one candidate tenant")
        return ordered[0]

    def is_first(self, tenant_id: str, tenant_ids: Iterable[str], arrival: dict[str, float],
                 ahead_units: float = 0.0) -> bool:
        """Whether `tenant_id` is (one of) the most deserving among `tenant_ids` (ties count), even
        after `ahead_units` more service units (work promised to it but not charged yet; > 0 makes
        policies without counters answer False)."""
        return ahead_units <= 0 and self.order(tenant_ids, arrival)[0] == tenant_id

    def describe(self) -> str:
        """One line naming the policy and its parameters (printed by reports)."""
        return self.name


class VTCPolicy(SchedulingPolicy):
    """Weighted Virtual Token Counter (Sheng et al., OSDI 2024, §4.2 Algorithm 2; weights §4.3).

    Fairness bound (paper Theorem 4.4, with the chunked-prefill quantum in place of the longest
    prompt): for continuously backlogged tenants the weighted service difference stays within
    `2·max(α·chunk, β·M)` service units, M the most tokens one batch can hold (see
    `worker.scheduling.metrics.vtc_bound`).
    """

    name = "vtc"
    key_rises_with_charges = True  # Δc / w >= 0 (VTC-pred: only what exceeds the prediction)
    key_uses_arrival = False       # (virtual counter, tenant id)

    def __init__(self, cost: CostFunction | None = None) -> None:
        super().__init__(cost)
        # pool-wide counters (worker.scheduling.pool): tenants backlogged on another worker, and
        # tenants with no local account yet: tenant -> [counter, weight, tier, lift]
        self._elsewhere: set[str] = set()
        self._shadow: dict[str, list] = {}

    def account(self, tenant_id: str, weight: float | None = None, tier: str | None = None) -> TenantAccount:
        new = tenant_id not in self.accounts
        acct = super().account(tenant_id, weight, tier)
        if new and tenant_id in self._shadow:  # known from the pool: start where the pool has it
            acct.virtual_counter, _, _, acct.lift = self._shadow.pop(tenant_id)
        return acct

    def pool_lift_floor(self, tenant_id: str, tier: str) -> float:
        """Counter a tenant becoming pool-backlogged is lifted to: the smallest counter among the
        other tenants of `tier` backlogged here or elsewhere, else the last counter seen. Without
        pool input (nobody backlogged elsewhere) and for a tenant not backlogged itself, the
        smallest counter comes from the backlog index in O(log tenants)."""
        acct = self.accounts.get(tenant_id)
        if not self._elsewhere and (acct is None or not acct.backlogged):
            low = self.backlog.min_counter(tier)
            return low if low is not None else self._last_counter_by_tier.get(tier, 0.0)
        others = [a.virtual_counter for a in self.accounts.values()
                  if a.tenant_id != tenant_id and a.tier == tier and (a.backlogged or a.tenant_id in self._elsewhere)]
        others += [row[0] for t, row in self._shadow.items() if t != tenant_id and row[2] == tier and t in self._elsewhere]
        return min(others) if others else self._last_counter_by_tier.get(tier, 0.0)

    def _lift(self, acct: TenantAccount) -> None:
        if acct.tenant_id in self._elsewhere:
            return  # backlogged on another worker: still in the pool's queue, no lift
        floor = self.pool_lift_floor(acct.tenant_id, acct.tier)
        if acct.virtual_counter < floor:
            acct.lift += floor - acct.virtual_counter
            acct.virtual_counter = floor

    def apply_pool(self, inputs) -> None:
        """Pool-wide counters (`worker.scheduling.pool`): add service charged elsewhere (`Δc / w`) to
        each tenant's counter and take the largest lift any worker made (lifts only grow, so the
        largest is the latest: the worker where a tenant returned lifted it, and every other worker
        takes that lift from its report). Tenants backlogged elsewhere are not lifted on arrival here."""
        for tid in set(inputs.increments) | set(inputs.lifts):
            units, lift = inputs.increments.get(tid, 0.0), inputs.lifts.get(tid, 0.0)
            acct = self.accounts.get(tid)
            if acct is not None:
                extra = max(0.0, lift - acct.lift)
                acct.virtual_counter += units / acct.weight + extra
                acct.lift += extra
                self._notify(acct)
            else:
                row = self._shadow.setdefault(tid, [0.0, inputs.weights.get(tid, 1.0), inputs.tiers.get(tid, TIERS[0]), 0.0])
                extra = max(0.0, lift - row[3])
                row[0] += units / max(row[1], 1e-9) + extra
                row[3] += extra
        self._elsewhere = set(inputs.backlogged)

    def _notify(self, acct: TenantAccount) -> None:
        """A counter changed outside a charge (pool input): the core re-keys the tenant at once."""
        self._changed(acct)

    def key(self, tenant_id: str, head_arrival: float) -> tuple:
        """(virtual counter, tenant id): the smallest counter first, ties by tenant id."""
        return (self.accounts[tenant_id].virtual_counter, tenant_id)

    def order(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> list[str]:
        return sorted(tenant_ids, key=lambda t: (self.accounts[t].virtual_counter, t))

    def is_first(self, tenant_id: str, tenant_ids: Iterable[str], arrival: dict[str, float],
                 ahead_units: float = 0.0) -> bool:
        """Smallest counter even after `ahead_units / w` more, ties included (a tenant lifted to the
        smallest counter qualifies)."""
        acct = self.accounts[tenant_id]
        mine = acct.virtual_counter + max(0.0, ahead_units) / acct.weight
        return all(mine <= self.accounts[t].virtual_counter for t in tenant_ids if t != tenant_id)

    def pick(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> str:
        accounts = self.accounts
        best = min(tenant_ids, key=lambda t: (accounts[t].virtual_counter, t), default=None)
        if best is None:
            raise ValueError("pick() needs at least one candidate tenant")
        return best


class VTCPredictPolicy(VTCPolicy):
    """VTC with output-length prediction (Sheng et al., OSDI 2024, §4.4).

    At admission the tenant's counter is charged the cost of `Ô` predicted output tokens
    (`Ô = min(max_tokens, round(prediction))`); committed output tokens move the counter only once
    they exceed `Ô`; when the request ends with `O < Ô` tokens, the cost of the `Ô − O` unused
    tokens is refunded. The tenant's charged service (what metrics report) is always the actual
    service. prediction: exponential moving average of the tenant's finished output lengths with
    weight `smoothing` in (0, 1] (`initial_prediction` tokens before any request finished).
    Raises ValueError on a smoothing outside (0, 1] or a negative initial prediction.
    """

    name = "vtc-pred"

    def __init__(self, cost: CostFunction | None = None, smoothing: float = 0.2, initial_prediction: float = 0.0) -> None:
        super().__init__(cost)
        if not 0.0 < smoothing <= 1.0 or initial_prediction < 0:
            raise ValueError("smoothing must be in (0, 1] and initial_prediction >= 0")
        self.smoothing = smoothing
        self.initial_prediction = float(initial_prediction)
        self.predicted_len: dict[str, float | None] = {}
        self._live: dict[str, list[int]] = {}  # request id -> [predicted, prompt_tokens, committed]

    def on_admit(self, tenant_id: str, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        if request_id in self._live:
            return
        guess = self.predicted_len.get(tenant_id)
        predicted = max(0, min(int(max_tokens), round(self.initial_prediction if guess is None else guess)))
        self._live[request_id] = [predicted, prompt_tokens, 0]
        acct = self.accounts[tenant_id]
        if predicted:
            acct.virtual_counter += self.cost.decode(predicted, prompt_tokens, 0) / acct.weight
            self._changed(acct)

    def _counter_units(self, acct, units, prompt_tokens, output_tokens, request_id) -> float:
        live = self._live.get(request_id) if request_id is not None else None
        if live is None or not output_tokens:
            return units
        predicted, prompt, before = live
        live[2] = after = before + output_tokens
        start = max(before, predicted)
        if after <= start:
            return units - self.cost.decode(output_tokens, prompt, before)  # covered by the prediction
        covered = self.cost.decode(start - before, prompt, before) if start > before else 0.0
        return units - covered

    def on_request_finish(self, tenant_id: str, request_id: str, prompt_tokens: int, output_tokens: int) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        predicted, prompt, committed = live
        acct = self.accounts[tenant_id]
        if committed < predicted:
            acct.virtual_counter -= self.cost.decode(predicted - committed, prompt, committed) / acct.weight
            self._changed(acct)
        old = self.predicted_len.get(tenant_id)
        self.predicted_len[tenant_id] = float(output_tokens) if old is None else (
            (1 - self.smoothing) * old + self.smoothing * output_tokens)

    def describe(self) -> str:
        return f"vtc-pred (EMA smoothing {self.smoothing:g}, initial prediction {self.initial_prediction:g} tokens)"


class FCFSPolicy(SchedulingPolicy):
    """First come, first served across all tenants (baseline; counters kept for reporting)."""

    name = "fcfs"
    key_rises_with_charges = True  # charges do not move it at all

    def key(self, tenant_id: str, head_arrival: float) -> tuple:
        """(head arrival, tenant id): the earliest head first."""
        return (head_arrival, tenant_id)

    def order(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> list[str]:
        return sorted(tenant_ids, key=lambda t: (arrival[t], t))

    def pick(self, tenant_ids: Iterable[str], arrival: dict[str, float]) -> str:
        best = min(tenant_ids, key=lambda t: (arrival[t], t), default=None)
        if best is None:
            raise ValueError("pick() needs at least one candidate tenant")
        return best


POLICIES = ("vtc", "vtc-pred", "drr", "fcfs")


def make_policy(name: str, cost: CostFunction | None = None, **options) -> SchedulingPolicy:
    """Build a policy by name: `vtc`, `vtc-pred`, `drr` (option `quantum`, service units) or `fcfs`.

    Raises ValueError for an unknown name or bad options.
    """
    if name == "vtc":
        return VTCPolicy(cost)
    if name == "vtc-pred":
        return VTCPredictPolicy(cost, **options)
    if name == "fcfs":
        return FCFSPolicy(cost)
    if name == "drr":
        from worker.scheduling.drr import DRRPolicy

        return DRRPolicy(cost, **options)
    raise ValueError(f"unknown scheduling policy {name!r}; choose from {sorted(POLICIES)}")
