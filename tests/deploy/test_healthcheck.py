"""deploy/healthcheck.py, the images' HEALTHCHECK command, against a real gRPC health server and a
real HTTP server on loopback."""

from __future__ import annotations

import http.server
import importlib.util
import socket
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .conftest import DEPLOY

SCRIPT = DEPLOY / "healthcheck.py"
SERVICE = "fairshare.v1.Worker"


def _load():
    spec = importlib.util.spec_from_file_location("fairshare_healthcheck", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hc = _load()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_grpc_serving_and_not_serving(health_server):
    addr, servicer = health_server
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert hc.main(["grpc", addr, SERVICE]) == 0
    assert hc.main(["grpc", addr]) == 0
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)  # a draining worker
    assert hc.main(["grpc", addr, SERVICE]) == 1
    assert hc.main(["grpc", addr, "no.such.Service"]) == 1  # NOT_FOUND


def test_grpc_nothing_listening():
    assert hc.main(["grpc", f"127.0.0.1:{_free_port()}"]) == 1


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        code = 200 if self.path == "/readyz" else 503
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_http_status():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert hc.main(["http", base + "/readyz"]) == 0
        assert hc.main(["http", base + "/other"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert hc.main(["http", f"http://127.0.0.1:{_free_port()}/readyz"]) == 1


def test_usage_and_script_entry_point():
    assert hc.main([]) == 2 and hc.main(["tcp", "x"]) == 2
    res = subprocess.run([sys.executable, str(SCRIPT), "bogus"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "usage:" in res.stderr
    assert SCRIPT.read_text().startswith("#!/usr/bin/env python3\n")
