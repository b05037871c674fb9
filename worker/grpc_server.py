"""The gRPC server both workers (reference `worker/server.py`, SGLang `worker/sglang_server.py`) start.

One home for the server's options, its bind and its health service, so the two bootstraps cannot
drift apart.
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from grpc_health.v1 import health, health_pb2

from fairshare.ports import port_in_use

# Messages up to 64 MiB (ModelInfo carries the tokenizer). so_reuseport off: a port another process
# already listens on fails the bind instead of silently sharing its connections with that process.
# The gateway pings every connection (`fairshare gateway --worker-keepalive-s`, 10 s by default),
# also while nothing is sent on it: accepted as often as once a second and never answered with
# GOAWAY (gRPC's default takes a ping more often than every 5 minutes without data as abuse and,
# at the third, closes the connection with every call on it).
SERVER_OPTIONS = (("grpc.max_send_message_length", 64 * 2**20),
                  ("grpc.max_receive_message_length", 64 * 2**20),
                  ("grpc.so_reuseport", 0),
                  ("grpc.keepalive_permit_without_calls", 1),
                  ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                  ("grpc.http2.max_ping_strikes", 0))


class HealthService(health.aio.HealthServicer):
    """``grpc.health.v1`` whose ``Watch`` streams can be ended: `end_watches` (a draining worker,
    once it reported NOT_SERVING) ends each open one with status OK and answers later ones at once
    with the last status, so that the server's stop does not wait out its grace on the gateways'
    watches (which otherwise never end) and then cancel them. The statuses themselves are gRPC's
    own servicer's."""

    def __init__(self) -> None:
        super().__init__()
        self._ending = asyncio.Event()

    async def Watch(self, request, context) -> None:
        if self._ending.is_set():  # the current status, once, then the end
            status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            await context.write(health_pb2.HealthCheckResponse(status=status))
            return
        watch = asyncio.ensure_future(super().Watch(request, context))
        ending = asyncio.ensure_future(self._ending.wait())
        try:
            await asyncio.wait((watch, ending), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watch, ending):
                task.cancel()
            await asyncio.gather(watch, ending, return_exceptions=True)

    def end_watches(self) -> None:
        """End every open Watch stream (status OK) after the status it last sent, and every later
        one after its first answer."""
        self._ending.set()


def new_server() -> grpc.aio.Server:
    """A grpc.aio server with SERVER_OPTIONS (no services added, not bound)."""
    return grpc.aio.server(options=list(SERVER_OPTIONS))


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind `server` to host:port (port 0: any free port); return the bound port.

    Raises OSError("cannot bind host:port") when the address is taken or cannot be bound."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc raises when the address is taken
        bound = 0
    if not bound:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


def port_taken(host: str, port: int) -> bool:
    """True (with a one-line notice on stderr) when host:port is already listened on, so a worker
    refuses to start before it loads a model it could not serve."""
    if not port_in_use(host, port):
        return False
    print(f"fairshare worker: port {host}:{port} is already in use", file=sys.stderr)
    return True
