"""What an executor did, iteration by iteration, and how far two executors' traces diverge.

Both drivers (`tests/parity/reference_driver.py`, `tests/sglang/sglang_driver.py`) produce a `Trace`
of the same shape, so one comparison serves every workload:

- admission order: the requests that left the waiting queue for the running set in each
  iteration, in the order the executor admitted them (a preempted or retracted request that is
  admitted again counts again);
- retractions: the requests sent back from the running set to the waiting queue (reference:
  recompute preemption; SGLang: `ScheduleBatch.retract_decode` or priority preemption);
- tokens computed per tenant (prefill and decode positions, recomputation included) and per-tenant
  charged service (cumulative service units from the fairness policy's accounts), after each
  iteration; waiting requests per tenant after each iteration (to check backlog).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IterationRecord:
    """One iteration. admitted / retracted: request ids in executor order. tokens: tokens computed
    this iteration, per tenant. service: cumulative charged service units per tenant after it.
    waiting: queued requests per tenant after it. finished: requests that finished in it.
    tenant_of: the tenant of every request named in `admitted` and `retracted`."""

    admitted: list[str] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    service: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    tenant_of: dict[str, str] = field(default_factory=dict)


@dataclass
class Trace:
    """An executor's run of one workload: `executor` names it; `records[i]` is iteration i."""

    executor: str
    workload: str
    records: list[IterationRecord] = field(default_factory=list)

    def admission_order(self) -> list[str]:
        """Every admission in order (re-admissions after a retraction included)."""
        return [r for rec in self.records for r in rec.admitted]

    def first_admissions(self) -> list[str]:
        """Each request's first admission, in order."""
        seen: set[str] = set()
        out = []
        for r in self.admission_order():
            if r not in seen:
                seen.add(r)
                out.append(r)
        return out

    def retractions(self) -> list[str]:
        return [r for rec in self.records for r in rec.retracted]

    def finished(self) -> list[str]:
        return [r for rec in self.records for r in rec.finished]

    def service_at(self, iteration: int) -> dict[str, float]:
        """Cumulative service per tenant after `iteration` (clamped to the run; before the first
        iteration: nothing)."""
        if iteration < 0 or not self.records:
            return {}
        return dict(self.records[min(iteration, len(self.records) - 1)].service)

    def service_shares(self, first: int, last: int, tenants) -> dict[str, float]:
        """Each tenant's share of the service the `tenants` received in iterations (first, last]."""
        lo, hi = self.service_at(first), self.service_at(last)
        gained = {t: hi.get(t, 0.0) - lo.get(t, 0.0) for t in tenants}
        total = sum(gained.values())
        return {t: (g / total if total > 0 else 0.0) for t, g in gained.items()}

    def backlog_end(self, start: int, tenants) -> int:
        """The last iteration of the run of iterations from `start` after each of which every tenant
        in `tenants` has a queued request (`start - 1` when that does not hold at `start`)."""
        i = start
        while i < len(self.records) and all(self.records[i].waiting.get(t, 0) > 0 for t in tenants):
            i += 1
        return i - 1

    def heads(self, n: int | None = None) -> list[str]:
        """The first request admitted in each iteration that admitted any (the queue head each time)."""
        out = [rec.admitted[0] for rec in self.records if rec.admitted]
        return out if n is None else out[:n]


def share_error(a: dict[str, float], b: dict[str, float]) -> float:
    """Largest relative difference |b_t - a_t| / a_t over the tenants of share dict `a` (inf when
    `a` gives a tenant nothing that `b` serves)."""
    worst = 0.0
    for t, x in a.items():
        y = b.get(t, 0.0)
        worst = max(worst, abs(y - x) / x if x > 0 else (float("inf") if y > 0 else 0.0))
    return worst


def split_window(window: tuple[int, int], parts: int) -> list[tuple[int, int]]:
    """`window` (iterations (first, last]) cut into `parts` consecutive sub-windows of near-equal length."""
    first, last = window
    edges = [first + (last - first) * k // parts for k in range(parts + 1)]
    return list(zip(edges, edges[1:]))


@dataclass(frozen=True)
class Divergence:
    """How trace `b` differs from trace `a` (the reference) on one workload.

    first_order_difference: first iteration whose admitted lists differ (None: identical).
    order_agreement: share of iterations whose admitted lists are equal. common_prefix: length of
    the common prefix of the two first-admission orders; total: distinct requests admitted by
    either. windows: the sub-windows of the backlog window (iterations (first, last]) shares are
    compared over; shares: per sub-window, (a's shares, b's shares); share_errors: per sub-window,
    the largest relative share difference (`share_error`). retractions: per tenant, (a's, b's).
    """

    first_order_difference: int | None
    order_agreement: float
    common_prefix: int
    total: int
    windows: list[tuple[int, int]]
    shares: list[tuple[dict[str, float], dict[str, float]]]
    share_errors: list[float]
    retractions: dict[str, tuple[int, int]]

    @property
    def max_share_error(self) -> float:
        return max(self.share_errors, default=0.0)

    def describe(self) -> str:
        """A few lines for reports."""
        lines = ["admission order: " + (f"first difference at iteration {self.first_order_difference}, "
                                        if self.first_order_difference is not None else "identical, ")
                 + f"{self.order_agreement:.0%} of iterations equal, first admissions agree on "
                 f"{self.common_prefix} of {self.total}"]
        for (lo, hi), (sa, sb), err in zip(self.windows, self.shares, self.share_errors):
            lines.append(f"service shares over iterations {lo}-{hi}: "
                         + ", ".join(f"{t} {sa[t]:.3f} vs {sb.get(t, 0.0):.3f}" for t in sa) + f"  (error {err:.1%})")
        lines.append("retractions (reference vs other): "
                     + (", ".join(f"{t} {x}/{y}" for t, (x, y) in self.retractions.items()) or "none"))
        return "\n".join(lines)


STEP_FIELDS = ("admitted", "retracted", "tokens")


@dataclass(frozen=True)
class StepDifference:
    """The first iteration at which two traces' records differ: `iteration`, the `fields` of
    `IterationRecord` that differ there (of `STEP_FIELDS`: admitted, retracted, tokens), and both
    records (`a`: the reference's, `b`: the other executor's)."""

    iteration: int
    fields: tuple[str, ...]
    a: IterationRecord
    b: IterationRecord

    def describe(self, names: tuple[str, str] = ("reference", "other")) -> str:
        """Two lines, one per executor: what it admitted, retracted and computed per tenant there,
        and what it had waiting after it."""
        lines = [f"first step difference at iteration {self.iteration} ({', '.join(self.fields)}):"]
        for name, rec in zip(names, (self.a, self.b)):
            lines.append(f"  {name}: admitted {rec.admitted}, retracted {rec.retracted}, tokens "
                         f"{dict(sorted(rec.tokens.items()))}, waiting after {dict(sorted(rec.waiting.items()))}")
        return "\n".join(lines)


def first_step_difference(a: Trace, b: Trace, fields: tuple[str, ...] = STEP_FIELDS,
                          start: int = 0) -> StepDifference | None:
    """The divergence finder: the first iteration from `start` at which trace `b`'s record differs
    from trace `a`'s in any of `fields` (admitted and retracted lists in order; tokens per tenant),
    or None when they agree throughout (a missing record counts as an empty one)."""
    for i in range(start, max(len(a.records), len(b.records))):
        x = a.records[i] if i < len(a.records) else IterationRecord()
        y = b.records[i] if i < len(b.records) else IterationRecord()
        differ = tuple(f for f in fields if getattr(x, f) != getattr(y, f))
        if differ:
            return StepDifference(i, differ, x, y)
    return None


def compare(a: Trace, b: Trace, window: tuple[int, int] | None = None, tenants=(), parts: int = 4) -> Divergence:
    """Compare trace `b` against trace `a` (the reference): admission order iteration by
    iteration, and, when `window` and `tenants` are given, the tenants' service shares over each
    of `parts` consecutive sub-windows of it."""
    n = max(len(a.records), len(b.records))
    first = None
    equal = 0
    for i in range(n):
        x = a.records[i].admitted if i < len(a.records) else []
        y = b.records[i].admitted if i < len(b.records) else []
        if x == y:
            equal += 1
        elif first is None:
            first = i
    fa, fb = a.first_admissions(), b.first_admissions()
    prefix = 0
    while prefix < min(len(fa), len(fb)) and fa[prefix] == fb[prefix]:
        prefix += 1
    windows = split_window(window, parts) if window is not None and tenants else []
    shares = [(a.service_shares(lo, hi, tenants), b.service_shares(lo, hi, tenants)) for lo, hi in windows]
    retracted: dict[str, tuple[int, int]] = {}
    for k, trace in enumerate((a, b)):
        for rec in trace.records:
            for rid in rec.retracted:
                t = rec.tenant_of.get(rid, rid)
                x, y = retracted.get(t, (0, 0))
                retracted[t] = (x + 1, y) if k == 0 else (x, y + 1)
    return Divergence(first, equal / n if n else 1.0, prefix, len(set(fa) | set(fb)), windows, shares,
                      [share_error(sa, sb) for sa, sb in shares], dict(sorted(retracted.items())))
