"""Priority tiers: strict priority across tiers, each lower tier keeping a minimum share of service.

DESIGN.md ("Fairness", tiers): `interactive` > `batch` > `background`. Across tiers, strict priority,
except that each lower tier keeps a configured minimum share of service (default 5 %) so that it is
never starved; within a tier, the fairness policy (weighted VTC by default) among its tenants.

How the minimum share is measured and enforced (docs/fairness.md, "Tiers"):

- Service is what the policy is charged: service units of every prefill slice and every committed
  output token, whichever tenant they go to (`worker.scheduling.cost`).
- Each lower tier `k` with minimum share `m_k` keeps a *deficit* `D_k` (service units). While `k` is
  backlogged (one of its tenants has queued work or prefill left), every charge of `Δ` units to a
  tenant of tier `j` adds `m_k·Δ`, less `Δ` itself when `j = k`: `D_k` is what tier `k` is owed. It
  is clamped below at `−floor` (`floor` = half a prefill chunk, α·chunk/2, by default): service a lower
  tier got beyond its share while the higher tiers had nothing to run is banked for at most that
  much. When `k` stops being backlogged, a positive `D_k` is dropped (no credit for idling).
- Tier `k` is *owed* while `D_k > 0`. The core then (a) hands it the next slice of the prefill budget
  before any higher tier (owed tiers among themselves: the one most behind relative to its share,
  `D_k / m_k`, first), and (b) holds a running slot and KV room for its waiting head, so that a
  higher tier's admissions cannot take the room that frees up. Otherwise the highest tier with
  servable work gets the slice (strict priority).
- A higher tier's waiting request may preempt (recompute) running work of a lower tier only while
  that tier is *preemptible* (no minimum share, not backlogged, or at least half a floor ahead of
  its share: `D_k ≤ −floor/2`), and never a request that was admitted while its tier was owed (it
  is what the minimum share bought: taking it back would only make the tier owed again and waste
  the work); never the reverse.
- A tier is *blocked* in an iteration when it is still owed once the iteration's prefill budget
  has been handed out: nothing of it could be served (no free slot and no KV room for its head,
  which only the end of higher-tier requests can change, since they are never preempted for it).

Guarantee (what `tests/unit/test_core_properties.py` checks): over any window of iterations
throughout which tier `k` is backlogged and whose last iteration did not block it,

    S_k ≥ m_k · S − floor − m_k · (most service one iteration's decodes can be charged)

where `S` is the service charged to all tiers in the window. Proof sketch: summing the deficit
updates, `S_k = m_k·S − (D_k(end) − D_k(start)) + (what the floor clamp added) ≥ m_k·S − D_k(end) −
floor`; an iteration that does not block `k` ends its prefill round with `D_k ≤ 0`, and only that
iteration's committed output tokens are charged after it. With the defaults (5 %, chunk 512,
64 running slots, β = 2) the slack is 256 + 6.4 units, less than one prefill chunk.

Pure bookkeeping on tier names and service units (no engine types, no torch, no grpc).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from worker.scheduling.policy import TIERS

TOP_TIER = TIERS[0]
LOWER_TIERS = TIERS[1:]
DEFAULT_MIN_SHARES = {"batch": 0.05, "background": 0.05}
RANK = {name: i for i, name in enumerate(TIERS)}


def validate_min_shares(shares: Mapping[str, float]) -> dict[str, float]:
    """Check a tier -> minimum share table (fractions of service) and return it complete (every
    lower tier present). Raises ValueError: unknown tier, the top tier (it has strict priority, no
    minimum share), a share outside [0, 1), or shares summing to 1 or more."""
    out = dict(DEFAULT_MIN_SHARES)
    for tier, share in shares.items():
        if tier not in RANK:
            raise ValueError(f"unknown tier {tier!r}; lower tiers are {', '.join(LOWER_TIERS)}")
        if tier == TOP_TIER:
            raise ValueError(f"{TOP_TIER} is the top tier: it has strict priority and no minimum share")
        if not 0.0 <= float(share) < 1.0:
            raise ValueError(f"minimum share of {tier} must be in [0, 1), got {share}")
        out[tier] = float(share)
    if sum(out.values()) >= 1.0:
        raise ValueError(f"minimum shares must sum to less than 1, got {sum(out.values()):g}")
    return out


class TierShares:
    """Deficit counters of the lower tiers and the tier order they imply.

    min_shares: lower tier -> minimum share of service in [0, 1) (`validate_min_shares`; missing
    tiers take the default 5 %). floor_units: how far below zero a deficit may go (service units,
    >= 0). enabled: False = tier-blind scheduling (every tenant in one tier; service per tier is
    still counted for reports). Raises ValueError on bad shares or a negative floor.
    """

    def __init__(self, min_shares: Mapping[str, float] | None = None, floor_units: float = 256.0,
                 enabled: bool = True) -> None:
        if floor_units < 0:
            raise ValueError("floor_units must be >= 0")
        self.min_share = validate_min_shares(min_shares or {})
        self.floor = float(floor_units)
        self.enabled = enabled
        self.deficit = {t: 0.0 for t in LOWER_TIERS}
        self.backlogged = {t: False for t in TIERS}
        self.service = {t: 0.0 for t in TIERS}        # service units charged per tier, ever
        self.blocked_iterations = {t: 0 for t in LOWER_TIERS}
        self._moving: list[tuple[str, float]] = []    # (tier, m) of backlogged lower tiers with m > 0

    def tier_of(self, tier: str) -> str:
        """The tier a tenant of `tier` is scheduled in (the top tier when tier-blind)."""
        return tier if self.enabled else TOP_TIER

    def charge(self, tier: str, units: float) -> None:
        """`units` service units were charged to a tenant of `tier`."""
        self.service[tier] = self.service.get(tier, 0.0) + units
        if not units:
            return
        deficit, floor = self.deficit, -self.floor
        for k, m in self._moving:
            d = deficit[k] + m * units - (units if k == tier else 0.0)
            deficit[k] = d if d > floor else floor

    def set_backlogged(self, tier: str, backlogged: bool) -> None:
        """Tier `tier` has (or no longer has) a backlogged tenant. Leaving drops a positive deficit."""
        if self.backlogged.get(tier) == backlogged:
            return
        self.backlogged[tier] = backlogged
        if not backlogged and tier in self.deficit and self.deficit[tier] > 0:
            self.deficit[tier] = 0.0
        self._moving = [(k, self.min_share[k]) for k in LOWER_TIERS
                        if self.enabled and self.min_share[k] > 0 and self.backlogged[k]]

    def owed(self, tier: str) -> bool:
        """Whether lower tier `tier` is owed service now (the top tier never is)."""
        return self.enabled and self.deficit.get(tier, 0.0) > 0.0 and self.backlogged.get(tier, False)

    def owed_tiers(self) -> list[str]:
        """Owed lower tiers, most behind relative to its share first (ties: higher tier first).
        (`_moving` holds the backlogged lower tiers with a share, and is empty when tier-blind.)"""
        deficit = self.deficit
        owed = [k for k, _ in self._moving if deficit[k] > 0.0]
        if len(owed) > 1:
            owed.sort(key=lambda k: (-self.deficit[k] / self.min_share[k], RANK[k]))
        return owed

    def pick(self, servable: Iterable[str]) -> str | None:
        """The tier that gets the next slice among `servable` (tiers with work that can be served
        now): an owed tier first, else the highest-priority one. None when `servable` is empty."""
        cands = servable if isinstance(servable, (list, tuple, set)) else list(servable)
        if not cands:
            return None
        if self._moving:
            for k in self.owed_tiers():
                if k in cands:
                    return k
        if len(cands) == 1:
            return next(iter(cands))
        return min(cands, key=RANK.__getitem__)

    def end_round(self) -> list[str]:
        """Called once the iteration's prefill budget is handed out: the tiers still owed are
        blocked this iteration (counted). Returns them."""
        blocked = self.owed_tiers()
        for k in blocked:
            self.blocked_iterations[k] += 1
        return blocked

    def preemptible(self, tier: str) -> bool:
        """Whether running work of lower tier `tier` may be taken for a higher tier's request: the
        tier has no minimum share, or is not backlogged (the share applies to backlogged tiers), or
        is at least half a floor ahead of its share (`D ≤ −floor/2`, e.g. a background flood that
        had the server to itself). A tier closer to its share keeps its room. (Requests admitted
        while their tier was owed are not taken back either: `Entry.for_share`.)"""
        if not self.enabled or tier not in self.deficit:
            return False
        if self.min_share[tier] <= 0.0 or not self.backlogged[tier]:
            return True
        return self.deficit[tier] <= -self.floor / 2

    def shares_of_service(self) -> dict[str, float]:
        """Fraction of all service charged so far, per tier (0 when nothing was charged)."""
        total = sum(self.service.values())
        return {t: (self.service.get(t, 0.0) / total if total else 0.0) for t in TIERS}

    def describe(self) -> str:
        """One line for reports."""
        if not self.enabled:
            return "tier-blind (every tenant scheduled in one tier)"
        shares = ", ".join(f"{k} ≥ {self.min_share[k]:.0%}" for k in LOWER_TIERS)
        return f"strict priority {' > '.join(TIERS)}; minimum shares {shares}"
