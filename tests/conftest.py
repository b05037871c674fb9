"""Shared fixtures: a real redis-server and a real gRPC worker on loopback ports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fairshare.procs import free_port, start_redis, wait_for_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """URL of a fresh redis-server (no persistence) on a free loopback port, for the session."""
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def start_worker(*extra: str, model: str = "random-tiny", policy: str = "vtc", port: int | None = None,
                 log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start `fairshare worker` as a subprocess; return (process, "127.0.0.1:port") once it listens."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "fairshare.cli", "worker", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--policy", policy, *extra]
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    wait_for_port("127.0.0.1", port, 300.0, proc)
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="session")
def worker_addr(tmp_path_factory):
    """Address of a reference worker serving the seeded random tiny Llama (VTC policy)."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    proc, addr = start_worker(log_path=log)
    yield addr
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
