"""The local buckets (gateway/local_buckets.py `LocalAdmission`, used while Redis is down) and the Redis
buckets (gateway/bucket.lua inside the admission and settle scripts) are one rule: on random
request sequences (random limits, costs, refunds and time steps) they give the same decision, the
same reason, the same retry hint and the same ``x-ratelimit-*`` figures.

Time is driven explicitly, the same clock for both by construction: the scripts take the caller's
clock (`RedisAdmission.clock_ms`, ARGV "the clock in ms") instead of Redis TIME, and `LocalAdmission`
takes `clock_ms`. A real redis-server runs the real scripts. The one thing in the scripts that
still follows Redis's own clock is a bucket key's expiry (a missing bucket reads as full), so the
test removes it in the same MULTI/EXEC as the script call: nothing here depends on how fast the
machine is.

Deliberate differences, not compared: a request that can never fit (cost above the TPM or in-flight
limit) is a 400 from Redis but a 429 from the local share (it may fit when Redis is back), so for it
only "both refuse" is checked; concurrency and in-flight retry hints come from lease end estimates in
Redis and from the probe interval locally, so the hint is compared only when no lease limit refused.
Replicas: 1 (the local share is then the whole limit).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import redis.asyncio as aredis
from hypothesis import given, settings
from hypothesis import strategies as st

from fairshare.config import TenantConfig
from gateway.redis_buckets import RedisAdmission, Decision, Lease
from gateway.local_buckets import LocalAdmission

_ids = itertools.count()
LIMITS = st.fixed_dictionaries({
    "rpm": st.one_of(st.none(), st.integers(1, 120)),
    "tpm": st.one_of(st.none(), st.integers(1, 20_000)),
    "max_inflight_tokens": st.one_of(st.none(), st.integers(1, 30_000)),
    "max_concurrent_requests": st.one_of(st.none(), st.integers(1, 6)),
})
STEP_MS = st.one_of(st.just(0.0), st.floats(0, 50), st.floats(0, 5_000), st.floats(0, 90_000))
OP = st.one_of(
    st.tuples(st.just("admit"), STEP_MS, st.integers(0, 25_000)),
    st.tuples(st.just("settle"), STEP_MS, st.integers(0, 10**6), st.floats(0, 1.2)),  # lease pick, used share
)


async def _script(r, sha: str, keys: list, args: list, persist: list[str]) -> object:
    """Run a loaded script and take the real-time expiry off `persist` keys, atomically."""
    async with r.pipeline(transaction=True) as p:
        p.evalsha(sha, len(keys), *keys, *args)
        for k in persist:
            p.persist(k)
        return (await p.execute())[0]


def _figures(d: Decision, with_retry: bool) -> tuple:
    s = d.state
    return (d.admitted, d.reason, s.rpm_limit, s.rpm_remaining, s.rpm_reset_s, s.tpm_limit, s.tpm_remaining,
            s.tpm_reset_s, d.inflight_tokens, d.concurrent, d.retry_after_s if with_retry else None)


async def _run(redis_url: str, limits: dict, ops: list[tuple]) -> int:
    tenant = TenantConfig(id=f"parity-{next(_ids)}", limits=limits)
    lim = tenant.limits
    r = aredis.Redis.from_url(redis_url)
    now = [1_700_000_000_000.0]
    adm = RedisAdmission(r, prefix="parity", lease_ttl_s=10**7)  # leases outlive every sequence's time span
    adm.clock_ms = lambda: now[0]
    local = LocalAdmission(1, clock_ms=lambda: now[0], retry_s=1.0)
    live: list[tuple[Lease, Lease]] = []
    compared = 0
    try:
        await adm.load()
        for op in ops:
            now[0] += op[1]
            if op[0] == "admit":
                cost, lid = op[2], uuid.uuid4().hex
                keys, args = adm.admit_args(tenant, cost, lid)
                raw = await _script(r, adm._admit.sha, keys, args, keys[:2])
                remote = RedisAdmission.decision(raw, tenant, Lease(tenant.id, lid, cost, lim.tpm))
                mine = local.admit(tenant, cost, lid)
                never = (lim.tpm is not None and cost > lim.tpm) or (
                    lim.max_inflight_tokens is not None and cost > lim.max_inflight_tokens)
                if never:
                    assert not remote.admitted and not mine.admitted, (remote, mine)
                    assert remote.reason in ("tokens_never_fit", "inflight_never_fit"), remote
                    continue
                held = sum(le.tokens for le, _ in live)
                lease_refused = (lim.max_concurrent_requests is not None and len(live) + 1 > lim.max_concurrent_requests
                                 ) or (lim.max_inflight_tokens is not None and held + cost > lim.max_inflight_tokens)
                assert _figures(remote, not lease_refused) == _figures(mine, not lease_refused), (op, remote, mine)
                compared += 1
                if remote.admitted:
                    live.append((remote.lease, mine.lease))
            elif live:
                remote_lease, local_lease = live.pop(op[2] % len(live))
                refund = max(0, remote_lease.tokens - int(remote_lease.tokens * op[3]))
                keys, args = adm.release_args(tenant.id, remote_lease.lease_id, refund, lim.tpm)
                assert await _script(r, adm._settle.sha, keys, args, keys[:1]) == 1
                local.refund(local_lease, refund)
                local.drop(local_lease)
                if lim.tpm is not None and refund > 0:  # the refunded bucket: same level in both
                    stored = await r.hmget(keys[0], ["t", "ts"])
                    assert float(stored[0]) == local.bucket(tenant.id, "tpm")[0] and float(stored[1]) == now[0]
    finally:
        await r.delete(*adm.keys(tenant.id), adm.ends_key(tenant.id))
        await r.aclose()
    return compared


@settings(max_examples=150)
@given(limits=LIMITS, ops=st.lists(OP, min_size=1, max_size=40))
def test_local_and_redis_buckets_decide_alike(redis_url, limits, ops):
    asyncio.run(_run(redis_url, limits, ops))


def test_buckets_agree_on_a_long_mixed_sequence(redis_url):
    """A fixed sequence that drains, refills, refunds and retries (a run of the same rule that
    certainly compares many decisions, whatever Hypothesis draws)."""
    ops = []
    for i in range(300):
        ops.append(("admit", [0.0, 7.5, 333.3, 1_000.0, 45_000.0][i % 5], [1, 50, 400, 999, 3][i % 4]))
        if i % 3 == 0:
            ops.append(("settle", 13.0, i, 0.4))
    compared = asyncio.run(_run(redis_url, {"rpm": 30, "tpm": 2_000, "max_inflight_tokens": None,
                                            "max_concurrent_requests": None}, ops))
    assert compared == 300
