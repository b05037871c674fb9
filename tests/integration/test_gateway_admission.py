"""Admission Lua against a real redis-server: buckets, leases, all-or-nothing, settlement, expiry."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.crc import key_slot

from fairshare.config import TenantConfig
from gateway.redis_buckets import RedisAdmission, format_duration
from tests.support.waits import wait_for


def tenant(**limits) -> TenantConfig:
    return TenantConfig(id="t-" + uuid.uuid4().hex[:10], limits=limits)


@pytest.fixture
async def adm(redis_url):
    r = Redis.from_url(redis_url)
    a = RedisAdmission(r, lease_ttl_s=15.0)
    await a.load()
    yield a
    await r.aclose()


async def redis_now_ms(a: RedisAdmission) -> float:
    s, us = await a.redis.time()
    return s * 1000 + us / 1000


def test_format_duration():
    assert format_duration(0.012) == "12ms"
    assert format_duration(0.0001) == "1ms"
    assert format_duration(1.0) == "1s"
    assert format_duration(1.5) == "1.5s"
    assert format_duration(360.0) == "6m0s"
    assert format_duration(61.25) == "1m1.25s"
    assert format_duration(3723.0) == "1h2m3s"
    assert format_duration(0) == "0s"


async def test_keys_share_one_cluster_slot(adm):
    keys = adm.keys("acme")
    assert all("{acme}" in k for k in keys)
    assert len({key_slot(k.encode()) for k in keys}) == 1
    assert key_slot(adm.keys("acme")[0].encode()) != key_slot(adm.keys("globex")[0].encode())


async def test_tpm_bucket_admits_until_empty_and_reports_real_refill(adm):
    t = tenant(tpm=600)  # 10 tokens/s
    d1 = await adm.admit(t, 400)
    assert d1.admitted and d1.state.tpm_remaining == 200 and d1.state.tpm_limit == 600
    d2 = await adm.admit(t, 300)
    assert not d2.admitted and d2.reason == "tokens"
    # 100 missing tokens at 10 tokens/s: ~10 s (a few ms of refill may already have happened)
    assert 9.9 <= d2.retry_after_s <= 10.0
    assert 39.9 <= d1.state.tpm_reset_s <= 40.0  # 400 tokens to refill to full
    await adm.settle(d1.lease, 400)


async def test_rejection_charges_nothing(adm):
    t = tenant(rpm=10, tpm=1000, max_inflight_tokens=300, max_concurrent_requests=5)
    d1 = await adm.admit(t, 250)
    assert d1.admitted
    before_rpm = await adm.bucket(t.id, "rpm")
    before_tpm = await adm.bucket(t.id, "tpm")
    d2 = await adm.admit(t, 100)  # TPM and RPM would allow it; in-flight does not (250 + 100 > 300)
    assert not d2.admitted and d2.reason == "inflight_tokens"
    assert await adm.bucket(t.id, "rpm") == before_rpm
    assert await adm.bucket(t.id, "tpm") == before_tpm
    assert list((await adm.leases(t.id)).values()) == [250]
    await adm.settle(d1.lease, 250)


async def test_concurrency_limit(adm):
    t = tenant(max_concurrent_requests=2)
    a, b = await adm.admit(t, 1), await adm.admit(t, 1)
    c = await adm.admit(t, 1)
    assert a.admitted and b.admitted and not c.admitted and c.reason == "concurrent_requests"
    assert c.retry_after_s > 0
    await adm.settle(a.lease, 1)
    d = await adm.admit(t, 1)
    assert d.admitted
    for x in (b, d):
        await adm.settle(x.lease, 1)
    assert await adm.leases(t.id) == {}


async def test_rpm_bucket(adm):
    t = tenant(rpm=2)
    assert (await adm.admit(t, 0)).admitted and (await adm.admit(t, 0)).admitted
    d = await adm.admit(t, 0)
    assert not d.admitted and d.reason == "requests"
    assert 29.9 <= d.retry_after_s <= 30.0  # one request refills in 60/2 s


async def test_never_fit(adm):
    t = tenant(tpm=100, max_inflight_tokens=50)
    d = await adm.admit(t, 101)
    assert not d.admitted and d.reason == "tokens_never_fit"
    d = await adm.admit(t, 60)
    assert not d.admitted and d.reason == "inflight_never_fit"
    assert await adm.bucket(t.id, "tpm") is None  # untouched: still full


async def test_settle_refunds_unused_once(adm):
    t = tenant(tpm=60000)  # 1 token/ms
    d = await adm.admit(t, 5000)
    tokens0, ts0 = await adm.bucket(t.id, "tpm")
    assert await adm.settle(d.lease, 1200)
    assert not await adm.settle(d.lease, 0)  # idempotent
    d.lease.settled = False                  # even a buggy second call is refused by Redis
    assert not await adm.settle(d.lease, 0)
    tokens1, ts1 = await adm.bucket(t.id, "tpm")
    expected = min(60000, tokens0 + (ts1 - ts0) * 1.0 + 3800)
    assert tokens1 == pytest.approx(expected, abs=1e-3)
    assert await adm.leases(t.id) == {}


async def test_leases_expire_unless_renewed(redis_url):
    """`kept` is renewed until Redis's own clock is past the expiry stored for `lost`, which nobody
    renews: the end is a state of Redis, not a sleep. The TTL (1 s) leaves a renewal that a loaded
    machine delays by most of a second still in time (the app renews every TTL / 3: gateway.admission)."""
    r = Redis.from_url(redis_url)
    a = RedisAdmission(r, lease_ttl_s=1.0)
    t = tenant(max_inflight_tokens=100)
    kept = await a.admit(t, 40)
    lost = await a.admit(t, 60)
    assert not (await a.admit(t, 1)).admitted
    zset = a.keys(t.id)[2]
    lost_expiry = await r.zscore(zset, lost.lease.lease_id)
    kept_expiry = await r.zscore(zset, kept.lease.lease_id)
    while await redis_now_ms(a) <= lost_expiry:  # renewing `kept` all along
        assert await a.renew([kept.lease]) == 1
        await asyncio.sleep(0.05)
    assert await a.renew([kept.lease]) == 1
    assert await r.zscore(zset, kept.lease.lease_id) > kept_expiry  # renewal moved its expiry on
    assert list((await a.leases(t.id)).values()) == [40]  # the un-renewed one expired
    d = await a.admit(t, 60)  # the script drops expired leases before counting
    assert d.admitted and d.inflight_tokens == 100
    await a.settle(kept.lease, 0)
    await a.settle(d.lease, 0)
    assert await a.renew([lost.lease]) == 0  # never re-creates an expired lease
    kept.lease.settled = False
    assert await a.renew([kept.lease]) == 0  # nor a settled one
    assert await a.leases(t.id) == {}
    await r.aclose()


async def test_fifty_concurrent_admits_never_exceed_limits(adm):
    t = tenant(tpm=600, max_inflight_tokens=400, max_concurrent_requests=10)
    decisions = await asyncio.gather(*(adm.admit(t, 30) for _ in range(50)))
    admitted = [d for d in decisions if d.admitted]
    assert sum(d.lease.tokens for d in admitted) <= 400
    assert len(admitted) == 10  # concurrency is the tightest limit: 10 x 30 = 300 <= 400, <= 600
    assert sorted(d.concurrent for d in admitted) == list(range(1, 11))
    for d in admitted:
        await adm.settle(d.lease, 30)
    assert await adm.leases(t.id) == {}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "settle"]), st.integers(1, 120), st.integers(0, 120)),
                    min_size=1, max_size=25))
def test_invariants_under_random_sequences(redis_url, ops):
    """In-flight tokens and concurrency never exceed limits; TPM never goes negative; settled = released."""

    async def run():
        r = Redis.from_url(redis_url)
        a = RedisAdmission(r)
        t = tenant(tpm=300, max_inflight_tokens=200, max_concurrent_requests=3)
        held = []
        for op, cost, used in ops:
            if op == "admit":
                d = await a.admit(t, cost)
                if d.admitted:
                    held.append(d.lease)
                assert d.inflight_tokens <= 200 and d.concurrent <= 3
                assert (d.state.tpm_remaining or 0) >= 0
            elif held:
                await a.settle(held.pop(0), used)
            leases = await a.leases(t.id)
            assert sum(leases.values()) == sum(le.tokens for le in held) <= 200
            b = await a.bucket(t.id, "tpm")
            assert b is None or -1e-6 <= b[0] <= 300
        for le in held:
            await a.settle(le, 0)
        assert await a.leases(t.id) == {}
        await r.aclose()

    asyncio.run(run())


@pytest.fixture(scope="module")
def redis_cluster_url(tmp_path_factory):
    """A 3-primary Redis Cluster on loopback ports (redis-server + redis-cli --cluster create)."""
    import shutil
    import subprocess

    from fairshare.local_redis import find_redis_server
    from fairshare.ports import free_port, wait_for_port

    cli = shutil.which("redis-cli")
    server = find_redis_server()
    assert cli and server, "redis-server and redis-cli are needed"
    procs, ports = [], []
    def cluster_port() -> int:  # the cluster bus listens on port + 10000: keep both free and valid
        import socket

        while True:
            port = free_port()
            if port + 10000 > 65535 or port in ports:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port

    for i in range(3):
        port = cluster_port()
        d = tmp_path_factory.mktemp(f"cluster{i}")
        procs.append(subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--cluster-enabled", "yes", "--dir", str(d),
                                       "--cluster-config-file", str(d / "nodes.conf"), "--loglevel", "warning"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for_port("127.0.0.1", port, 15, procs[-1])
        ports.append(port)
    subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas", "0",
                    "--cluster-yes"], check=True, capture_output=True, timeout=60)
    wait_for(lambda: b"cluster_state:ok" in subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"],
                                                            capture_output=True).stdout,
             "Redis cluster state ok", interval_s=0.1)
    yield f"redis://127.0.0.1:{ports[0]}/0"
    for p in procs:
        p.terminate()
        p.wait(10)


async def test_admission_on_redis_cluster(redis_cluster_url):
    from redis.asyncio.cluster import RedisCluster

    rc = RedisCluster.from_url(redis_cluster_url)
    a = RedisAdmission(rc, lease_ttl_s=5)
    await a.load()
    tenants = [tenant(tpm=1000, max_concurrent_requests=2) for _ in range(8)]  # spread over the slots
    slots = {key_slot(a.keys(t.id)[0].encode()) for t in tenants}
    assert len(slots) == 8
    for t in tenants:
        d1 = await a.admit(t, 300)
        tokens1, ts1 = await a.bucket(t.id, "tpm")  # 1000 - 300
        d2, d3 = [await a.admit(t, 300) for _ in range(2)]
        assert d1.admitted and d2.admitted and not d3.admitted and d3.reason == "concurrent_requests"
        assert await a.renew([d1.lease, d2.lease]) == 2
        await a.settle(d1.lease, 100)
        await a.settle(d2.lease, 300)
        assert await a.leases(t.id) == {}
        tokens, ts = await a.bucket(t.id, "tpm")
        # 1000 - 600 reserved + 200 refunded, plus the refill between the two stored timestamps (Redis time)
        assert tokens1 == pytest.approx(700, abs=1e-6)
        assert tokens == pytest.approx(tokens1 - 300 + 200 + (ts - ts1) * 1000 / 60000, abs=1e-3)
    await rc.aclose()
