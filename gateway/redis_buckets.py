"""The Redis side of admission: RPM and TPM token buckets plus an in-flight-token lease, one round trip.

`RedisAdmission.admit` runs `admission.lua` (registered with ``register_script``) once per request: it
checks the tenant's requests-per-minute bucket, tokens-per-minute bucket (reserving
``prompt + max_tokens`` tokens), in-flight tokens and concurrent requests, and charges all of them or
none. An admitted request holds a `Lease` (a member of the tenant's lease set with an expiry time,
default 15 s) that is renewed while the request runs (`RedisAdmission.renew_each`, called every
``ttl/3`` seconds by `gateway.admission.AdmissionControl`, which also handles Redis outages); a gateway
that dies leaves leases that expire on their own. `RedisAdmission.settle` refunds ``reserved - used`` TPM
tokens and releases the lease; it is idempotent (guarded here and in Redis by the presence of the
lease).
`RedisAdmission.reinstate` re-creates the lease of a request still running when Redis lost it.

Each lease also carries when its request is expected to end (``lease_ends``: set at admission from
the gateway's measured output rate, refreshed at every renewal, gateway/progress.py), so a 429 for
concurrency or in-flight tokens says when enough running requests will have ended (see
``admission.lua``) rather than quoting the lease TTL.

Keys are ``<prefix>:{<tenant>}:rpm|tpm|leases|lease_tokens|lease_ends``; the ``{tenant}`` hash tag
keeps a tenant's keys in one Redis Cluster slot.

Admissions and settlements of concurrent requests issued in the same event-loop iteration share one
pipeline (gateway/redis_batch.py); each still runs on its own in Redis.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Iterable

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from fairshare.config import TenantConfig

from .redis_batch import CommandBatcher

_BUCKET_LUA = (Path(__file__).with_name("bucket.lua")).read_text(encoding="utf-8")
_ADMIT_LUA = _BUCKET_LUA + (Path(__file__).with_name("admission.lua")).read_text(encoding="utf-8")

_SETTLE_LUA = _BUCKET_LUA + """
-- KEYS: 1 TPM bucket, 2 leases zset, 3 leases hash, 4 lease ends hash.  ARGV: 1 tpm limit (-1 = none),
-- 2 lease id, 3 refund (tokens), 4 the clock in ms (-1 = Redis TIME). Refunds only if the lease was
-- still held, so a repeated call changes nothing.
local limit, id, refund = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local had = redis.call('HDEL', KEYS[3], id)
redis.call('ZREM', KEYS[2], id)
redis.call('HDEL', KEYS[4], id)
if had == 1 and limit >= 0 and refund > 0 then
  local now = clock_ms(ARGV[4])
  local tokens, rate = bucket_level(KEYS[1], limit, now)
  bucket_store(KEYS[1], limit, math.min(limit, tokens + refund), rate, now)
end
return had
"""


def bucket_level(tokens: float, at_ms: float, now_ms: float, limit: float) -> float:
    """Tokens in a bucket of capacity `limit` at `now_ms` that held `tokens` at `at_ms`: the refill
    rule of gateway/bucket.lua in Python, operation for operation (continuous refill at
    ``limit / 60000`` per ms, capped at `limit`), so the local buckets of gateway/local_buckets.py decide
    exactly as Redis does (tests/integration/test_bucket_parity.py)."""
    if now_ms > at_ms:
        tokens = tokens + (now_ms - at_ms) * (limit / 60000.0)
    return limit if tokens > limit else tokens


def bucket_wait_ms(tokens: float, need: float, limit: float) -> float:
    """Milliseconds until a bucket of capacity `limit` holding `tokens` holds `need` (admission.lua's
    retry and reset figures; callers round up)."""
    return (need - tokens) / (limit / 60000.0)

_RENEW_LUA = """
-- KEYS: 1 leases zset, 2 leases hash, 3 lease ends hash. ARGV: 1 ttl (ms), 2 lease id, 3 expected
-- remaining ms of its request (-1 = unknown: the stored end stays). Extends a lease that still
-- exists (never re-creates a settled or expired one). Returns 1 when renewed.
local ttl, id, left = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3] or '-1')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local score = redis.call('ZSCORE', KEYS[1], id)
if not score or tonumber(score) <= now then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + ttl, id)
if left >= 0 then redis.call('HSET', KEYS[3], id, string.format('%.17g', now + left)) end
for _, k in ipairs(KEYS) do
  if redis.call('PTTL', k) < ttl + 1000 then redis.call('PEXPIRE', k, math.ceil(ttl) + 1000) end
end
return 1
"""

_REINSTATE_LUA = """
-- KEYS: 1 leases zset, 2 leases hash, 3 lease ends hash. ARGV: 1 ttl (ms), 2 lease id, 3 tokens,
-- 4 expected remaining ms (-1 = unknown). (Re)creates the lease of
-- a request that is still running but whose lease Redis lost (restarted empty, or expired while
-- Redis was unreachable), or moves a lease held locally during an outage into Redis. Returns 1 when
-- the lease had to be created, 0 when it existed (then only its expiry is extended).
local ttl, id, tokens, left = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4] or '-1')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local existed = redis.call('HEXISTS', KEYS[2], id)
redis.call('ZADD', KEYS[1], now + ttl, id)
redis.call('HSET', KEYS[2], id, tokens)
if left >= 0 then redis.call('HSET', KEYS[3], id, string.format('%.17g', now + left)) end
for _, k in ipairs(KEYS) do
  if redis.call('PTTL', k) < ttl + 1000 then redis.call('PEXPIRE', k, math.ceil(ttl) + 1000) end
end
return 1 - existed
"""

REASONS = {0: "ok", 1: "requests", 2: "tokens", 3: "inflight_tokens", 4: "concurrent_requests",
           5: "tokens_never_fit", 6: "inflight_never_fit"}


def format_duration(seconds: float) -> str:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``12ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    ms_total = math.ceil(seconds * 1000)
    h, rem = divmod(ms_total, 3_600_000)
    m, rem = divmod(rem, 60_000)
    s = rem / 1000
    s_txt = (f"{s:.3f}".rstrip("0").rstrip(".")) + "s"
    if h:
        return f"{h}h{m}m{s_txt}"
    if m:
        return f"{m}m{s_txt}"
    return s_txt


@dataclass(frozen=True)
class RateLimitState:
    """Bucket state after a decision. Limits are per minute; ``None`` = unlimited. Resets in seconds."""

    rpm_limit: int | None
    rpm_remaining: int | None
    rpm_reset_s: float
    tpm_limit: int | None
    tpm_remaining: int | None
    tpm_reset_s: float

    def headers(self) -> dict[str, str]:
        """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits that exist."""
        h: dict[str, str] = {}
        if self.rpm_limit is not None:
            h["x-ratelimit-limit-requests"] = str(self.rpm_limit)
            h["x-ratelimit-remaining-requests"] = str(max(0, self.rpm_remaining or 0))
            h["x-ratelimit-reset-requests"] = format_duration(self.rpm_reset_s)
        if self.tpm_limit is not None:
            h["x-ratelimit-limit-tokens"] = str(self.tpm_limit)
            h["x-ratelimit-remaining-tokens"] = str(max(0, self.tpm_remaining or 0))
            h["x-ratelimit-reset-tokens"] = format_duration(self.tpm_reset_s)
        return h


@dataclass(eq=False)
class Lease:
    """An admitted request's hold on its tenant's limits: `tokens` reserved (TPM and in flight).

    ``store``: where the in-flight lease is held, ``redis`` or ``local`` (this replica's buckets while
    Redis is unreachable, see gateway/local_buckets.py); ``tpm_store``: where its TPM reservation was charged
    (and so where the unused part is refunded). A local lease moves to Redis when Redis returns; its
    TPM charge stays where it was made. ``lock`` orders the Redis calls made for one lease.
    """

    tenant_id: str
    lease_id: str
    tokens: int
    tpm_limit: int | None
    settled: bool = False
    refunded: int = 0
    store: str = "redis"
    tpm_store: str = "redis"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    # () -> seconds its request still needs (None: unknown); set by the app once the request runs
    remaining_s: Callable[[], float | None] | None = field(default=None, repr=False)

    def remaining_ms(self) -> int:
        """Expected remaining milliseconds of its request, or -1 when unknown (the scripts' convention)."""
        left = self.remaining_s() if self.remaining_s is not None else None
        return -1 if left is None else max(0, round(left * 1000))


@dataclass(frozen=True)
class Decision:
    """Outcome of `RedisAdmission.admit`.

    ``reason`` is one of ``ok``, ``requests``, ``tokens``, ``inflight_tokens``, ``concurrent_requests``,
    ``tokens_never_fit``, ``inflight_never_fit``; ``retry_after_s`` is the time (seconds) until the
    limiting bucket holds enough (for leases: until the oldest lease expires unless renewed).
    """

    admitted: bool
    reason: str
    state: RateLimitState
    retry_after_s: float
    inflight_tokens: int
    concurrent: int
    lease: Lease | None = None


def tenant_keys(prefix: str, tenant_id: str) -> list[str]:
    """``[rpm, tpm, leases, lease_tokens]`` keys of a tenant, hash-tagged ``{tenant_id}``."""
    base = f"{prefix}:{{{tenant_id}}}"
    return [f"{base}:rpm", f"{base}:tpm", f"{base}:leases", f"{base}:lease_tokens"]


def lease_ends_key(prefix: str, tenant_id: str) -> str:
    """The hash of a tenant's leases' expected end times (ms, Redis clock), in the tenant's slot."""
    return f"{prefix}:{{{tenant_id}}}:lease_ends"


MAX_HINTS = 64  # running leases whose fresh estimate one admission call carries (the soonest to end)


def _lim(v: int | None) -> int:
    return -1 if v is None else int(v)


class RedisAdmission:
    """Per-tenant admission in Redis (see module docstring). Raises redis exceptions when Redis fails.

    on_scripts_lost: an async callable run when Redis answers an admission with NOSCRIPT (it lost
    the scripts: restarted, or flushed) before the scripts are loaded again and the call repeated;
    `gateway.admission.AdmissionControl` restores the leases of running requests there, so that the
    admission that follows counts them.
    """

    def __init__(self, redis: Redis | RedisCluster, prefix: str = "fairshare", lease_ttl_s: float = 15.0) -> None:
        self.redis = redis
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s
        self.on_scripts_lost: Callable[[], Awaitable[None]] | None = None
        # () -> the scripts' clock in ms; None: Redis TIME (production). Tests drive time with it.
        self.clock_ms: Callable[[], float] | None = None
        self.scripts_lost = 0  # times Redis was found without the scripts
        self.batcher = CommandBatcher(redis)  # admissions and settlements of one loop iteration: one pipeline
        self._admit = redis.register_script(_ADMIT_LUA)
        self._settle = redis.register_script(_SETTLE_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        self._reinstate = redis.register_script(_REINSTATE_LUA)

    async def load(self) -> None:
        """Load the scripts into Redis now, so that each later call is a single EVALSHA round trip."""
        for script in (self._admit, self._settle, self._renew, self._reinstate):
            script.sha = await self.redis.script_load(script.script)

    def keys(self, tenant_id: str) -> list[str]:
        """Redis keys of a tenant: RPM bucket, TPM bucket, lease zset, lease hash (one hash slot)."""
        return tenant_keys(self.prefix, tenant_id)

    def ends_key(self, tenant_id: str) -> str:
        """The tenant's lease-ends hash (same hash slot as `keys`)."""
        return lease_ends_key(self.prefix, tenant_id)

    async def _eval_admit(self, keys: list[str], args: list):
        """Run the admission script (batched: `CommandBatcher`); when Redis lost it, call
        `on_scripts_lost`, reload, repeat."""
        try:
            return await self._evalsha(self._admit, keys, args)
        except NoScriptError:
            self.scripts_lost += 1
            if self.on_scripts_lost is not None:
                await self.on_scripts_lost()
            await self.load()
            return await self._evalsha(self._admit, keys, args)

    async def _evalsha(self, script, keys: list[str], args: list):
        """EVALSHA of the registered `script` through the batcher; raises NoScriptError when Redis
        does not hold it."""
        return await self.batcher.execute("EVALSHA", script.sha, len(keys), *keys, *args)

    @staticmethod
    def decision(raw: list, tenant: TenantConfig, lease: Lease | None) -> Decision:
        """The `Decision` of the admission script's answer `raw` (`lease`: the one it was asked to admit)."""
        vals = [int(x) for x in raw]
        admitted, reason, rl, rrem, rreset, tl, trem, treset, retry_ms, inflight, conc = vals
        state = RateLimitState(
            rpm_limit=None if rl < 0 else rl, rpm_remaining=None if rl < 0 else rrem, rpm_reset_s=rreset / 1000,
            tpm_limit=None if tl < 0 else tl, tpm_remaining=None if tl < 0 else trem, tpm_reset_s=treset / 1000,
        )
        return Decision(bool(admitted), REASONS.get(reason, str(reason)), state, retry_ms / 1000, inflight, conc,
                        lease if admitted else None)

    def _args(self, mode: str, tenant: TenantConfig, cost: int, lease_id: str, expected_s: float | None = None,
              running: Iterable[Lease] = ()) -> list:
        lim = tenant.limits
        args = [mode, _lim(lim.rpm), _lim(lim.tpm), _lim(lim.max_inflight_tokens), _lim(lim.max_concurrent_requests),
                int(cost), lease_id, int(self.lease_ttl_s * 1000),
                -1 if expected_s is None else max(0, round(expected_s * 1000)), self._now_arg()]
        if lim.max_inflight_tokens is not None or lim.max_concurrent_requests is not None:
            hints = sorted((ms, le.lease_id) for le in running if not le.settled and (ms := le.remaining_ms()) >= 0)
            for ms, lid in hints[:MAX_HINTS]:
                args += [lid, ms]
        return args

    def _now_arg(self) -> str:
        return "-1" if self.clock_ms is None else repr(float(self.clock_ms()))

    def release_args(self, tenant_id: str, lease_id: str, refund: int, tpm_limit: int | None) -> tuple[list, list]:
        """(keys, args) of the settle script for `release`."""
        k = self.keys(tenant_id)
        return ([k[1], k[2], k[3], self.ends_key(tenant_id)],
                [_lim(tpm_limit), lease_id, int(refund), self._now_arg()])

    def admit_args(self, tenant: TenantConfig, cost: int, lease_id: str, expected_s: float | None = None,
                   running: Iterable[Lease] = (), mode: str = "admit") -> tuple[list, list]:
        """(keys, args) of the admission script (`admit`; ``mode="peek"``: `peek`)."""
        return (self.keys(tenant.id) + [self.ends_key(tenant.id)],
                self._args(mode, tenant, cost, lease_id, expected_s, running))

    async def admit(self, tenant: TenantConfig, cost: int, lease_id: str | None = None, *,
                    expected_s: float | None = None, running: Iterable[Lease] = ()) -> Decision:
        """Admit a request reserving `cost` tokens (prompt + max_tokens), all-or-nothing, one round trip.

        expected_s: how long the request is expected to run (seconds; None: unknown), stored as its
        lease's end. running: this gateway's running leases of the tenant, whose current estimates
        (`Lease.remaining_s`) the retry hint of a concurrency or in-flight 429 uses.
        On success the decision carries a `Lease` that must be settled with `settle`.
        """
        lease_id = lease_id or uuid.uuid4().hex
        raw = await self._eval_admit(*self.admit_args(tenant, cost, lease_id, expected_s, running))
        lease = Lease(tenant.id, lease_id, int(cost), tenant.limits.tpm)
        return self.decision(raw, tenant, lease)

    async def peek(self, tenant: TenantConfig) -> Decision:
        """Report the tenant's buckets and leases without charging anything."""
        raw = await self._eval_admit(*self.admit_args(tenant, 0, "-", mode="peek"))
        return self.decision(raw, tenant, None)

    async def settle(self, lease: Lease, used_tokens: int) -> bool:
        """Release `lease` and refund ``lease.tokens - used_tokens`` TPM tokens (never negative).

        Idempotent: only the first call has an effect; returns True when this call released the lease.
        """
        if lease.settled:
            return False
        lease.settled = True
        refund = max(0, lease.tokens - max(0, int(used_tokens)))
        lease.refunded = refund
        return await self.release(lease.tenant_id, lease.lease_id, refund, lease.tpm_limit)

    async def release(self, tenant_id: str, lease_id: str, refund: int, tpm_limit: int | None) -> bool:
        """Remove a lease and, only if it was still held, refund `refund` tokens to the TPM bucket of
        limit `tpm_limit` (None: no refund). No guard on this side: safe to repeat (a second call finds
        no lease and refunds nothing). Returns True when the lease was held."""
        keys, args = self.release_args(tenant_id, lease_id, refund, tpm_limit)
        try:
            return bool(await self._evalsha(self._settle, keys, args))
        except NoScriptError:  # Redis lost the scripts: this one is loaded again; the next admission
            # finds its own missing and runs `on_scripts_lost` (the running leases are restored there)
            self._settle.sha = await self.redis.script_load(self._settle.script)
            return bool(await self._evalsha(self._settle, keys, args))

    async def renew(self, leases: list[Lease]) -> int:
        """Extend every live lease by the TTL in one pipelined round trip; returns how many were renewed."""
        return sum(await self.renew_each(leases))

    def _lease_keys(self, tenant_id: str) -> list[str]:
        k = self.keys(tenant_id)
        return [k[2], k[3], self.ends_key(tenant_id)]

    async def renew_each(self, leases: list[Lease]) -> list[bool]:
        """Extend every unsettled lease of `leases` by the TTL and refresh its expected end (one
        pipelined round trip); for each of them, whether Redis still held it (settled ones are skipped
        and count as False)."""
        live = [le for le in leases if not le.settled]
        out = [False] * len(leases)
        if not live:
            return out
        ttl_ms = int(self.lease_ttl_s * 1000)
        if not isinstance(self.redis, Redis):  # Redis Cluster: one call per lease, each to its slot's node
            res = await asyncio.gather(*(self._renew(keys=self._lease_keys(le.tenant_id),
                                                     args=[ttl_ms, le.lease_id, le.remaining_ms()]) for le in live))
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for le in live:
                    await self._renew(keys=self._lease_keys(le.tenant_id),
                                      args=[ttl_ms, le.lease_id, le.remaining_ms()], client=pipe)
                res = await pipe.execute()
        renewed = {id(le) for le, r in zip(live, res) if int(r)}
        return [id(le) in renewed for le in leases]

    async def reinstate(self, lease: Lease) -> bool:
        """Hold `lease` in Redis again (its tokens, a fresh TTL) whatever Redis remembers of it: for a
        request that is still running. Returns True when Redis did not hold it."""
        created = await self._reinstate(keys=self._lease_keys(lease.tenant_id),
                                        args=[int(self.lease_ttl_s * 1000), lease.lease_id, int(lease.tokens),
                                              lease.remaining_ms()])
        return bool(int(created))

    async def leases(self, tenant_id: str) -> dict[str, int]:
        """The tenant's unexpired leases: lease id -> tokens (for tests and operators)."""
        k = self.keys(tenant_id)
        t = await self.redis.time()
        now_ms = t[0] * 1000 + t[1] / 1000
        live = await self.redis.zrangebyscore(k[2], f"({now_ms}", "+inf")
        if not live:
            return {}
        vals = await self.redis.hmget(k[3], live)
        return {(m.decode() if isinstance(m, bytes) else m): int(float(v)) for m, v in zip(live, vals) if v is not None}

    async def ends(self, tenant_id: str) -> dict[str, float]:
        """The stored expected end (ms, Redis clock) of each of the tenant's leases that has one."""
        raw = await self.redis.hgetall(self.ends_key(tenant_id))
        return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}

    async def bucket(self, tenant_id: str, which: str) -> tuple[float, float] | None:
        """Stored (tokens, timestamp ms) of the ``rpm`` or ``tpm`` bucket, or None when absent (= full)."""
        key = self.keys(tenant_id)[0 if which == "rpm" else 1]
        v = await self.redis.hmget(key, ["t", "ts"])
        if v[0] is None:
            return None
        return float(v[0]), float(v[1])
