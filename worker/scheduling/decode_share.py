"""What a weight (and a tier) means when nobody queues: sharing the iteration itself.

When every request runs (running slots and KV room suffice), nobody waits for admission, so VTC's
ordering decides nothing and each running request gets one token per iteration: two tenants of
weight 1 and 3 with 30 streams each share 1 : 1, although each iteration is slowed by both; and an
interactive request's first token waits for iterations swollen by background decodes. What is
contended then is the iteration itself (its time grows with its tokens). The contract
(docs/fairness.md, "When nobody queues"), applied by `SchedulingCore.plan_iteration`:

- `iteration_token_target` T (tokens per iteration; EngineConfig / `--iteration-token-target`;
  default: the iteration's token budget, so nothing changes). An iteration is *contended* when
  more than one tenant has work in it (decodes or pending prefill); a lone tenant always gets the
  whole budget.
- In a contended iteration the top tier with work keeps all of its pending prefill (up to the
  budget: an interactive prompt is never held back by background decodes), and the decodes and the
  other tiers' prefill share T tokens: each lower tier owed its minimum share
  (`worker.scheduling.tiers`) first keeps `ceil(m_k · T)` of them, then the tiers take the rest in
  strict priority order, each its decodes and then its prefill.
- Within a tier, decode slots are water-filled by weight among the tenants with decodes (a tenant
  that needs less than its weighted share gives the rest to the others); within a tenant, the
  requests that waited longest since their last token go first (ties: admission order). Prefill
  within a tier goes by the fairness policy, as always.

The weight-3 tenant of the example above then gets 3 decode tokens per iteration for every one of the
weight-1 tenant's, and the interactive tier's iterations stay short.

The tier rule, on by default (`lower_tier_token_target` L, EngineConfig / `--lower-tier-token-target`,
default 1): strict priority covers the iteration's time too. While a higher tier has work (decodes
or pending prefill), the tiers below it together take at most L tokens of the iteration (decodes
first, then prefill, in tier order); while it has none but had some in the last
`tier_grace_iterations` (1024) iterations, at most `lower_tier_idle_token_target` (16, or L if
larger); except a tier owed its minimum share, which is served as if no limit were set (its share
comes first, so the minimum-share guarantee of `worker.scheduling.tiers` is untouched). The higher
tier keeps all of its decodes and prefill; after the grace the lower tiers get whole iterations.

Why: an interactive request's TTFT is the iteration in flight when it arrives plus its own prefill
iteration (it is never queued: it is admitted in the next iteration). Without the rule both carry a
background flood's 60-odd decodes (4.8x its solo TTFT p99 in the simulator's `tiers` workload).
Measured per request over seeds 0-9 (docs/fairness.md, "Tiers"), what made the p99 with the rule at
L = 4 and a 64-iteration grace was (1) the iteration in flight after the interactive tier had been
idle for more than the grace: a full background iteration (64 decodes, or a 500-token background
prefill: 0.10-0.20 s on the CPU time model, against 0.03 s for the interactive tier's own), and (2)
under heavier interactive load its own iterations carrying the lower tiers' 4 tokens (2 decodes of
up to 512 context tokens and a partial prefill: about 8 ms each), which slows its iterations, keeps
more of its streams running at once and so slows them again.

Hence a grace long enough that an interactive tenant which comes back within it never finds a
flood-sized iteration in flight (1024 iterations: 20-30 s at 20-30 ms an iteration), a short
iteration for the lower tiers while it is idle within the grace (16 tokens: what is in flight when
it comes back stays near its own iteration's time, while the lower tiers keep most of their speed),
and L = 1 while it works (the lower tiers keep moving, a decode at a time, and their minimum share
comes through the owed rule). Within a held tier, its prefill and its decodes take turns for its
few tokens, whichever waited longer first (the decode whose last token is oldest, against the
iteration since which the tier's pending prefill got none): a request that arrives beside its tier's
running decodes starts within about twice its prompt in iterations, instead of waiting behind them
until the higher tier goes idle. The price is the lower tiers' throughput while a higher tier is
active or was within the grace (docs/fairness.md, "Tiers", with figures); also that of the
iteration token target: a contended iteration is held at T tokens instead of every runnable one,
and the skipped requests keep their KV blocks while they wait.

Pure arithmetic on ids, weights and counts (no torch, no grpc).
"""

from __future__ import annotations

import heapq
import math
from typing import Mapping

from worker.scheduling.policy import TIERS

DEFAULT_LOWER_TIER_TOKEN_TARGET = 1
DEFAULT_TIER_GRACE_ITERATIONS = 1024
DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET = 16
RANK = {name: i for i, name in enumerate(TIERS)}


def water_fill(demand: Mapping[str, int], weight: Mapping[str, float], capacity: int,
               first: Mapping[str, int] | None = None, shortcuts: bool = True) -> dict[str, int]:
    """Split `capacity` whole slots among tenants in proportion to `weight`, none getting more than
    its `demand` (max-min fair with weights). Returns tenant -> slots; the slots sum to
    min(capacity, Σ demand). Slots below one tenant's share (its fraction of a slot) go to the
    tenants furthest below their share; ties by `first` (smaller first: e.g. the iteration a
    tenant's longest-waiting decode last ran, so that a small capacity rotates among tenants instead
    of always going to the same one), then by tenant id. Deterministic. shortcuts=False makes every
    pass (no skipping of a whole-share pass no share can fill, no id order while nothing is given):
    the plain water-filling the shortcuts must agree with (tests/unit/test_core_fast_paths.py)."""
    give = {t: 0 for t in demand}
    left = max(0, int(capacity))
    active = sorted(t for t, d in demand.items() if d > 0)
    while left > 0 and active:
        total_w = sum(weight[t] for t in active)
        # whole shares first, in order of the demand left per unit weight (smallest first); none
        # when even the heaviest tenant's share is below one slot (floor(left·w/W) rises with w)
        progressed = False
        if total_w > 0 and (not shortcuts or math.floor(left * max(weight[t] for t in active) / total_w) > 0):
            for t in sorted(active, key=lambda u: ((demand[u] - give[u]) / weight[u], u)):
                share = int(math.floor(left * weight[t] / total_w))
                n = min(demand[t] - give[t], share)
                if n > 0:
                    give[t] += n
                    progressed = True
            left = capacity - sum(give.values())
            active = [t for t in active if give[t] < demand[t]]
        if not progressed and left > 0 and active:
            # shares below one slot each: one more to the tenants furthest below their share
            if first is None:
                # none given yet: all are equally far, so by tenant id, the order `active` is in
                pick = active[:left] if shortcuts and left == capacity else \
                    heapq.nsmallest(left, active, key=lambda u: (give[u] / weight[u], u))
            else:
                pick = heapq.nsmallest(left, active, key=lambda u: (give[u] / weight[u], first[u], u))
            for t in pick:
                give[t] += 1
            left = capacity - sum(give.values())
            active = [t for t in active if give[t] < demand[t]]
    return give


def split_by_tier(demand_by_tier: Mapping[str, int], tier_order: list[str], min_shares: Mapping[str, float],
                  capacity: int, floors_only: bool = False) -> dict[str, int]:
    """Tokens per tier: each tier in `min_shares` first keeps `ceil(m_k · capacity)` (at most its
    demand), then what is left goes in strict priority order (`tier_order`, highest first).
    floors_only: return only the first part."""
    give = {t: 0 for t in demand_by_tier}
    left = capacity
    for t in tier_order:
        m = min_shares.get(t, 0.0)
        if m > 0 and demand_by_tier.get(t, 0) > 0:
            n = min(demand_by_tier[t], math.ceil(m * capacity), left)
            give[t] += n
            left -= n
    if floors_only:
        return give
    for t in tier_order:
        if left <= 0:
            break
        n = min(demand_by_tier.get(t, 0) - give.get(t, 0), left)
        if n > 0:
            give[t] += n
            left -= n
    return give


def _shares(core, work: Mapping[str, int], demand: Mapping[str, int], cap: int) -> dict[str, int]:
    """Tokens per tier out of the iteration token target `cap`: each lower tier owed its minimum
    share first keeps `ceil(m_k·cap)` of its decodes (only while owed: its deficit keeps the share
    over time, and a floor every iteration would round 5 % of a small target up to a whole token;
    only decodes, since prefill it could not fit must not take decode slots away), then strict
    priority over `work` (decodes and prefill per tier)."""
    floors = split_by_tier({k: demand[k] for k in TIERS}, list(TIERS),
                           {k: m for k, m in core.tiers.min_share.items() if core.tiers.owed(k)}, cap,
                           floors_only=True)
    tokens = split_by_tier({k: max(0, work[k] - floors[k]) for k in TIERS}, list(TIERS), {},
                           cap - sum(floors.values()))
    return {k: tokens[k] + floors[k] for k in TIERS}


def plan_iteration(core, decoding: list, budget: int) -> tuple[list, int | None]:
    """Which decodes run and how many prefill tokens may follow, out of `budget` tokens, for the
    scheduling core `core` (`SchedulingCore.plan_iteration` calls it).

    decoding: running entries with one token to compute, in admission order. While the
    iteration is not *contended* (work of one tenant only) or its tokens stay within the
    iteration token target `T`, every decode runs and prefill gets the rest of the budget.
    Otherwise the top tier with work keeps all of its pending prefill, and the decodes and the
    other tiers' prefill share `T` tokens (this module's docstring): strict priority
    across tiers, each tier's decodes and then its prefill, each lower tier owed its minimum
    share keeping `ceil(m_k·T)` tokens; within a tier, decodes by weight (the requests that
    waited longest since their last token first). Returns the decodes
    (admission order) and the prefill budget (None: whatever the decodes leave of `budget`);
    the prefill round then also keeps each tier to the prefill tokens planned for it."""
    cap = core.iteration_token_target
    low_cap = core.lower_tier_token_target
    core._tier_prefill_cap = None
    contended = tiered = False
    if cap < budget:
        tenants = {e.tenant_id for e in decoding}
        contended = len(tenants) > 1 or any(t not in tenants for tier in TIERS for t in core._pending[tier])
    per_tier: dict[str, list] = {t: [] for t in TIERS}
    if low_cap is not None and low_cap < budget or contended:
        for e in decoding:
            per_tier[e.tenant.sched_tier].append(e)
        if low_cap is not None and low_cap < budget:
            # a higher tier's iteration: lower-tier work while a higher tier has work now or had
            # some in the last `tier_grace_iterations` (so that its next arrival does not find an
            # iteration swollen by the lower tiers in flight); never when tier-blind (one tier)
            last, now = core._tier_last_work, core.iteration
            working = [t for t in TIERS if per_tier[t] or core._pending[t]]
            for t in working:
                last[t] = now
            lead = next((t for t in TIERS if t in last and now - last[t] <= core.tier_grace_iterations), None)
            tiered = lead is not None and bool(working) and RANK[working[-1]] > RANK[lead]
            if tiered and lead not in working:
                # the higher tier is idle (within the grace): the lower tiers' iteration is kept
                # short enough for its next arrival, not to a trickle
                low_cap = max(low_cap, core.lower_tier_idle_token_target)
    if not contended and not tiered:
        if core._prefill_wait:
            core._prefill_wait.clear()
        for e in decoding:
            e.last_decode = core.iteration
        return decoding, None
    demand = {t: len(per_tier[t]) for t in TIERS}
    prefill = {t: core.prefill_demand(t, budget) for t in TIERS}
    # the top tier with work keeps all of its prefill (an interactive prompt is not held back);
    # the decodes and every other tier's prefill share the target
    top = lead if tiered else next((t for t in TIERS if demand[t] or prefill[t]), TIERS[0])
    work = {t: demand[t] + (prefill[t] if t != top else 0) for t in TIERS}
    # lower tiers held to the lower-tier target: those below the top tier with work and not owed
    # their minimum share (an owed tier is served as if no target were set: its share comes first)
    held = [t for t in TIERS if tiered and RANK[t] > RANK[top] and work[t] and not core.tiers.owed(t)]
    over_cap = contended and sum(work.values()) > cap
    over_low = bool(held) and sum(work[t] for t in held) > low_cap
    waits = core._prefill_wait  # held tier -> iteration since which its pending prefill got no token
    for t in [t for t in waits if not over_low or t not in held or not prefill[t]]:
        del waits[t]
    if not over_cap and not over_low:
        for e in decoding:
            e.last_decode = core.iteration
        return decoding, None
    tokens = _shares(core, work, demand, cap) if over_cap else dict(work)
    if over_low:
        low = split_by_tier({k: work[k] for k in held}, held, {}, low_cap)
        tokens.update({k: min(tokens[k], low[k]) for k in held})
    caps: dict[str, int] = {}
    it = core.iteration  # every decode that runs is marked with it (`last_decode`), then collected
    for tier in TIERS:
        n = tokens.get(tier, 0)
        if over_low and tier in held and prefill[tier]:
            # a held tier's few tokens: its prefill and its decodes take turns, whichever waited
            # longer first (a request arriving beside the tier's running decodes gets its prompt
            # in instead of waiting for the higher tier to go idle)
            since = waits.get(tier)
            oldest = min((e.last_decode for e in per_tier[tier]), default=None)
            first = oldest is None or (since is not None and since <= oldest)
            caps[tier] = min(prefill[tier], n) if first else max(0, min(prefill[tier], n - demand[tier]))
            d = min(demand[tier], n - caps[tier])
            if caps[tier] > 0:
                waits.pop(tier, None)
            else:
                waits.setdefault(tier, it)
        else:
            d = min(demand[tier], n)
            caps[tier] = prefill[tier] if tier == top else max(0, min(prefill[tier], n - d))
        if d >= demand[tier]:  # every decode of the tier runs
            for e in per_tier[tier]:
                e.last_decode = it
            continue
        if d <= 0:
            continue
        tenant_entries: dict[str, list] = {}
        for e in per_tier[tier]:
            tid = e.tenant.tenant_id
            entries = tenant_entries.get(tid)
            if entries is None:
                tenant_entries[tid] = [e]
            else:
                entries.append(e)
        # (fractional slots: the tenant whose decode waited longest first, so that a few tokens
        # rotate among the tier's tenants)
        slots = water_fill({t: len(v) for t, v in tenant_entries.items()},
                           {t: core.tenants[t].weight for t in tenant_entries}, d,
                           {t: min(e.last_decode for e in v) for t, v in tenant_entries.items()})
        for t, entries in tenant_entries.items():
            k = slots[t]
            if k >= len(entries):
                for e in entries:
                    e.last_decode = it
            elif k > 0:
                # the requests that waited longest since their last token (entries of this tier
                # are not marked yet: the key reads last iteration's marks)
                entries.sort(key=lambda e: (e.last_decode, e.order))
                for e in entries[:k]:
                    e.last_decode = it
    out = [e for e in decoding if e.last_decode == it]  # admission order
    core._tier_prefill_cap = caps
    return out, max(0, min(budget - len(out), sum(caps.values())))
