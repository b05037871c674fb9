"""The admission path: admit, settle and renew leases through Redis, and keep admitting across Redis
outages (a per-tier policy, local buckets, recovery without loss).

`AdmissionControl` is what the request path calls to admit and settle (gateway/session.py). While Redis answers it is a thin layer
over `gateway.redis_buckets.RedisAdmission` (one Lua call per request) that also renews the leases of running
requests. When a Redis call fails (refused, reset, timed out) it marks Redis *down* and, until a PING
succeeds again (every ``redis_probe_interval_s``), never waits on Redis:

- a tier whose policy is ``fail_closed`` gets 503 (OpenAI-shaped, ``retry-after``) at once;
- a tier whose policy is ``degrade`` is admitted by `gateway.local_buckets.LocalAdmission`: this replica's in-memory
  buckets with every limit divided by the number of gateway replicas (RPM, TPM, in-flight tokens,
  concurrent requests), so N replicas together stay within the tenant's limits. N is the live count
  last seen in Redis (`gateway.replicas`; `set_live_replicas`), never below ``gateway_replicas``. This replica's own running
  requests (admitted through Redis before the outage) count against the local in-flight limits.
- settlements owed to Redis (a lease to release, a TPM refund) are kept and made when it is back.

Recovery (the first PING that succeeds), before any request is admitted through Redis again:

1. the scripts are loaded again (a restarted Redis has none) and every owed release is made; a
   release refunds only a lease Redis still holds, so a restarted (empty) Redis gets no refunds for
   reservations it never saw, and a repeated release changes nothing;
2. the lease of every request still running on this replica is renewed, and re-created where Redis
   lost it (restarted empty, or expired during the outage): no running request is left without its
   lease;
3. every lease held locally moves into Redis (its TPM charge stays in the local bucket that made it,
   which also receives its refund): after recovery each running request holds exactly one lease,
   in Redis.

Every Redis call made for one lease (renew, re-create, release) holds that lease's lock, so a
settlement can never be overtaken by a re-creation of the same lease.

A Redis that restarts between two calls (faster than this replica notices it is gone: redis-py
reconnects on its own) is detected by the admission script it no longer has (NOSCRIPT): the leases
of every running request are then renewed or re-created (step 3 above) before that admission runs,
so it counts them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from redis.exceptions import RedisError

from fairshare.config import TenantConfig

from .background import Background
from .local_buckets import LocalAdmission
from .redis_buckets import Decision, Lease, RedisAdmission

log = logging.getLogger("fairshare.gateway")

REDIS_ERRORS = (RedisError, OSError)


class RedisUnavailable(Exception):
    """Redis is unreachable and the tenant's tier fails closed. `retry_after_s`: when to try again."""

    def __init__(self, cause: str, retry_after_s: float) -> None:
        super().__init__(cause)
        self.cause = cause
        self.retry_after_s = retry_after_s


class AdmissionControl:
    """Admission, settlement and lease renewal across Redis outages (see the module docstring).

    policy(tier) -> ``fail_closed`` | ``degrade``. `metrics`: a `GatewayMetrics` (optional).
    """

    def __init__(self, admission: RedisAdmission, policy: Callable[[object], str], *, replicas: int = 1,
                 probe_interval_s: float = 0.5, renew_interval_s: float | None = None, metrics=None) -> None:
        self.admission = admission
        self.policy = policy
        self.replicas_floor = max(1, int(replicas))
        self.local = LocalAdmission(replicas, retry_s=max(1.0, probe_interval_s))
        self.probe_interval_s = probe_interval_s
        self.renew_interval_s = renew_interval_s or max(0.05, admission.lease_ttl_s / 3)
        self.metrics = metrics
        self.up = True
        self.down_since: float | None = None
        self.outages = 0
        self.live: dict[str, Lease] = {}  # leases of this replica not yet released, by lease id
        self.owed: dict[str, tuple[str, int, int | None]] = {}  # Redis releases to make: id -> (tenant, refund, tpm)
        self._wake = asyncio.Event()
        self._loop = Background("admission-control", self._run)
        self._recover_lock = asyncio.Lock()
        admission.on_scripts_lost = self._scripts_lost
        self._gauge()

    @property
    def lease_ttl_s(self) -> float:
        return self.admission.lease_ttl_s

    def set_live_replicas(self, n: int) -> None:
        """The live gateway replica count (`gateway.replicas.ReplicaRegistry`): degraded local
        buckets hold ``limit / max(floor, n)``, the floor being the configured ``replicas``."""
        self.local.replicas = max(self.replicas_floor, int(n))
        if self.metrics is not None:
            self.metrics.gateway_replicas.set(self.local.replicas)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.redis_up.set(1 if self.up else 0)

    def retry_after_s(self) -> float:
        """What a fail-closed 503 tells the client (at least 1 s)."""
        return max(1.0, self.probe_interval_s)

    def went_down(self, err: BaseException) -> None:
        """Record a failed Redis call: from now on requests take their tier's outage policy."""
        if self.metrics is not None:
            self.metrics.redis_errors.inc()
        if not self.up:
            return
        self.up = False
        self.down_since = time.monotonic()
        self.outages += 1
        self._gauge()
        log.error("Redis is unreachable (%s: %s); until it answers, tiers with policy 'degrade' are admitted "
                  "against this replica's buckets at limit/%d, the others get 503", type(err).__name__, err,
                  self.local.replicas)
        self._wake.set()

    async def _scripts_lost(self) -> None:
        """Redis answered NOSCRIPT: it restarted (or was flushed) since the scripts were loaded. Renew
        or re-create the leases of every running request before the admission that found it runs."""
        running = sum(1 for le in self.live.values() if le.store == "redis" and not le.settled)
        log.warning("Redis does not have the admission scripts (restarted, flushed, or not reachable when this "
                    "gateway started); restoring the leases of %d running request(s) before admitting", running)
        await self.admission.load()
        await self.renew_all()

    # -- admission ---------------------------------------------------------------------------------
    async def admit(self, tenant: TenantConfig, cost: int, lease_id: str, expected_s: float | None = None) -> Decision:
        """Admit through Redis, or by the tier's outage policy while Redis is down.

        expected_s: how long the request is expected to run (seconds; None: unknown): its lease's
        expected end, for the retry hints of later 429s (gateway/progress.py).
        Raises RedisUnavailable when Redis is down and the tier fails closed.
        """
        if self.up:
            running = [le for le in self.live.values() if le.tenant_id == tenant.id and le.store == "redis"]
            try:
                d = await self.admission.admit(tenant, cost, lease_id=lease_id, expected_s=expected_s,
                                               running=running)
            except REDIS_ERRORS as e:
                self.went_down(e)
                # the call may have been applied before the connection broke: release it (with a full
                # refund, made only if Redis holds that lease) once Redis answers again
                self.owed[lease_id] = (tenant.id, int(cost), tenant.limits.tpm)
                cause = type(e).__name__
            else:
                if d.lease is not None:
                    self.live[d.lease.lease_id] = d.lease
                return d
        else:
            cause = "down"
        if self.policy(tenant.tier) == "degrade":
            held = [le for le in self.live.values() if le.tenant_id == tenant.id and le.store == "redis"]
            d = self.local.admit(tenant, cost, lease_id, held)
            if d.lease is not None:
                self.live[d.lease.lease_id] = d.lease
                if self.metrics is not None:
                    self.metrics.degraded_admissions.labels(tenant.id).inc()
            return d
        raise RedisUnavailable(cause, self.retry_after_s())

    async def peek(self, tenant: TenantConfig) -> Decision | None:
        """The tenant's Redis buckets (for headers), or None while Redis is down or failing."""
        if not self.up:
            return None
        try:
            return await self.admission.peek(tenant)
        except REDIS_ERRORS as e:
            self.went_down(e)
            return None

    async def settle(self, lease: Lease, used_tokens: int) -> None:
        """Release `lease` and refund ``tokens - used`` to the bucket that charged it; exactly once.
        Never raises for Redis failures (the release is owed and made when Redis is back)."""
        async with lease.lock:
            if lease.settled:
                return
            lease.settled = True
            try:
                refund = max(0, lease.tokens - max(0, int(used_tokens)))
                lease.refunded = refund
                if lease.tpm_store == "local":
                    self.local.refund(lease, refund)
                if lease.store == "local":
                    self.local.drop(lease)
                    return
                redis_refund, tpm = (refund, lease.tpm_limit) if lease.tpm_store == "redis" else (0, None)
                if self.up:
                    try:
                        await self.admission.release(lease.tenant_id, lease.lease_id, redis_refund, tpm)
                        return
                    except REDIS_ERRORS as e:
                        self.went_down(e)
                self.owed[lease.lease_id] = (lease.tenant_id, redis_refund, tpm)
            finally:
                self.live.pop(lease.lease_id, None)  # held until released (or the release is owed)

    # -- renewal and recovery ----------------------------------------------------------------------
    async def _hold_in_redis(self, lease: Lease) -> None:
        """(Re)create `lease` in Redis (running request whose lease Redis lost, or a local lease moving
        into Redis). Raises Redis errors."""
        async with lease.lock:
            if lease.settled:
                return
            created = await self.admission.reinstate(lease)
            if lease.store == "local":
                self.local.drop(lease)
                lease.store = "redis"
                if self.metrics is not None:
                    self.metrics.leases_moved.inc()
            elif created:
                log.warning("lease %s of tenant %s was lost by Redis; re-created (%d tokens)", lease.lease_id,
                            lease.tenant_id, lease.tokens)
                if self.metrics is not None:
                    self.metrics.leases_reinstated.inc()

    async def renew_all(self) -> None:
        """Renew every Redis-held lease of a running request; re-create those Redis lost. Raises Redis errors."""
        leases = [le for le in self.live.values() if le.store == "redis" and not le.settled]
        if not leases:
            return
        held = await self.admission.renew_each(leases)
        for le, ok in zip(leases, held):
            if not ok and not le.settled:
                await self._hold_in_redis(le)

    async def recover(self) -> bool:
        """Try Redis; if it answers, settle what is owed, restore every lease and reopen. True when up."""
        async with self._recover_lock:
            if self.up:
                return True
            try:
                pool = getattr(self.admission.redis, "connection_pool", None)
                if pool is not None:  # connections to the old server are dead: do not hand them out again
                    await pool.disconnect()
                await self.admission.redis.ping()
                await self.admission.load()
                await self.renew_all()
                # requests settled or admitted locally meanwhile add to these: loop until both are empty
                while True:
                    if self.owed:
                        lid, (tid, refund, tpm) = next(iter(self.owed.items()))
                        await self.admission.release(tid, lid, refund, tpm)
                        self.owed.pop(lid, None)
                        continue
                    moving = next((le for le in self.live.values() if le.store == "local" and not le.settled), None)
                    if moving is None:
                        break
                    await self._hold_in_redis(moving)
            except REDIS_ERRORS as e:
                log.debug("Redis still unreachable: %s", type(e).__name__)
                return False
            down_for = time.monotonic() - (self.down_since or time.monotonic())
            self.up = True  # no await since the last check: no local lease or owed release is left
            self.down_since = None
            self._gauge()
            log.warning("Redis is reachable again after %.1f s; leases restored, admission back on Redis", down_for)
            return True

    async def _run(self) -> None:
        while True:
            try:
                if self.up:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout=self.renew_interval_s)
                    except asyncio.TimeoutError:
                        pass
                    if self.up:
                        try:
                            await self.renew_all()
                        except REDIS_ERRORS as e:
                            self.went_down(e)
                else:
                    await asyncio.sleep(self.probe_interval_s)
                    await self.recover()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("lease renewal / Redis probe failed")
                await asyncio.sleep(self.probe_interval_s)

    def start(self) -> None:
        """Start renewing leases (and probing Redis while it is down) on the running loop."""
        self._loop.start()

    async def stop(self) -> None:
        """Stop the background task."""
        await self._loop.stop()


__all__ = ["REDIS_ERRORS", "AdmissionControl", "RedisUnavailable"]
