"""The gRPC server both workers (reference `worker/server.py`, SGLang `worker/sglang_server.py`) start.

One home for the server's options and its bind, so the two bootstraps cannot drift apart.
"""

from __future__ import annotations

import sys

import grpc

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
