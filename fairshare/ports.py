"""TCP port helpers for processes on this host (both tiers, `fairshare up`, the benchmarks and tests).

- `free_port()`: an unused TCP port on 127.0.0.1.
- `port_in_use(host, port)`: whether something already listens there (a worker or gateway checks its
  port before it loads anything).
- `wait_for_port(host, port, timeout_s)`: blocks until a TCP connect succeeds.
"""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port (a bind attempt fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def wait_for_port(host: str, port: int, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Block until host:port accepts TCP connections.

    Raises TimeoutError after `timeout_s` seconds, or RuntimeError if `proc` exits first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f} s")
