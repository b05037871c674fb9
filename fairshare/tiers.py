"""The tier vocabulary, in one home for both tiers (DESIGN.md, "Fairness", tiers).

- `Tier`: the service tiers, highest priority first: ``interactive`` > ``batch`` > ``background``.
  The tenants file names them (`fairshare.config.TenantConfig.tier`), the gateway sends them in the
  gRPC contract (`fairshare.contract.TIER_ENUMS`), the workers schedule by them (`worker.scheduling`).
- `TIERS`: their names in priority order; `DEFAULT_TIER`: a tenant's tier when none is given (and
  what an unspecified tier in the contract counts as).

What a tier *means* (strict priority with minimum shares) is decided in `worker/scheduling/`.
Pure data: no dependencies, so the scheduling package and the SGLang plugin can import it.
"""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """Service tier: strict priority across tiers (with a minimum share for lower ones) in the worker."""

    INTERACTIVE = "interactive"
    BATCH = "batch"
    BACKGROUND = "background"


TIERS: tuple[str, ...] = tuple(t.value for t in Tier)
DEFAULT_TIER: str = Tier.INTERACTIVE.value

__all__ = ["DEFAULT_TIER", "TIERS", "Tier"]
