"""The gateway's view of the pool board (`fairshare.pool_board`), for the ``fair`` routing policy.

`BoardReader` reads every worker's report from Redis every ``interval_s`` seconds (default 0.1, the
workers' own publishing period) and keeps the latest as a `gateway.routing_policy.PoolBoard`
(worker id -> tenant -> pool-wide counter, backlogged, tier). When Redis fails it keeps the last
board for up to the board's stale limit, then routes as ``prefix`` (an empty board) until Redis is
back: fair spill needs fresh counters, affinity does not.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from fairshare.pool_board import STALE_MS, SYNC_SCRIPT, board_keys, decode_sync

from .background import Background, every
from .routing_policy import PoolBoard

log = logging.getLogger("fairshare.gateway")


class BoardReader:
    """Keeps `board` current (module docstring). redis: an asyncio redis-py client."""

    def __init__(self, redis, prefix: str = "fairshare", interval_s: float = 0.1) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        self.redis = redis
        self.keys = board_keys(prefix)
        self.interval_s = float(interval_s)
        self.board = PoolBoard()
        self.read_at: float | None = None  # time.monotonic() of the last good read
        self._script = redis.register_script(SYNC_SCRIPT)
        self._loop = Background("pool-board", lambda: every(lambda: self.interval_s, self.read, "pool board read"))
        self._failing = False

    def current(self) -> PoolBoard:
        """The board to route by (empty once the last good read is older than the stale limit)."""
        if self.read_at is None or time.monotonic() - self.read_at > STALE_MS / 1000.0:
            return PoolBoard()
        return self.board

    async def read(self) -> PoolBoard | None:
        """Read the board once; None when Redis failed."""
        try:
            reply = await self._script(keys=self.keys, args=["", "", STALE_MS])
        except (RedisError, OSError) as e:
            if not self._failing:
                log.warning("pool board unreadable (%s); fair routing keeps the last board for %.0f s",
                            type(e).__name__, STALE_MS / 1000.0)
            self._failing = True
            return None
        self._failing = False
        board = PoolBoard.from_reports(decode_sync(reply))
        self.board, self.read_at = board, time.monotonic()
        return board

    def start(self) -> None:
        """Read the board every `interval_s` seconds in the background until `stop`."""
        self._loop.start()

    async def stop(self) -> None:
        """Stop reading the board."""
        await self._loop.stop()



class PoolRuntime:
    """Everything the gateway runs for its pool, started and stopped together by the app: the
    `WorkerPool` (discovery, health, routing by ``settings.routing``), the `BoardReader` the ``fair``
    policy reads, and this replica's `gateway.replicas.ReplicaRegistry` (whose count goes to
    `control.set_live_replicas`)."""

    def __init__(self, settings, redis, control, metrics=None, local_tokenizer=None) -> None:
        from .replicas import ReplicaRegistry
        from .routing import WorkerPool
        from .routing_policy import make_routing

        self.board = BoardReader(redis, settings.key_prefix, settings.pool_board_interval_s) \
            if settings.routing == "fair" else None
        routing = make_routing(settings.routing, board=self.board.current if self.board else None,
                               **settings.routing_options())
        if metrics is not None and hasattr(routing, "on_spill"):
            routing.on_spill = lambda req: metrics.routing_spills.labels(req.tenant_id).inc()
        self.pool = WorkerPool(settings.workers, health_interval_s=settings.health_interval_s,
                               health_timeout_s=settings.health_timeout_s, local_tokenizer=local_tokenizer,
                               metrics=metrics, discovery_interval_s=settings.discovery_interval_s,
                               unhealthy_after=settings.unhealthy_after, routing=routing,
                               keepalive_s=settings.worker_keepalive_s)
        self.replicas = ReplicaRegistry(redis, settings.key_prefix, ttl_s=settings.replica_ttl_s,
                                        on_count=control.set_live_replicas)
        if metrics is not None:
            metrics.gateway_replicas.set(control.local.replicas)

    async def start(self) -> None:
        """Resolve and poll the workers once, then keep everything running in the background."""
        await self.pool.start(wait_s=0.0)
        await self.pool.poll_once()
        await self.replicas.beat()
        self.replicas.start()
        if self.board is not None:
            self.board.start()

    async def stop(self) -> None:
        if self.board is not None:
            await self.board.stop()
        await self.replicas.stop()
        await self.pool.stop()


__all__ = ["BoardReader", "PoolRuntime"]
