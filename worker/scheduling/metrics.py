"""Fairness metrics computed from per-request and per-iteration events.

The engine (real or simulated) records into an `EventLog`: each request's arrival, admission,
committed tokens and end, and for each iteration the service units charged per tenant.
`compute_metrics` turns a log into per-tenant figures (DESIGN.md, "Measured per tenant"):

- offered demand: cost of every request that arrived (prompt + max_tokens), service units/s;
- backlogged intervals: a tenant is *backlogged* while it has a request that arrived and whose
  prefill has not completed (queued or prefilling: work the scheduler could give it now);
- charged service: service units charged (prefill chunks + committed tokens), cancelled work included;
- service lag: ideal minus actual cumulative service, the ideal being fluid weighted GPS
  (Parekh & Gallager, "A Generalized Processor Sharing Approach to Flow Control in Integrated
  Services Networks: The Single-Node Case", IEEE/ACM ToN 1993): each iteration's actual total
  service is poured into the tenants' fluid queues (requests' costs at their arrival times) in
  proportion to weight, water-filling what an emptied queue cannot take;
- max pairwise weighted service difference: max over tenant pairs and over sub-intervals
  [t1, t2] of a co-backlogged interval of |W_i(t1,t2)/w_i − W_j(t1,t2)/w_j| (the quantity VTC's
  Theorem 4.4 bounds; Sheng et al., OSDI 2024);
- longest starvation window: longest time backlogged with no service at all;
- Jain's index (Jain, Chiu & Hawe, DEC-TR-301, 1984) over x_i = actual / GPS-ideal service;
- queue time (arrival → first scheduled), TTFT (arrival → first token), ITL (gaps between a
  request's tokens), throughput and goodput (finished requests within the TTFT and ITL SLOs).

Times are seconds on the engine's clock; service in service units; no torch, no numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """Events of one request (times in seconds; None until they happen)."""

    request_id: str
    tenant_id: str
    weight: float
    arrival: float
    prompt_tokens: int
    max_tokens: int
    admitted: float | None = None
    first_token: float | None = None
    prefill_done: float | None = None
    finish: float | None = None
    reason: str | None = None
    output_tokens: int = 0
    charged: float = 0.0
    token_times: list[float] = field(default_factory=list)


@dataclass
class StepRecord:
    """One iteration [start, end): service units, prompt tokens and output tokens per tenant."""

    start: float
    end: float
    service: dict[str, float]
    prefill_tokens: dict[str, int]
    output_tokens: dict[str, int]


class EventLog:
    """Recorder the engine calls (`Engine(..., recorder=EventLog())`).

    keep_token_times: store every token's time (needed for ITL percentiles; costs memory).
    """

    def __init__(self, keep_token_times: bool = True) -> None:
        self.requests: dict[str, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        self.weights: dict[str, float] = {}
        self.keep_token_times = keep_token_times

    def on_arrival(self, request_id: str, tenant_id: str, weight: float, t: float, prompt_tokens: int,
                   max_tokens: int) -> None:
        if request_id in self.requests:  # handed back and re-routed (worker/scheduling/handback.py): one request
            return
        self.requests[request_id] = RequestRecord(request_id, tenant_id, weight, t, prompt_tokens, max_tokens)
        self.weights[tenant_id] = weight

    def on_admit(self, request_id: str, t: float) -> None:
        rec = self.requests.get(request_id)
        if rec is not None and rec.admitted is None:
            rec.admitted = t

    def on_token(self, request_id: str, t: float, units: float) -> None:
        rec = self.requests.get(request_id)
        if rec is None:
            return
        if rec.first_token is None:
            rec.first_token = rec.prefill_done = t
        rec.output_tokens += 1
        rec.charged += units
        if self.keep_token_times:
            rec.token_times.append(t)

    def on_prefill_charge(self, request_id: str, units: float) -> None:
        rec = self.requests.get(request_id)
        if rec is not None:
            rec.charged += units

    def on_finish(self, request_id: str, t: float, reason: str) -> None:
        rec = self.requests.get(request_id)
        if rec is not None and rec.finish is None:
            rec.finish, rec.reason = t, reason
            if rec.prefill_done is None:
                rec.prefill_done = t

    def on_step(self, start: float, end: float, service: dict[str, float], prefill_tokens: dict[str, int],
                output_tokens: dict[str, int]) -> None:
        self.steps.append(StepRecord(start, end, service, prefill_tokens, output_tokens))


# ---- small helpers -------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for an empty list."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def jain_index(xs: list[float]) -> float:
    """Jain's fairness index (Σx)² / (n·Σx²) in (0, 1]; NaN for no values or all zeros."""
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if xs and sq > 0 else math.nan


def gps_shares(capacity: float, weights: dict[str, float], demands: dict[str, float] | None = None) -> dict[str, float]:
    """Fluid GPS split of `capacity` service units among tenants by weight (Parekh & Gallager 1993),
    water-filling: a tenant never gets more than its demand (None = unlimited); what it cannot take
    is shared by the rest in proportion to weight. Raises ValueError on a non-positive weight."""
    if any(w <= 0 for w in weights.values()):
        raise ValueError("weights must be > 0")
    out = {t: 0.0 for t in weights}
    active = {t for t in weights if demands is None or demands.get(t, 0.0) > 0}
    left = capacity
    while left > 1e-12 and active:
        total_w = sum(weights[t] for t in active)
        fill = {t: left * weights[t] / total_w for t in active}
        capped = {t for t in active if demands is not None and out[t] + fill[t] >= demands[t]}
        if not capped:
            for t in active:
                out[t] += fill[t]
            break
        for t in capped:
            left -= demands[t] - out[t]
            out[t] = demands[t]
        active -= capped
    return out


def vtc_bound(alpha: float, beta: float, chunk_tokens: int, batch_tokens: int, weights=None) -> float:
    """VTC's service-difference bound in weighted service units: `2·max(α·chunk, β·M) / w_min`
    (Sheng et al. OSDI 2024, Theorem 4.4, with the prefill chunk in place of the longest prompt;
    M = most tokens one batch can hold). With all weights 1 this is DESIGN.md's `2·max(α·chunk, β·M)`."""
    w_min = min(weights) if weights else 1.0
    return 2.0 * max(alpha * chunk_tokens, beta * batch_tokens) / w_min


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


# ---- the computation -----------------------------------------------------------------------------
@dataclass
class TenantMetrics:
    """Per-tenant figures (units in field names: _s seconds, _units service units)."""

    tenant_id: str
    weight: float
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    offered_units: float = 0.0
    offered_units_per_s: float = 0.0
    backlogged_intervals: int = 0
    backlogged_s: float = 0.0
    service_units: float = 0.0
    service_units_per_s: float = 0.0
    gps_units: float = 0.0
    max_lag_units: float = 0.0       # max over time of (GPS ideal − actual) cumulative service
    final_lag_units: float = 0.0
    max_pair_diff_units: float = 0.0  # max weighted difference with any co-backlogged tenant
    longest_starvation_s: float = 0.0
    queue_mean_s: float = math.nan
    queue_p99_s: float = math.nan
    ttft_mean_s: float = math.nan
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    itl_mean_s: float = math.nan
    itl_p99_s: float = math.nan
    output_tokens: int = 0
    goodput_rps: float = 0.0


@dataclass
class FairnessMetrics:
    """Whole-run figures: per tenant, plus the global ones and time series for plots."""

    tenants: dict[str, TenantMetrics]
    window: tuple[float, float]
    max_pair_diff_units: float
    jain: float
    service_units_per_s: float
    output_tokens_per_s: float
    goodput_rps: float
    diff_series: list[tuple[float, float]]  # (time, max current co-backlogged weighted difference)
    slo: tuple[float, float]
    busy_tokens_per_s: float = 0.0  # whole log: (prompt + output tokens) / Σ iteration time
    # where `max_pair_diff_units` comes from: the pair (i, j), the start of their co-backlogged stretch
    # and the end of the step that reached the max (seconds); None without co-backlogged pairs
    max_pair_witness: tuple[str, str, float, float] | None = None


def compute_metrics(log: EventLog, cost, window: tuple[float, float] | None = None,
                    ttft_slo_s: float = 5.0, itl_slo_s: float = 0.5) -> FairnessMetrics:
    """Compute `FairnessMetrics` over the steps whose end lies in `window` (default: the whole log).

    cost: the run's cost function (its `request(P, O)` prices offered demand).
    Goodput counts finished (not aborted) requests with TTFT ≤ ttft_slo_s and mean ITL ≤ itl_slo_s.
    """
    steps = log.steps
    t0, t1 = window if window is not None else ((steps[0].start, steps[-1].end) if steps else (0.0, 0.0))
    span = max(t1 - t0, 1e-9)
    weights = dict(log.weights)
    tenants = {t: TenantMetrics(t, w) for t, w in sorted(weights.items())}
    reqs = list(log.requests.values())

    # Backlogged intervals (arrival -> prefill done), clipped to the window.
    raw: dict[str, list[tuple[float, float]]] = {t: [] for t in tenants}
    for r in reqs:
        end = r.prefill_done if r.prefill_done is not None else math.inf
        a, b = max(r.arrival, t0), min(end, t1)
        if b > a:
            raw[r.tenant_id].append((a, b))
    backlog = {t: merge_intervals(iv) for t, iv in raw.items()}
    for t, iv in backlog.items():
        tenants[t].backlogged_intervals = len(iv)
        tenants[t].backlogged_s = sum(b - a for a, b in iv)

    # Per-request latency figures.
    ttft: dict[str, list[float]] = {t: [] for t in tenants}
    queue: dict[str, list[float]] = {t: [] for t in tenants}
    itl: dict[str, list[float]] = {t: [] for t in tenants}
    for r in reqs:
        m = tenants[r.tenant_id]
        if t0 <= r.arrival < t1:
            m.requests += 1
            m.offered_units += cost.request(r.prompt_tokens, r.max_tokens)
        if r.finish is not None and t0 <= r.finish <= t1:
            if r.reason == "abort":
                m.aborted += 1
            else:
                m.finished += 1
        if not t0 <= r.arrival < t1:
            continue
        if r.admitted is not None:
            queue[r.tenant_id].append(r.admitted - r.arrival)
        if r.first_token is not None:
            ttft[r.tenant_id].append(r.first_token - r.arrival)
        gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
        itl[r.tenant_id].extend(gaps)
        if (r.finish is not None and r.finish <= t1 and r.reason != "abort" and r.first_token is not None
                and r.first_token - r.arrival <= ttft_slo_s and (not gaps or mean(gaps) <= itl_slo_s)):
            m.goodput_rps += 1.0 / span
    for t, m in tenants.items():
        m.offered_units_per_s = m.offered_units / span
        m.queue_mean_s, m.queue_p99_s = mean(queue[t]), percentile(queue[t], 99)
        m.ttft_mean_s, m.ttft_p50_s, m.ttft_p99_s = mean(ttft[t]), percentile(ttft[t], 50), percentile(ttft[t], 99)
        m.itl_mean_s, m.itl_p99_s = mean(itl[t]), percentile(itl[t], 99)

    _service_and_gps(log, cost, tenants, backlog, t0, t1)
    diff, series, witness = _pairwise_difference(steps, tenants, backlog, t0, t1)
    for m in tenants.values():
        m.service_units_per_s = m.service_units / span
    xs = [m.service_units / m.gps_units for m in tenants.values() if m.gps_units > 0]
    out_tokens = sum(m.output_tokens for m in tenants.values())
    return FairnessMetrics(
        tenants=tenants, window=(t0, t1), max_pair_diff_units=diff, jain=jain_index(xs),
        service_units_per_s=sum(m.service_units for m in tenants.values()) / span,
        output_tokens_per_s=out_tokens / span, goodput_rps=sum(m.goodput_rps for m in tenants.values()),
        diff_series=series, slo=(ttft_slo_s, itl_slo_s), busy_tokens_per_s=busy_throughput(log),
        max_pair_witness=witness)


def busy_throughput(log: EventLog) -> float:
    """Tokens computed (prompt tokens charged + output tokens) per second the engine was busy,
    over the whole log. For the same completed set of requests this is the batching efficiency of
    a schedule: work-conserving policies differ only in how well their batches pack."""
    busy = sum(st.end - st.start for st in log.steps)
    tokens = sum(sum(st.prefill_tokens.values()) + sum(st.output_tokens.values()) for st in log.steps)
    return tokens / busy if busy > 0 else math.nan


def _request_work(r: RequestRecord, cost) -> float:
    """Work a request brings to the fluid GPS queue: what it consumed if it ended, else its full cost."""
    return r.charged if r.finish is not None else cost.request(r.prompt_tokens, r.max_tokens)


def _service_and_gps(log: EventLog, cost, tenants, backlog, t0: float, t1: float) -> None:
    """Charged service, GPS-ideal service, service lag and starvation windows per tenant."""
    weights = {t: m.weight for t, m in tenants.items()}
    arrivals = sorted((r.arrival, r.tenant_id, _request_work(r, cost)) for r in log.requests.values())
    fluid = {t: 0.0 for t in tenants}
    actual = {t: 0.0 for t in tenants}
    ideal = {t: 0.0 for t in tenants}
    last_service = {t: None for t in tenants}
    ai = 0
    for st in log.steps:
        while ai < len(arrivals) and arrivals[ai][0] <= st.start:
            fluid[arrivals[ai][1]] += arrivals[ai][2]
            ai += 1
        capacity = sum(st.service.values())
        share = gps_shares(capacity, weights, fluid)
        for t, s in share.items():
            fluid[t] -= s
        if not t0 < st.end <= t1:
            continue
        for t, s in st.service.items():
            actual[t] += s
            tenants[t].output_tokens += st.output_tokens.get(t, 0)
        for t, m in tenants.items():
            ideal[t] += share[t]
            lag = ideal[t] - actual[t]
            m.max_lag_units = max(m.max_lag_units, lag)
            if st.service.get(t, 0.0) > 0:
                last_service[t] = st.end
    for t, m in tenants.items():
        m.service_units, m.gps_units, m.final_lag_units = actual[t], ideal[t], ideal[t] - actual[t]
    # Starvation: longest stretch inside a backlogged interval during which no step served the tenant.
    served: dict[str, list[tuple[float, float]]] = {t: [] for t in tenants}
    for st in log.steps:
        if t0 < st.end <= t1:
            for t, s in st.service.items():
                if s > 0:
                    served[t].append((st.start, st.end))
    for t, iv in backlog.items():
        spans, j, worst = served[t], 0, 0.0
        for a, b in iv:
            while j < len(spans) and spans[j][1] <= a:
                j += 1
            prev = a
            while j < len(spans) and spans[j][0] < b:
                worst = max(worst, spans[j][0] - prev)
                prev = max(prev, spans[j][1])
                j += 1
            if j > 0 and spans[j - 1][1] > b:
                j -= 1  # a step that straddles the interval's end may also serve the next one
            worst = max(worst, b - prev)
        tenants[t].longest_starvation_s = worst


def _pairwise_difference(steps, tenants, backlog, t0: float, t1: float):
    """Max over co-backlogged pairs and sub-intervals of the weighted service difference, a per-step
    series of the largest current difference (for plots), and the max's witness: (i, j, start of
    their co-backlogged stretch, end of the step that reached it), or None."""
    names = sorted(tenants)
    ptr = {t: 0 for t in names}
    cum = {t: 0.0 for t in names}
    # per pair: (lo, hi, start) of D = S_i/w_i − S_j/w_j since their co-backlogged interval began
    state: dict[tuple[str, str], tuple[float, float, float]] = {}
    best = 0.0
    witness = None
    per_tenant = {t: 0.0 for t in names}
    series: list[tuple[float, float]] = []
    for st in steps:
        if not t0 < st.end <= t1:
            continue
        active = []
        for t in names:  # backlogged through the whole step
            iv = backlog[t]
            while ptr[t] < len(iv) and iv[ptr[t]][1] < st.end:
                ptr[t] += 1
            if ptr[t] < len(iv) and iv[ptr[t]][0] <= st.start:
                active.append(t)
        before = dict(cum)
        for t, s in st.service.items():
            cum[t] += s / tenants[t].weight
        current = 0.0
        live = set()
        for x in range(len(active)):
            for y in range(x + 1, len(active)):
                i, j = active[x], active[y]
                live.add((i, j))
                d0, d1 = before[i] - before[j], cum[i] - cum[j]
                prev = state.get((i, j))
                lo, hi, since = ((min(d0, d1), max(d0, d1), st.start) if prev is None
                                 else (min(prev[0], d1), max(prev[1], d1), prev[2]))
                state[(i, j)] = (lo, hi, since)
                spread = hi - lo
                current = max(current, spread)
                if spread > best:
                    best = spread
                    witness = (i, j, since, st.end)
                per_tenant[i] = max(per_tenant[i], spread)
                per_tenant[j] = max(per_tenant[j], spread)
        for key in list(state):
            if key not in live:
                del state[key]
        series.append((st.end, current))
    for t in names:
        tenants[t].max_pair_diff_units = per_tenant[t]
    return best, series, witness
