"""`Gateway`: what every request handler of one app shares (settings, tenants, Redis, admission
control, the worker pool, metrics, tracing) and the drain that SIGTERM starts."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from .admission import AdmissionControl
from .auth import TenantDirectory
from .config import GatewaySettings
from .metrics import GatewayMetrics
from .progress import OutputRates
from .redis_buckets import RedisAdmission
from .routing import WorkerPool
from .tracing import gateway_tracer

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("fairshare.gateway")

SHUTDOWN_MESSAGE = "The gateway is shutting down; the request was stopped before it finished. Please retry."


@dataclass
class Gateway:
    """Everything the request handlers share (one per app)."""

    settings: GatewaySettings
    directory: TenantDirectory
    redis: Redis | RedisCluster
    admission: RedisAdmission
    control: AdmissionControl
    pool: WorkerPool
    metrics: GatewayMetrics
    live: set["Session"] = field(default_factory=set)
    tracer: trace.Tracer = field(default_factory=gateway_tracer)
    rates: OutputRates = field(default_factory=OutputRates)  # measured output rate per model (retry hints)
    draining: bool = False  # SIGTERM received: new requests get 503, open ones finish until the deadline
    signer: Any = None  # fairshare.worker_auth.Signer of every worker call (None: unsigned, --no-worker-auth)
    _drain_task: asyncio.Task | None = None

    def begin_drain(self, deadline_s: float) -> None:
        """Stop admitting; after `deadline_s` seconds stop every request still open (streams get an
        error event, others a 503). Call on the event loop."""
        if self.draining:
            return
        self.draining = True
        log.warning("draining: %d request(s) open; they may finish for %.1f s", len(self.live), deadline_s)

        async def deadline() -> None:
            await asyncio.sleep(deadline_s)
            if self.live:
                log.warning("drain deadline reached: stopping %d open request(s)", len(self.live))
            for s in list(self.live):
                s.stop(SHUTDOWN_MESSAGE)

        self._drain_task = asyncio.ensure_future(deadline())

    async def stop_all(self) -> None:
        """Stop and settle every open request, and the drain deadline (the app is shutting down)."""
        for s in list(self.live):
            s.stop(SHUTDOWN_MESSAGE)
            await s.settle()
        if self._drain_task is not None:
            self._drain_task.cancel()


__all__ = ["Gateway", "SHUTDOWN_MESSAGE"]
