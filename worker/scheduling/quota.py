"""Per-tenant KV quotas over the paged pool (DESIGN.md, "Memory and cache isolation").

Pure bookkeeping on tenant ids, weights, tiers and block counts (no engine types, no torch).

The pool of `P` blocks is divided as follows:

- **reserved headroom** (`headroom`, fraction of P, default 5%): never used by *admissions*; only
  running sequences (decodes and admitted prefills) may grow into it, so a running request can
  always take its next block without an immediate preemption storm.
- **shared buffer** (`shared_buffer`, fraction of P, default 0): not part of anyone's soft quota;
  it is what bursting tenants use first.
- the rest, `Q = P·(1 − headroom − shared_buffer)`, is split into **soft quotas**: by default a
  tenant's weight share among the known tenants (`Q · w_i / Σ w`), or a configured fraction of P
  per tenant or per tier.
- **hard cap** (`hard_cap`, fraction of P, default 1.0 = off; per tenant/tier overridable): a tenant
  never holds more by admission (a tenant holding nothing may still admit one request, so a
  request larger than the cap is not stuck forever).

Admission rule (`admission_allowed`): while the pool would stay at or below the *safety watermark*
(`watermark`, default 0.8 of P) after the admission, a tenant may burst past its soft quota; above
it, new work of a tenant that would then be over its soft quota waits. When nothing is running at
all, any request that physically fits is admitted (no deadlock when every tenant is over quota).

Preemption rule (`pick_victim_tenant`): the victim tenant is the one furthest over its soft quota
in blocks held (held − soft; ties: larger held/soft ratio, then tenant id); the scheduler then
takes that tenant's latest-admitted request. A tenant within its soft quota is never chosen while
any over-quota tenant holds blocks; only when no tenant is over quota does the caller fall back to
its quota-less rule (latest admitted overall).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVQuotaConfig:
    """Quota settings. Fractions are of the whole pool (0..1].

    enabled: False = the quota-less behaviour (admission by free blocks only, newest-first
    preemption). watermark: pool fraction up to which tenants may burst past their soft quota.
    headroom: pool fraction admissions may not use. shared_buffer: pool fraction left out of the
    soft quotas. hard_cap: default per-tenant hard cap. soft: per tenant id or tier, a soft-quota
    fraction overriding the weight share. hard: per tenant id or tier, a hard-cap fraction.
    Raises ValueError (from `validate`) on out-of-range values.
    """

    enabled: bool = True
    watermark: float = 0.8
    headroom: float = 0.05
    shared_buffer: float = 0.0
    hard_cap: float = 1.0
    soft: dict[str, float] = field(default_factory=dict)
    hard: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("watermark", "hard_cap"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1]")
        for name in ("headroom", "shared_buffer"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")
        if self.headroom + self.shared_buffer >= 1.0:
            raise ValueError("headroom + shared_buffer must be < 1")
        for table in (self.soft, self.hard):
            for key, frac in table.items():
                if not 0.0 < frac <= 1.0:
                    raise ValueError(f"quota fraction for {key!r} must be in (0, 1]")


class KVQuota:
    """Soft quotas, hard caps and the admission/preemption rules for a pool of `num_blocks` blocks.

    Tenants become known through `observe(tenant_id, weight, tier)` (the scheduler calls it on
    every arrival); soft quotas are recomputed from the known tenants' weights.
    """

    def __init__(self, config: KVQuotaConfig, num_blocks: int) -> None:
        config.validate()
        if num_blocks <= 0:
            raise ValueError("num_blocks must be > 0")
        self.config = config
        self.num_blocks = num_blocks
        self.weights: dict[str, float] = {}
        self.tiers: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def observe(self, tenant_id: str, weight: float, tier: str = "") -> None:
        self.weights[tenant_id] = max(float(weight), 1e-9)
        self.tiers[tenant_id] = tier

    @property
    def headroom_blocks(self) -> int:
        return int(self.config.headroom * self.num_blocks)

    @property
    def watermark_blocks(self) -> int:
        return int(self.config.watermark * self.num_blocks)

    def _override(self, table: dict[str, float], tenant_id: str) -> float | None:
        if tenant_id in table:
            return table[tenant_id]
        tier = self.tiers.get(tenant_id)
        return table.get(tier) if tier else None

    def soft_blocks(self, tenant_id: str) -> int:
        """The tenant's soft quota, blocks (at least 1)."""
        frac = self._override(self.config.soft, tenant_id)
        if frac is not None:
            return max(1, int(frac * self.num_blocks))
        share_pool = self.num_blocks * (1.0 - self.config.headroom - self.config.shared_buffer)
        total = sum(self.weights.values()) or 1.0
        return max(1, int(share_pool * self.weights.get(tenant_id, 1.0) / total))

    def hard_blocks(self, tenant_id: str) -> int:
        frac = self._override(self.config.hard, tenant_id)
        return max(1, int((self.config.hard_cap if frac is None else frac) * self.num_blocks))

    def over_soft(self, tenant_id: str, held: int) -> bool:
        return held > self.soft_blocks(tenant_id)

    def admission_allowed(self, tenant_id: str, tenant_blocks: int, need: int, pool_used: int,
                          anything_running: bool) -> str | None:
        """Why a new request of `tenant_id` needing `need` blocks may not be admitted now (None: it
        may). tenant_blocks: blocks the tenant holds or is committed to; pool_used: blocks in use."""
        if not anything_running:
            return None
        if tenant_blocks > 0 and tenant_blocks + need > self.hard_blocks(tenant_id):
            return "hard-cap"
        if pool_used + need > self.num_blocks - self.headroom_blocks:
            return "headroom"
        if tenant_blocks + need > self.soft_blocks(tenant_id) and pool_used + need > self.watermark_blocks:
            return "over-quota"
        return None

    def pick_victim_tenant(self, held: dict[str, int]) -> str | None:
        """The tenant furthest over its soft quota among those holding blocks (None: nobody is over)."""
        best, best_key = None, None
        for tenant, blocks in held.items():
            soft = self.soft_blocks(tenant)
            if blocks <= 0 or blocks <= soft:
                continue
            key = (blocks - soft, blocks / soft, tenant)
            if best_key is None or key > best_key:
                best, best_key = tenant, key
        return best

    def state(self, tenant_id: str, held: int) -> dict:
        """Quota figures for GetLoad / metrics."""
        soft = self.soft_blocks(tenant_id)
        return {"kv_soft_quota_blocks": soft, "kv_hard_cap_blocks": self.hard_blocks(tenant_id),
                "kv_over_quota": held > soft}
