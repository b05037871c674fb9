"""The worker's side of the pool: its identity and the pool board exchange (`fairshare worker` flags).

    fairshare worker ... [--worker-id ID] [--pool-redis-url redis://HOST:6379/0]
                         [--pool-interval-s 0.1] [--pool-key-prefix fairshare] [--hand-back-after-s 0.5]

`--worker-id` (default ``<hostname>:<port>``; a StatefulSet pod's hostname is its stable name) is
reported in ``ModelInfo.worker_id`` and ``Load.worker_id``: the gateway's prefix routing hashes on
it, so a pod that restarts with a new address keeps its tenants, and it names this worker on the
pool board.

With `--pool-redis-url` (``FAIRSHARE_POOL_REDIS_URL``) the worker orders tenants by pool-wide
counters (`worker.scheduling.pool`): `PoolService` runs a thread that, every ``--pool-interval-s``
seconds, publishes this worker's per-tenant service (`fairshare.pool_board`) and takes the other
workers' reports into the engine's counters, in one Redis round trip. Without it every worker's VTC
is its own (the pool's shares then hold per worker only). Redis failing is logged once; the
counters keep the last read (they fall back to per-worker behaviour as the others' service stops
being added) until it answers again.

`--hand-back-after-s` (default 0.5; 0: off): a queued request that was never admitted, that the
gateway lets go (it does only while another worker exists, once per request) and that waited that
long with no room here, is handed back to the gateway to be routed elsewhere, when this worker's
last board read shows a worker likely to start it sooner (`worker.scheduling.handback`;
docs/fairness.md, "Fair shares over a pool").
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
import uuid

from worker.scheduling.handback import DEFAULT_HAND_BACK_AFTER_S

log = logging.getLogger("fairshare.worker")


def _seconds_in(high: float, zero_ok: bool):
    """argparse type: seconds in [0, high) (zero_ok) or (0, high); ArgumentTypeError otherwise."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((0 <= x) if zero_ok else (0 < x)) or not x < high:
            raise argparse.ArgumentTypeError(f"{text} is not in {'[' if zero_ok else '('}0, {high:g}) seconds")
        return x
    return parse


_seconds = _seconds_in(3600, zero_ok=True)   # --hand-back-after-s (0: off)
_interval = _seconds_in(60, zero_ok=False)   # --pool-interval-s


def add_pool_arguments(p: argparse.ArgumentParser) -> None:
    """The pool flags of `fairshare worker` (module docstring)."""
    g = p.add_argument_group("pool", "identity and pool-wide fair counters (docs/architecture.md)")
    g.add_argument("--worker-id", default=None,
                   help="this worker's stable identity (default <hostname>:<port>); the gateway's prefix routing "
                        "hashes on it")
    g.add_argument("--pool-redis-url", default=os.environ.get("FAIRSHARE_POOL_REDIS_URL") or None,
                   help="Redis of the pool board: order tenants by pool-wide counters, sharing per-tenant service "
                        "with the other workers (default $FAIRSHARE_POOL_REDIS_URL or off: per-worker counters)")
    g.add_argument("--pool-interval-s", type=_interval, default=0.1,
                   help="publish and read the pool board this often (default 0.1 s: the counters' staleness)")
    g.add_argument("--pool-key-prefix", default="fairshare", help="Redis key prefix (the gateway's, default fairshare)")
    g.add_argument("--hand-back-after-s", type=_seconds, default=DEFAULT_HAND_BACK_AFTER_S, metavar="S",
                   help="a queued request the gateway lets go (another worker exists) that this worker never "
                        "admitted and has no room for after S seconds is handed back to be routed elsewhere, "
                        "when the pool board shows a worker likely to start it sooner (worker/scheduling/"
                        f"handback.py; default {DEFAULT_HAND_BACK_AFTER_S:g}; 0: never)")


def worker_id_of(args: argparse.Namespace) -> str:
    """`--worker-id`, else ``<hostname>:<port>``."""
    return args.worker_id or f"{socket.gethostname()}:{args.port}"


class PoolService:
    """Publishes this worker's report and applies the others', every `interval_s` (module docstring).

    engine: a `worker.engine.engine.Engine` (`pool_report`, `pool_apply`). redis_url: the board's
    Redis. Raises ValueError for a non-positive interval.
    """

    def __init__(self, engine, redis_url: str, worker_id: str, *, prefix: str = "fairshare",
                 interval_s: float = 0.1) -> None:
        import redis

        from fairshare.pool_board import SYNC_SCRIPT, board_keys

        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        self.engine = engine
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex[:12]  # a restart starts a new incarnation (its counters restart at 0)
        self.interval_s = float(interval_s)
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=max(1.0, 5 * interval_s),
                                          socket_connect_timeout=max(1.0, 5 * interval_s))
        self.keys = board_keys(prefix)
        self._script = self.redis.register_script(SYNC_SCRIPT)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.read_at: float | None = None  # time.monotonic() of the last good exchange
        self.exchanges = 0

    def exchange(self) -> bool:
        """One round trip: publish, read the others, apply. Returns whether Redis answered."""
        from fairshare.pool_board import STALE_MS, TenantReport, WorkerReport, decode_sync

        report = WorkerReport(self.worker_id, self.epoch, {
            t: TenantReport(*row) for t, row in self.engine.pool_report().items()})
        try:
            reply = self._script(keys=self.keys, args=[self.worker_id, report.encode(), STALE_MS])
        except Exception as e:  # redis errors and OSErrors alike: keep serving, retry next round
            if not self._failing:
                log.warning("pool board unreachable (%s: %s); ordering keeps the last pool-wide counters",
                            type(e).__name__, e)
            self._failing = True
            return False
        if self._failing:
            log.info("pool board reachable again")
        self._failing = False
        self.engine.pool_apply(decode_sync(reply))
        self.read_at = time.monotonic()
        self.exchanges += 1
        return True

    def board_age_s(self) -> float:
        """Seconds since the last good exchange (inf before the first)."""
        return float("inf") if self.read_at is None else time.monotonic() - self.read_at

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.exchange()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        """Exchange in a daemon thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name="fairshare-pool", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (the board drops this worker's report once it is stale)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.redis.close()


__all__ = ["PoolService", "add_pool_arguments", "worker_id_of"]
