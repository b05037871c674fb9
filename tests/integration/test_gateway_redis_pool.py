"""A burst larger than the gateway's Redis connection pool is back-pressure, not an outage.

redis-py's asyncio pool holds 100 connections by default and a call that finds none free fails
at once (MaxConnectionsError), which the admission path took for Redis being down: one tenant's
burst of 110 concurrent requests turned every fail-closed tenant away with 503. The gateway's client
(`gateway.app._redis_client`) uses a blocking pool instead: such a call waits for a connection.

Reached by construction: the pool holds 4 connections and 40 admissions start at once (each takes
a connection at its first call, before any is given back), against a real redis-server.
"""

from __future__ import annotations

import asyncio
import uuid

from fairshare.config import TenantConfig
from gateway.admission import AdmissionControl
from gateway.app import _redis_client
from gateway.config import GatewaySettings
from gateway.redis_buckets import RedisAdmission

BURST, POOL = 40, 4


async def test_a_burst_beyond_the_connection_pool_waits_instead_of_taking_redis_for_down(redis_url):
    settings = GatewaySettings(redis_url=redis_url, redis_max_connections=POOL, redis_timeout_s=30.0)
    r = _redis_client(settings)
    try:
        assert r.connection_pool.max_connections == POOL
        adm = RedisAdmission(r, prefix="pool-" + uuid.uuid4().hex[:8], lease_ttl_s=15.0)
        await adm.load()
        control = AdmissionControl(adm, lambda tier: "fail_closed")
        burst = TenantConfig(id="burst", limits={"max_concurrent_requests": 8})
        other = TenantConfig(id="other")
        ids = [f"b-{i}" for i in range(BURST)]
        decisions = await asyncio.gather(*(control.admit(burst, 10, lease_id=i) for i in ids),
                                         control.admit(other, 10, lease_id="o-0"))
        assert control.up and control.outages == 0, "the burst was taken for a Redis outage"
        *mine, theirs = decisions
        assert sum(d.admitted for d in mine) == 8  # its own limit, decided in Redis
        assert {d.reason for d in mine if not d.admitted} == {"concurrent_requests"}
        assert theirs.admitted  # the other tenant is untouched by the burst
        for d in decisions:
            if d.admitted:
                await control.settle(d.lease, 10)
        assert await adm.leases(burst.id) == {} and await adm.leases(other.id) == {}
    finally:
        await r.aclose()
