"""The pool's Redis parts on a real redis-server: gateway replicas counted live (and the degrade
divisor following them), the pool board's exchange, and two real engines (simulated runner, no
torch) sharing pool-wide counters through `PoolService` and the board."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis as redis_sync
from redis.asyncio import Redis

from fairshare.config import TenantConfig
from fairshare.pool_board import SYNC_SCRIPT, TenantReport, WorkerReport, board_keys, decode_sync
from gateway.redis_buckets import RedisAdmission
from gateway.admission import AdmissionControl
from gateway.pool_view import BoardReader
from gateway.replicas import ReplicaRegistry
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams
from worker.pool_service import PoolService
from worker.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock


def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


async def test_replicas_register_count_expire_and_feed_the_degrade_divisor(redis_url):
    p = prefix()
    r = Redis.from_url(redis_url)
    control = AdmissionControl(RedisAdmission(r, prefix=p), lambda tier: "degrade", replicas=2)
    a = ReplicaRegistry(r, p, ttl_s=0.5, on_count=control.set_live_replicas)
    b = ReplicaRegistry(r, p, ttl_s=0.5)
    c = ReplicaRegistry(r, p, ttl_s=0.5)
    try:
        assert await a.beat() == 1 and control.local.replicas == 2  # the floor (--replicas 2)
        await b.beat()
        await c.beat()
        assert await a.beat() == 3 and control.local.replicas == 3
        tenant = TenantConfig.model_validate({"id": "t", "limits": {"rpm": 30}})
        assert control.local.share(tenant.limits.rpm) == 10  # 30 / 3 live replicas
        await c.stop()  # a clean stop deregisters at once
        assert await a.beat() == 2 and control.local.replicas == 2
        deadline = time.monotonic() + 10  # b stops beating: its registration expires (Redis TIME)
        while await a.beat() != 1:
            assert time.monotonic() < deadline, "b's registration never expired"
            await asyncio.sleep(0.1)
        assert control.local.replicas == 2  # never below the floor
    finally:
        await a.stop()
        await r.aclose()


def test_board_exchange_returns_the_others_fresh_reports_and_drops_stale_ones(redis_url):
    p = prefix()
    r = redis_sync.Redis.from_url(redis_url)
    sync = r.register_script(SYNC_SCRIPT)
    keys = board_keys(p)
    rep = WorkerReport("w1", "e1", {"acme": TenantReport(10.0, 2.0, "batch", True, 5.0, 3, 1.5)})
    assert decode_sync(sync(keys=keys, args=["w1", rep.encode(), 5000])) == []
    (got,) = decode_sync(sync(keys=keys, args=["w2", WorkerReport("w2", "e").encode(), 5000]))
    assert got.worker_id == "w1" and got.epoch == "e1" and got.tenants == rep.tenants and got.age_s >= 0
    readers = decode_sync(sync(keys=keys, args=["", "", 5000]))  # a gateway reads without writing
    assert {x.worker_id for x in readers} == {"w1", "w2"}
    time.sleep(0.05)
    assert decode_sync(sync(keys=keys, args=["", "", 10])) == []  # older than 10 ms: dropped
    assert r.hlen(keys[0]) == 0 and r.hlen(keys[1]) == 0
    r.close()


def sim_engine() -> Engine:
    clock = VirtualClock()
    cfg = EngineConfig(policy="vtc", num_kv_blocks=256, block_size=16)
    tm = IterationTimeModel(0.01, 1e-4, 1e-4, 1e-6)
    return Engine(SimModel(), cfg, SimulatedRunner(clock, tm, 256, 16), clock=clock)


def run_until_done(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine.step():
            return
    raise AssertionError("the engine never went idle")


async def test_two_engines_share_pool_counters_through_redis(redis_url):
    p = prefix()
    e0, e1 = sim_engine(), sim_engine()
    s0 = PoolService(e0, redis_url, "w0", prefix=p, interval_s=0.05)
    s1 = PoolService(e1, redis_url, "w1", prefix=p, interval_s=0.05)
    try:
        for i in range(4):
            e0.add_request(f"a{i}", "acme", [1, 2, 3, 4] * 8, SamplingParams(max_tokens=8, ignore_eos=True),
                           lambda out: None, weight=2.0)
        run_until_done(e0)
        charged = e0.policy.accounts["acme"].charged_service
        assert charged > 0
        assert s0.exchange() and s1.exchange()  # w0 publishes, then w1 reads it
        assert e1.pool.elsewhere == {"acme": charged} and e1.pool.workers == 1
        snap = e1.snapshot()
        assert snap["pool_workers"] == 1 and not snap["tenants"]  # known from the pool only
        e1.add_request("b0", "acme", [5, 6, 7, 8] * 8, SamplingParams(max_tokens=4, ignore_eos=True),
                       lambda out: None, weight=2.0)
        run_until_done(e1)
        acct = e1.policy.accounts["acme"]
        assert acct.virtual_counter >= charged / 2.0  # it started where the pool has it
        assert e1.snapshot()["tenants"][0]["pool_service"] == charged
        # the gateway's reader sees both workers' reports
        r = Redis.from_url(redis_url)
        try:
            assert s0.exchange() and s1.exchange()
            board = await BoardReader(r, p).read()
            assert set(board.workers) == {"w0", "w1"}
            assert board.counter("acme") == pytest.approx(max(e0.policy.accounts["acme"].virtual_counter,
                                                              acct.virtual_counter))
        finally:
            await r.aclose()
    finally:
        s0.stop()
        s1.stop()
