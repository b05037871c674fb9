"""What both parity drivers share: the step loop over a scripted workload and the end of a step."""

from __future__ import annotations

from typing import Iterable

from tests.parity.trace import IterationRecord, Trace
from tests.parity.workloads import ScriptedWorkload


class ScriptedDriver:
    """Base of `ReferenceDriver` and `SGLangDriver`: `step()` runs one iteration (arrivals of
    `self.iteration`, then the executor's scheduling pass) and returns its `IterationRecord`,
    ending with `_close_step`; `run()` steps through `workload.iterations`."""

    def __init__(self, workload: ScriptedWorkload, executor: str) -> None:
        self.workload = workload
        self.iteration = 0
        self.trace = Trace(executor, workload.name)
        self._arrivals = workload.arrivals()

    def step(self) -> IterationRecord:
        raise NotImplementedError

    def _close_step(self, rec: IterationRecord, waiting_tenants: Iterable[str]) -> IterationRecord:
        """Count the waiting requests per tenant (one tenant id per queued request), keep the
        record, move to the next iteration."""
        for t in waiting_tenants:
            rec.waiting[t] = rec.waiting.get(t, 0) + 1
        self.trace.records.append(rec)
        self.iteration += 1
        return rec

    def run(self) -> Trace:
        """All `workload.iterations` steps from the current one; returns the trace."""
        while self.iteration < self.workload.iterations:
            self.step()
        return self.trace
