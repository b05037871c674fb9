"""How many CPU threads one forward step runs on (the reference engine on CPU).

A forward step is ~150 parallel regions (each int4 linear, attention, the LM head), and each ends
in a barrier. With sleeping waits (`OMP_WAIT_POLICY=PASSIVE`, the worker's default, see
`worker.cli.passive_thread_wait`) every region pays a futex wake-up of each sibling thread, which
costs more than a small step gains from a second thread: SmolLM2 int4 on 2 CPUs measured
(2026-12-03, `fairshare bench engine --threads T --batches 1,4,8,16,32 --new-tokens 32`, output
tok/s, 1 thread / 2 threads): batch 1 100.4 / 62.0, batch 4 253.4 / 164.3, batch 8 296.3 / 268.0,
batch 16 316.7 / 383.3, batch 32 339.2 / 436.5. So with sleeping waits a step of fewer than
`SLEEPING_WAITS_MIN_ROWS` token rows runs on one thread, and larger steps on every thread; with
spinning waits (the operator chose `OMP_WAIT_POLICY=ACTIVE` or a `GOMP_SPINCOUNT`, for cores the
worker owns) a wake-up is cheap and every step runs on every thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["SLEEPING_WAITS_MIN_ROWS", "StepThreads", "sleeping_waits"]

# token rows from which a step is worth a second thread when the threads sleep at barriers
SLEEPING_WAITS_MIN_ROWS = 16


def sleeping_waits(environ: Mapping[str, str] | None = None) -> bool:
    """Whether libgomp's threads sleep at once at a barrier: `OMP_WAIT_POLICY=passive` (any case) or
    `GOMP_SPINCOUNT=0`. libgomp's default (neither set) spins, and so does any other setting."""
    env = os.environ if environ is None else environ
    if env.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return True
    return env.get("GOMP_SPINCOUNT", "").strip() == "0"


class StepThreads:
    """The intra-op thread count per forward step, set around the step and restored after it.

    threads: the most threads a step may use (default: torch's count when this is built, i.e. the
    worker's `--threads`). min_rows: a step of fewer token rows runs on one thread; None: every
    step runs on `threads` (default: `SLEEPING_WAITS_MIN_ROWS` when `sleeping_waits()`, else None).
    Setting torch's count costs ~0.2 us; it is process-wide, so the engine thread, the only one
    running torch in a worker, owns it during a step.
    """

    def __init__(self, threads: int | None = None, min_rows: int | None | str = "auto") -> None:
        self.threads = int(threads if threads is not None else torch.get_num_threads())
        if min_rows == "auto":
            min_rows = SLEEPING_WAITS_MIN_ROWS if sleeping_waits() else None
        self.min_rows = None if min_rows is None else int(min_rows)

    def describe(self) -> str:
        """E.g. "2 CPU threads, steps under 16 token rows on 1 (OpenMP waits sleep)"."""
        if self.min_rows is None or self.threads == 1:
            return f"{self.threads} CPU thread{'s' if self.threads > 1 else ''}"
        return f"{self.threads} CPU threads, steps under {self.min_rows} token rows on 1 (OpenMP waits sleep)"

    def for_rows(self, rows: int) -> int:
        """Threads for a step of `rows` token rows (prefill tokens plus decode tokens)."""
        if self.min_rows is not None and rows < self.min_rows:
            return 1
        return self.threads

    def run(self, rows: int, fn, *args):
        """fn(*args) with torch's thread count set for `rows`, restored afterwards."""
        want = self.for_rows(rows)
        if want == self.threads:
            return fn(*args)
        torch.set_num_threads(want)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(self.threads)
