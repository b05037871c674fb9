"""Admissions and settlements issued together go to Redis in one pipeline (gateway/redis_batch.py),
each answered on its own, against a real redis-server.

Reached by construction: the calls are started with one ``asyncio.gather``, so all of them are
issued in the same event-loop iteration before the batcher's flush runs.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from fairshare.config import TenantConfig
from fairshare.ports import free_port
from gateway.redis_batch import CommandBatcher
from gateway.redis_buckets import RedisAdmission


@pytest.fixture
async def r(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_concurrent_admissions_share_one_pipeline_and_keep_their_own_answers(r):
    adm = RedisAdmission(r, prefix="batch-" + uuid.uuid4().hex[:8])
    await adm.load()
    tenant = TenantConfig(id="t", limits={"max_concurrent_requests": 5})
    decisions = await asyncio.gather(*(adm.admit(tenant, 10, lease_id=f"l{i}") for i in range(12)))
    assert adm.batcher.batches == 1 and adm.batcher.commands == 12
    assert sum(d.admitted for d in decisions) == 5  # the limit holds: each script ran on its own
    assert {d.reason for d in decisions if not d.admitted} == {"concurrent_requests"}
    held = [d.lease for d in decisions if d.admitted]
    released = await asyncio.gather(*(adm.settle(le, 4) for le in held))
    assert released == [True] * 5 and adm.batcher.batches == 2
    assert await adm.leases("t") == {}


async def test_one_commands_error_reaches_its_caller_only(r):
    b = CommandBatcher(r)
    key = "batch-" + uuid.uuid4().hex
    results = await asyncio.gather(b.execute("SET", key, "1"), b.execute("EVALSHA", "0" * 40, 0),
                                   b.execute("INCR", key), b.execute("LPUSH", key, "x"),
                                   return_exceptions=True)
    assert b.batches == 1
    assert results[0] is True and results[2] == 2
    assert isinstance(results[1], NoScriptError)
    assert isinstance(results[3], ResponseError) and "WRONGTYPE" in str(results[3])
    assert await b.execute("GET", key) == b"2"  # a lone command: no pipeline, the same answer
    await r.delete(key)


async def test_a_cancelled_caller_leaves_the_others_answered(r):
    b = CommandBatcher(r)
    key = "batch-" + uuid.uuid4().hex
    first = asyncio.ensure_future(b.execute("INCR", key))
    second = asyncio.ensure_future(b.execute("INCR", key))
    await asyncio.sleep(0)  # both issued: the flush is scheduled
    first.cancel()
    assert await second in (1, 2)
    with pytest.raises(asyncio.CancelledError):
        await first
    await b.aclose()
    await r.delete(key)


async def test_a_failed_connection_fails_every_caller_of_the_pipeline():
    r = Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=2)  # nothing listens there
    try:
        b = CommandBatcher(r)
        results = await asyncio.gather(*(b.execute("PING") for _ in range(3)), return_exceptions=True)
        assert b.batches == 1
        assert all(isinstance(e, RedisConnectionError) for e in results), results
    finally:
        await r.aclose()


async def test_settlement_after_redis_lost_the_scripts(r):
    """NOSCRIPT on a batched settle: the settle script is loaded again and the lease released; the
    admission that follows still finds its own script missing, so `on_scripts_lost` (which restores
    the running leases) runs there."""
    adm = RedisAdmission(r, prefix="batch-" + uuid.uuid4().hex[:8])
    await adm.load()
    tenant = TenantConfig(id="t")
    d = await adm.admit(tenant, 10, lease_id="l0")
    assert d.admitted
    await r.script_flush()
    assert await adm.settle(d.lease, 3) is True
    assert await adm.leases("t") == {}
    lost = []

    async def on_lost():
        lost.append(True)

    adm.on_scripts_lost = on_lost
    d2 = await adm.admit(tenant, 10, lease_id="l1")
    assert d2.admitted and adm.scripts_lost == 1 and lost == [True]
