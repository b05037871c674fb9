"""When a worker's engine stops being trustworthy: repeated faults in a short window.

One rule for both executors (the reference engine's loop, worker/engine/engine.py, and the SGLang
worker's scheduler failures, worker/sglang_server.py): each engine step that raises fails the
requests of its batch and counts one fault; a step that completes resets the count. When `limit`
faults come in a row within `window_s` seconds, the worker is *failed*: it reports NOT_SERVING on
``grpc.health.v1`` (the gateway stops routing to it), fails what it still holds (the gateway retries
requests that had no token yet on another worker) and, after ``--engine-failure-exit-s``, exits with
status `EXIT_ENGINE_FAILED` so that its supervisor (Kubernetes, `fairshare up`) restarts it: a fault
that repeats is a broken process, not a bad request, and a fresh process is the cure.

Imports neither torch nor grpc.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

DEFAULT_FAULT_LIMIT = 5
DEFAULT_FAULT_WINDOW_S = 60.0
EXIT_ENGINE_FAILED = 3


class FaultWindow:
    """Counts consecutive faults; trips once `limit` of them fall within `window_s` seconds.

    limit: faults in a row that trip it (>= 1). window_s: seconds from the first to the last of them.
    clock: seconds (default time.monotonic). Thread-safe. Once tripped it stays tripped (`reason`).
    """

    def __init__(self, limit: int = DEFAULT_FAULT_LIMIT, window_s: float = DEFAULT_FAULT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1 or not window_s > 0:
            raise ValueError(f"fault limit must be >= 1 and window > 0 s, got {limit}, {window_s}")
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self.total = 0
        self.reason: str | None = None
        self._recent: deque[float] = deque()
        self._lock = threading.Lock()

    @property
    def consecutive(self) -> int:
        """Faults since the last success (within the window)."""
        return len(self._recent)

    @property
    def tripped(self) -> bool:
        return self.reason is not None

    def success(self) -> None:
        """A step completed: the run of faults is broken."""
        if self._recent:
            with self._lock:
                self._recent.clear()

    def failure(self, what: str) -> bool:
        """Count one fault (`what`: a short description, kept as the reason when it trips). Returns
        True exactly once: for the fault that trips the window."""
        now = self.clock()
        with self._lock:
            self.total += 1
            self._recent.append(now)
            while self._recent and now - self._recent[0] > self.window_s:
                self._recent.popleft()
            if self.reason is None and len(self._recent) >= self.limit:
                self.reason = (f"{len(self._recent)} engine faults in a row within {self.window_s:g} s "
                               f"(last: {what})")
                return True
        return False


__all__ = ["DEFAULT_FAULT_LIMIT", "DEFAULT_FAULT_WINDOW_S", "EXIT_ENGINE_FAILED", "FaultWindow"]
