"""The gateway's health poll (gateway/routing.py `WorkerPool`): a worker that only answers late stays
in routing until `unhealthy_after` late polls in a row; NOT_SERVING or a refused connection takes it
out at once. Real grpc.aio health servers on loopback; a "late" answer is one that never comes before
the poll's deadline (the servicer waits on an event), so nothing here depends on timing."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fairshare.ports import free_port
from gateway.routing import WorkerPool


class Health(health_pb2_grpc.HealthServicer):
    """Answers `status`, or nothing at all (until the caller's deadline) while `late` is set."""

    def __init__(self) -> None:
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.late = asyncio.Event()
        self.answer = asyncio.Event()

    async def Check(self, request, context):
        if self.late.is_set():
            await self.answer.wait()
        return health_pb2.HealthCheckResponse(status=self.status)


async def serve(h: Health) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    addr = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(addr)
    await server.start()
    return server, addr


async def test_late_polls_keep_a_serving_worker_until_the_threshold():
    h = Health()
    server, addr = await serve(h)
    pool = WorkerPool([addr], health_timeout_s=0.2, unhealthy_after=3)
    w = pool.workers[0]
    try:
        w.healthy = True  # (as after a good poll; this fake has no Worker service for GetModelInfo)
        h.late.set()
        for n in (1, 2):
            await pool.poll_once()
            assert w.healthy and w.slow_probes == n
        await pool.poll_once()
        assert not w.healthy and "DEADLINE_EXCEEDED" in w.last_error
    finally:
        h.answer.set()
        await pool.stop()
        await server.stop(None)


async def test_not_serving_or_refused_takes_a_worker_out_at_once():
    h = Health()
    server, addr = await serve(h)
    pool = WorkerPool([addr, f"127.0.0.1:{free_port()}"], health_timeout_s=5.0)  # the second: nothing listens
    served, refused = pool.workers
    try:
        served.healthy = refused.healthy = True
        h.status = health_pb2.HealthCheckResponse.NOT_SERVING
        await pool.poll_once()
        assert not served.healthy and not refused.healthy
        assert served.slow_probes == refused.slow_probes == 0
    finally:
        await pool.stop()
        await server.stop(None)
