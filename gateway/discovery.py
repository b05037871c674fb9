"""Where the workers are: a static list, a DNS name, or a file, watched live.

`--workers` (``FAIRSHARE_WORKERS``) takes comma-separated entries of three kinds, freely mixed:

- ``host:port`` (or ``[v6addr]:port``): one worker, always in the list;
- ``dns:///name:port`` (gRPC's name syntax; ``dns:name:port`` too): every A and AAAA record of
  `name` is a worker on `port`. Point it at the workers' headless Service (Kubernetes gives one
  record per pod), and scaling the worker StatefulSet needs nothing else;
- ``file:///path`` (``file:path`` too): one worker per line of a file (``host:port``; blank lines
  and ``#`` comments ignored), re-read when it changes: for setups that write the worker list
  somewhere (a config management tool, a ConfigMap mounted as a volume).

`Discovery.run` re-resolves every source every ``interval_s`` seconds (default 5) and hands the
union to a callback; the gateway's `WorkerPool` adds the new workers at once (checks their health and
model, routes to them once they are SERVING) and retires the ones that left (no new requests; their
open streams run to the end). A source that fails to resolve (a DNS error, an unreadable file)
keeps its last good answer and is logged once until it recovers: a DNS hiccup must not empty the
pool. A worker that is really gone fails its health checks and leaves routing that way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

from .background import every

log = logging.getLogger("fairshare.gateway")

DEFAULT_INTERVAL_S = 5.0


def split_hostport(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port). Raises ValueError when malformed."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected [address]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError(f"{text!r}: expected host:port")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{text!r}: the port is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: port out of range")
    return host, port


def join_hostport(host: str, port: int) -> str:
    """(host, port) -> ``host:port``, IPv6 addresses in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class Source:
    """One `--workers` entry. kind: static | dns | file. target: host:port, name:port or a path."""

    kind: str
    target: str
    last: set[str] = field(default_factory=set)
    failing: bool = False
    _mtime: float | None = None

    def describe(self) -> str:
        return {"static": self.target, "dns": f"dns:///{self.target}", "file": f"file://{self.target}"}[self.kind]

    async def resolve(self) -> set[str]:
        """The worker addresses this source names now. Raises OSError / ValueError on failure."""
        if self.kind == "static":
            return {self.target}
        if self.kind == "dns":
            host, port = split_hostport(self.target)
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return {join_hostport(info[4][0], port) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}
        path = Path(self.target)
        mtime = os.stat(path).st_mtime_ns
        if mtime == self._mtime:
            return self.last
        out = set()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                try:
                    out.add(join_hostport(*split_hostport(line)))
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: {e}") from None
        self._mtime = mtime
        return out


def parse_sources(entries: list[str]) -> list[Source]:
    """`--workers` entries -> sources (module docstring). Raises ValueError on a malformed entry."""
    out = []
    for raw in entries:
        e = raw.strip()
        if not e:
            continue
        if e.startswith("dns:"):
            name = e[len("dns:"):].lstrip("/")
            if "/" in name:  # dns://authority/name:port: a resolver authority is not supported
                raise ValueError(f"{e!r}: use dns:///name:port (the system resolver); a DNS authority is not supported")
            split_hostport(name)
            out.append(Source("dns", name))
        elif e.startswith("file:"):
            path = e[len("file:"):]
            if path.startswith("//"):
                path = path[2:]
            if not path:
                raise ValueError(f"{e!r}: no path")
            out.append(Source("file", path))
        else:
            out.append(Source("static", join_hostport(*split_hostport(e))))
    return out


class Discovery:
    """Re-resolves `sources` every `interval_s` seconds and calls `on_change(addresses)` with the
    union whenever it changed (and once at the start)."""

    def __init__(self, sources: list[Source], on_change: Callable[[set[str]], Awaitable[None] | None],
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        self.sources = sources
        self.on_change = on_change
        self.interval_s = interval_s
        self.current: set[str] | None = None

    @property
    def dynamic(self) -> bool:
        """Whether some source can change (dns or file)."""
        return any(s.kind != "static" for s in self.sources)

    async def resolve_once(self) -> set[str]:
        """Resolve every source (a failing one keeps its last answer); call on_change if the union
        changed. Returns the union."""
        for s in self.sources:
            try:
                s.last = await s.resolve()
                if s.failing:
                    log.info("workers source %s resolves again (%d address(es))", s.describe(), len(s.last))
                s.failing = False
            except (OSError, ValueError, UnicodeError) as e:
                if not s.failing:
                    log.warning("workers source %s does not resolve (%s); keeping its last %d address(es)",
                                s.describe(), e, len(s.last))
                s.failing = True
        union = set().union(*(s.last for s in self.sources)) if self.sources else set()
        if union != self.current:
            self.current = union
            res = self.on_change(set(union))
            if asyncio.iscoroutine(res):
                await res
        return union

    async def run(self) -> None:
        """Resolve forever (cancel to stop)."""
        await every(lambda: self.interval_s, self.resolve_once, "worker discovery")


__all__ = ["DEFAULT_INTERVAL_S", "Discovery", "Source", "join_hostport", "parse_sources", "split_hostport"]
