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
weight-1 tenant's, and the interactive tier's iterations stay short. The price is throughput: a
contended iteration is held at T tokens instead of every runnable one, and the skipped requests keep
their KV blocks while they wait (figures in docs/fairness.md).

Pure arithmetic on ids, weights and counts (no torch, no grpc).
"""

from __future__ import annotations

import math
from typing import Mapping


def water_fill(demand: Mapping[str, int], weight: Mapping[str, float], capacity: int) -> dict[str, int]:
    """Split `capacity` whole slots among tenants in proportion to `weight`, none getting more than
    its `demand` (max-min fair with weights). Returns tenant -> slots; the slots sum to
    min(capacity, Σ demand). Deterministic: ties break by tenant id."""
    give = {t: 0 for t in demand}
    left = max(0, int(capacity))
    active = sorted(t for t, d in demand.items() if d > 0)
    while left > 0 and active:
        total_w = sum(weight[t] for t in active)
        # whole shares first, in order of the demand left per unit weight (smallest first)
        progressed = False
        for t in sorted(active, key=lambda u: ((demand[u] - give[u]) / weight[u], u)):
            share = int(math.floor(left * weight[t] / total_w)) if total_w > 0 else 0
            n = min(demand[t] - give[t], share)
            if n > 0:
                give[t] += n
                progressed = True
        left = capacity - sum(give.values())
        active = [t for t in active if give[t] < demand[t]]
        if not progressed and left > 0 and active:
            # shares below one slot each: one more to the tenants furthest below their share
            for t in sorted(active, key=lambda u: (give[u] / weight[u], u))[:left]:
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
