"""Gateway replicas counted live: each replica registers itself in Redis with a short TTL.

Every ``ttl_s / 3`` seconds a replica runs `HEARTBEAT_SCRIPT`: it sets its own expiry to Redis time +
``ttl_s`` in the sorted set ``<prefix>:gateways`` (member: a random replica id made at start),
drops the members that expired and returns how many are left: the replicas alive now, itself
included. A replica that stops cleanly removes itself; one that dies expires within ``ttl_s``.
Redis's clock is the only one used, so replicas' clocks may differ.

The count feeds the ``degrade`` outage policy (`gateway.local_buckets.LocalAdmission`): while Redis is
down each replica admits against ``limit / replicas``, ``replicas`` being the live count *last seen
before the outage* (Redis is unreachable during it), and never less than ``--replicas``
(``FAIRSHARE_GATEWAY_REPLICAS``, default 1: a floor an operator may raise when replicas start
together right before an outage, or to hold a fixed divisor). So the chart's HPA may scale the
gateway from 2 to 10 replicas with no setting to keep in step.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable

from redis.exceptions import RedisError

from .background import Background, every

log = logging.getLogger("fairshare.gateway")

# KEYS: the set. ARGV: replica id, ttl ms ('0': leave). Returns the live members' count.
HEARTBEAT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ttl * 3)
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


def replicas_key(prefix: str) -> str:
    """The sorted set of live gateway replicas (member: replica id, score: expiry, Redis ms)."""
    return f"{prefix}:gateways"


class ReplicaRegistry:
    """Registers this replica and counts the live ones (module docstring).

    redis: an asyncio redis-py client. on_count(n): called with each count read. ttl_s: how long a
    registration lives without a heartbeat (> 0). Raises ValueError for a bad ttl.
    """

    def __init__(self, redis, prefix: str = "fairshare", *, ttl_s: float = 10.0,
                 on_count: Callable[[int], None] | None = None, replica_id: str | None = None) -> None:
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.redis = redis
        self.key = replicas_key(prefix)
        self.ttl_s = float(ttl_s)
        self.on_count = on_count
        self.replica_id = replica_id or uuid.uuid4().hex[:16]
        self.count: int | None = None  # last live count read (None: never)
        self._script = redis.register_script(HEARTBEAT_SCRIPT)
        self._loop = Background("gateway-replicas", lambda: every(lambda: self.ttl_s / 3, self.beat, "replica heartbeat"))
        self._failing = False

    async def beat(self) -> int | None:
        """Renew this replica's registration; returns the live count (None when Redis failed)."""
        try:
            n = int(await self._script(keys=[self.key], args=[self.replica_id, int(self.ttl_s * 1000)]))
        except (RedisError, OSError) as e:
            if not self._failing:
                log.warning("gateway replica heartbeat failed (%s); keeping the last live count %s",
                            type(e).__name__, self.count)
            self._failing = True
            return None
        self._failing = False
        if n != self.count:
            log.info("gateway replicas alive: %d", n)
        self.count = n
        if self.on_count is not None:
            self.on_count(n)
        return n

    def start(self) -> None:
        """Heartbeat (every ``ttl_s / 3`` seconds) in the background until `stop`."""
        self._loop.start()

    async def stop(self) -> None:
        """Stop the heartbeat and deregister (best effort: an unreachable Redis lets it expire)."""
        await self._loop.stop()
        try:
            await self._script(keys=[self.key], args=[self.replica_id, 0])
        except (RedisError, OSError):
            pass


__all__ = ["HEARTBEAT_SCRIPT", "ReplicaRegistry", "replicas_key"]
