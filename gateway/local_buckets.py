"""Admission while Redis is down: this replica's in-memory token buckets (`LocalAdmission`).

Used by `gateway.admission.AdmissionControl` for the tiers whose outage policy is ``degrade``: each
tenant limit is divided by the live gateway replica count, so N replicas together stay within the
tenant's limits. Buckets refill by the rule Redis applies (gateway/bucket.lua, whose Python twin is
`gateway.redis_buckets.bucket_level`); tests/integration/test_bucket_parity.py checks both give the
same decisions.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from fairshare.config import TenantConfig

from .redis_buckets import Decision, Lease, RateLimitState, bucket_level, bucket_wait_ms


class LocalAdmission:
    """This replica's in-memory admission while Redis is down: each tenant limit divided by `replicas`.

    Buckets refill continuously (capacity ``limit / replicas``, at ``limit / replicas`` per minute) by
    the rule Redis applies (`gateway.redis_buckets.bucket_level`, the Python twin of gateway/bucket.lua);
    in-flight tokens and concurrent requests count this replica's running requests of the tenant (the
    local leases plus the Redis-held ones passed as `held`); concurrency is ``max(1, floor(limit /
    replicas))``. A request that cannot fit the local share at all is refused with 429 (it may fit
    again when Redis is back), never with 400.
    """

    def __init__(self, replicas: int = 1, clock_ms: Callable[[], float] = lambda: time.monotonic() * 1000.0,
                 retry_s: float = 1.0) -> None:
        self.replicas = max(1, int(replicas))
        self.clock_ms = clock_ms  # () -> now in ms
        self.retry_s = retry_s
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (tenant, rpm|tpm) -> (tokens, at ms)
        self._caps: dict[tuple[str, str], float] = {}
        self.leases: dict[str, dict[str, Lease]] = {}  # tenant -> lease id -> lease held here

    def share(self, limit: int | None) -> float | None:
        """A limit's per-replica share (None: unlimited)."""
        return None if limit is None else limit / self.replicas

    def level(self, tenant_id: str, which: str, cap: float) -> float:
        """Tokens in a local bucket now (refilled; a bucket never used is full)."""
        got = self._buckets.get((tenant_id, which))
        return cap if got is None else bucket_level(got[0], got[1], self.clock_ms(), cap)

    def _store(self, tenant_id: str, which: str, cap: float, tokens: float) -> None:
        self._caps[(tenant_id, which)] = cap
        self._buckets[(tenant_id, which)] = (tokens, self.clock_ms())

    def admit(self, tenant: TenantConfig, cost: int, lease_id: str, held: list[Lease] = ()) -> Decision:
        """Admit against the local share, all or nothing (see the class docstring)."""
        lim = tenant.limits
        rpm, tpm = self.share(lim.rpm), self.share(lim.tpm)
        inflight_cap = self.share(lim.max_inflight_tokens)
        conc_cap = None if lim.max_concurrent_requests is None else max(
            1, math.floor(lim.max_concurrent_requests / self.replicas))
        mine = self.leases.get(tenant.id, {})
        inflight = sum(le.tokens for le in mine.values()) + sum(le.tokens for le in held if not le.settled)
        concurrent = len(mine) + sum(1 for le in held if not le.settled)
        rpm_t = self.level(tenant.id, "rpm", rpm) if rpm is not None else None
        tpm_t = self.level(tenant.id, "tpm", tpm) if tpm is not None else None

        reason, retry_ms = "ok", 0.0  # checked in admission.lua's order (the last failing check names it)
        if conc_cap is not None and concurrent + 1 > conc_cap:
            reason, retry_ms = "concurrent_requests", max(retry_ms, self.retry_s * 1000)
        if inflight_cap is not None and inflight + cost > inflight_cap:
            reason, retry_ms = "inflight_tokens", max(retry_ms, self.retry_s * 1000)
        if tpm is not None and tpm_t < cost:
            reason = "tokens"
            retry_ms = max(retry_ms, bucket_wait_ms(tpm_t, cost, tpm) if cost <= tpm else self.retry_s * 1000)
        if rpm is not None and rpm_t < 1:
            reason, retry_ms = "requests", max(retry_ms, bucket_wait_ms(rpm_t, 1, rpm))
        admitted = reason == "ok"
        if admitted:
            if rpm is not None:
                rpm_t -= 1
                self._store(tenant.id, "rpm", rpm, rpm_t)
            if tpm is not None:
                tpm_t -= cost
                self._store(tenant.id, "tpm", tpm, tpm_t)
        state = RateLimitState(
            rpm_limit=None if rpm is None else math.floor(rpm),
            rpm_remaining=None if rpm is None else math.floor(rpm_t),
            rpm_reset_s=0.0 if rpm is None else math.ceil(bucket_wait_ms(rpm_t, rpm, rpm)) / 1000,
            tpm_limit=None if tpm is None else math.floor(tpm),
            tpm_remaining=None if tpm is None else math.floor(tpm_t),
            tpm_reset_s=0.0 if tpm is None else math.ceil(bucket_wait_ms(tpm_t, tpm, tpm)) / 1000)
        lease = None
        if admitted:
            lease = Lease(tenant.id, lease_id, int(cost), lim.tpm, store="local", tpm_store="local")
            self.leases.setdefault(tenant.id, {})[lease_id] = lease
            inflight += cost
            concurrent += 1
        return Decision(admitted, reason, state, math.ceil(retry_ms) / 1000, int(inflight), concurrent, lease)

    def refund(self, lease: Lease, tokens: int) -> None:
        """Give `tokens` back to the local TPM bucket that charged `lease` (capped at its capacity)."""
        cap = self._caps.get((lease.tenant_id, "tpm"))
        if cap is None or tokens <= 0:
            return
        self._store(lease.tenant_id, "tpm", cap, min(cap, self.level(lease.tenant_id, "tpm", cap) + tokens))

    def drop(self, lease: Lease) -> None:
        """Stop holding `lease` here (settled, or moved into Redis)."""
        mine = self.leases.get(lease.tenant_id)
        if mine is not None:
            mine.pop(lease.lease_id, None)
            if not mine:
                del self.leases[lease.tenant_id]

    def held(self) -> list[Lease]:
        """Every lease held locally."""
        return [le for mine in self.leases.values() for le in mine.values()]

    def bucket(self, tenant_id: str, which: str) -> tuple[float, float] | None:
        """(tokens now, capacity) of a local bucket, or None when it was never used."""
        cap = self._caps.get((tenant_id, which))
        return None if cap is None else (self.level(tenant_id, which, cap), cap)


__all__ = ["LocalAdmission"]
