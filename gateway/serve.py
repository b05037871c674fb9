"""Run the gateway app with uvicorn: `DrainingServer` (SIGTERM drains open requests, used by
`fairshare gateway`) and `ServerThread` (a background thread: tests, benchmarks, embedding)."""

from __future__ import annotations

import faulthandler
import gc
import logging
import threading
import time

import uvicorn

from .http_guard import protocol_for
from fastapi import FastAPI

log = logging.getLogger("fairshare.gateway")

SHUTDOWN_CEILING_S = 30.0  # after the drain and uvicorn's grace: the process exits even if a step hangs


# Young-generation threshold of the cyclic garbage collector in a serving gateway (Python's default:
# 700 allocations). A request allocates a few thousand short-lived objects (ASGI scope, pydantic
# models, protobuf messages, futures), nearly all freed by reference counting; at 700 the collector
# ran several times per request and cost about a tenth of the gateway's CPU (issue #23's profile).
GC_YOUNG_THRESHOLD = 10_000


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, tokenizers, templates, routes: what startup built) out
    of the collector's reach (`gc.freeze`) and raise the young-generation threshold to
    ``GC_YOUNG_THRESHOLD``, so that collections scan only what requests allocate, and less often.
    Cycles are still collected (the older generations' thresholds are unchanged)."""
    gc.collect()
    gc.freeze()
    _, mid, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, mid, old)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown (SIGTERM, SIGINT) first starts the gateway's drain: no new
    admissions, open requests may finish for `drain_timeout_s` seconds, then they are stopped with an
    OpenAI error and settled (see `gateway.state.Gateway.begin_drain`). Configure uvicorn's
    ``timeout_graceful_shutdown`` a little above `drain_timeout_s`. Once started it calls
    `freeze_startup_heap` (the process serves the gateway alone).

    The shutdown is bounded: should any step of it hang (uvicorn waits on the app's lifespan without a
    limit), `faulthandler` writes every thread's stack to stderr and exits the process with status 1
    `shutdown_ceiling_s` seconds (default `SHUTDOWN_CEILING_S`) after uvicorn's grace, so an
    orchestrator never waits on a stuck gateway and the log names where it stuck."""

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float = 10.0,
                 shutdown_ceiling_s: float = SHUTDOWN_CEILING_S) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.shutdown_ceiling_s = shutdown_ceiling_s

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        freeze_startup_heap()  # after the app's lifespan built the pool, tokenizers and routes

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app
        gw = getattr(getattr(app, "state", None), "gw", None)
        if gw is not None:
            gw.begin_drain(self.drain_timeout_s)
        ceiling_s = max(self.drain_timeout_s, self.config.timeout_graceful_shutdown or 0) + self.shutdown_ceiling_s
        faulthandler.dump_traceback_later(ceiling_s, exit=True)  # left armed: covers the interpreter's exit too
        await super().shutdown(sockets=sockets)
        log.info("shutdown finished: open requests settled, workers and Redis closed")


class ServerThread:
    """uvicorn serving `app` on host:port in a daemon thread with its own event loop.

    `start()` returns once the server accepts connections (raises RuntimeError after `timeout_s`
    seconds or when startup fails); `stop()` shuts it down gracefully.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        if port == 0:
            from fairshare.ports import free_port

            port = free_port()
        self.host = host
        self.port = port
        self.app = app
        http = protocol_for(getattr(getattr(app, "state", None), "settings", None))
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    access_log=False, timeout_graceful_shutdown=3, http=http))
        self.thread = threading.Thread(target=self.server.run, name=f"gateway-{port}", daemon=True)

    @property
    def base_url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        """Start serving and wait until started."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("gateway server failed to start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway server not started after {timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit and join the thread."""
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
