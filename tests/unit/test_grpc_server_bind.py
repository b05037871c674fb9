"""The workers' gRPC bind (worker/grpc_server.py) refuses a port another process listens on.

With gRPC's default SO_REUSEPORT a second server on a taken port binds and silently shares the
first one's connections; ours must fail the start with OSError("cannot bind ...") instead.
"""

import asyncio
import socket

import pytest

from worker import grpc_server


def _listening_socket() -> socket.socket:
    """A plain TCP socket listening on a free loopback port (SO_REUSEPORT set, as gRPC sets it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if hasattr(socket, "SO_REUSEPORT"):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_bind_refuses_a_port_another_process_listens_on():
    async def scenario():
        holder = _listening_socket()
        port = holder.getsockname()[1]
        server = grpc_server.new_server()
        try:
            with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
                grpc_server.bind(server, "127.0.0.1", port)
        finally:
            holder.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_bind_port_zero_returns_the_bound_port():
    async def scenario():
        server = grpc_server.new_server()
        try:
            port = grpc_server.bind(server, "127.0.0.1", 0)
            assert port > 0
            # the same port taken by a second server is refused, not shared
            second = grpc_server.new_server()
            await server.start()
            try:
                with pytest.raises(OSError, match="cannot bind"):
                    grpc_server.bind(second, "127.0.0.1", port)
            finally:
                await second.stop(None)
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_port_taken_names_the_port_once_and_only_when_taken(capsys):
    holder = _listening_socket()
    port = holder.getsockname()[1]
    try:
        assert grpc_server.port_taken("127.0.0.1", port)
        assert capsys.readouterr().err == f"fairshare worker: port 127.0.0.1:{port} is already in use\n"
    finally:
        holder.close()
    assert not grpc_server.port_taken("127.0.0.1", port)
    assert capsys.readouterr().err == ""
