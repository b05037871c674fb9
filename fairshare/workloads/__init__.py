"""Workload definitions shared by the simulator (`fairshare sim`) and the Locust campaigns.

A `Workload` is a list of `TenantLoad`s (arrival process, prompt and output lengths in tokens,
weight, cancellations) over `duration_s` seconds; `Workload.generate(seed, rate_scale)` turns it
into a deterministic list of `RequestSpec`s (same seed, same requests). Lengths are token counts:
the simulator uses them directly, a Locust campaign synthesizes prompts of that many tokens and
sets `max_tokens` to the output length (with `ignore_eos`).

Sizing: rates are written for a server that completes about `REFERENCE_CAPACITY_RPS` requests/s
of 256-in/256-out requests (so "overload" really overloads it and "proportional" does not);
`rate_scale` multiplies every rate, e.g. by measured capacity / `REFERENCE_CAPACITY_RPS` (what
`fairshare sim report --rate-scale auto` does) to keep the same load levels on other hardware.

The definitions live in `vtc_paper.py` (Sheng et al., OSDI 2024, §5.2 synthetic workloads) and
`fairness_cases.py` (the seed lesson's fairness cases: weights and costs, a returning tenant, long
outputs, memory pressure, cancellations); `WORKLOADS` maps names to them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

REFERENCE_CAPACITY_RPS = 2.0


@dataclass(frozen=True)
class RequestSpec:
    """One request: arrival (s), token counts, when the client cancels it (None = never), and the
    tenant's tier (interactive, batch or background)."""

    request_id: str
    tenant_id: str
    weight: float
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cancel_at_s: float | None = None
    tier: str = "interactive"


@dataclass(frozen=True)
class TenantLoad:
    """One tenant's traffic.

    rate: mean arrival rate, requests/s (arrival events/s for "burst"). prompt_tokens /
    output_tokens: a length, or (lo, hi) for uniform lengths in [lo, hi]. arrival: "poisson",
    "uniform" (evenly spaced) or "burst" (`burst_size` requests at once, events evenly spaced).
    start_s / stop_s: when the tenant sends (stop None = until the end). on_off_s: (on, off)
    seconds, on first. rate_end: ramp the rate linearly from `rate` to `rate_end` over
    [start_s, stop_s]. cancel_fraction: share of requests the client cancels, `cancel_after_s`
    after their arrival. tier: the tenant's tier (interactive, batch, background).
    """

    tenant_id: str
    rate: float
    prompt_tokens: int | tuple[int, int] = 256
    output_tokens: int | tuple[int, int] = 256
    weight: float = 1.0
    arrival: str = "poisson"
    start_s: float = 0.0
    stop_s: float | None = None
    on_off_s: tuple[float, float] | None = None
    burst_size: int = 1
    rate_end: float | None = None
    cancel_fraction: float = 0.0
    cancel_after_s: float = 2.0
    tier: str = "interactive"

    def _length(self, spec, rng: random.Random) -> int:
        return int(spec) if isinstance(spec, int) else rng.randint(int(spec[0]), int(spec[1]))

    def _is_on(self, t: float) -> bool:
        if self.on_off_s is None:
            return True
        on, off = self.on_off_s
        return (t - self.start_s) % (on + off) < on

    def generate(self, duration_s: float, seed: int, rate_scale: float = 1.0) -> list[RequestSpec]:
        """This tenant's requests in [start_s, min(stop_s, duration_s)), deterministic per seed."""
        if self.rate <= 0 or rate_scale <= 0:
            return []
        rng = random.Random(f"{seed}:{self.tenant_id}")
        stop = min(self.stop_s if self.stop_s is not None else duration_s, duration_s)
        r0, r1 = self.rate * rate_scale, (self.rate_end if self.rate_end is not None else self.rate) * rate_scale
        r_max = max(r0, r1)

        def rate_at(t: float) -> float:
            span = max(stop - self.start_s, 1e-9)
            return r0 + (r1 - r0) * (t - self.start_s) / span

        out: list[RequestSpec] = []
        t = self.start_s
        while True:
            if self.arrival == "poisson":
                t += rng.expovariate(r_max)
                accept = rng.random() * r_max <= rate_at(t)  # thinning for a ramp
            elif self.arrival in ("uniform", "burst"):
                t += 1.0 / rate_at(t) if rate_at(t) > 0 else math.inf
                accept = True
            else:
                raise ValueError(f"unknown arrival process {self.arrival!r}")
            if t >= stop:
                break
            if not accept or not self._is_on(t):
                continue
            for _ in range(self.burst_size if self.arrival == "burst" else 1):
                n = len(out)
                cancel = self.cancel_after_s if rng.random() < self.cancel_fraction else None
                out.append(RequestSpec(f"{self.tenant_id}-{n}", self.tenant_id, self.weight, t,
                                       self._length(self.prompt_tokens, rng), self._length(self.output_tokens, rng),
                                       None if cancel is None else t + cancel, self.tier))
        return out


@dataclass(frozen=True)
class Workload:
    """A named multi-tenant workload.

    duration_s: seconds during which requests arrive (metrics use [0, duration_s]). engine:
    engine settings this workload needs (e.g. a small `num_kv_blocks`). source: where it comes from.
    returning_tenant: the tenant whose TTFT is compared with its solo TTFT in reports (or None).
    """

    name: str
    description: str
    tenants: tuple[TenantLoad, ...]
    duration_s: float = 300.0
    source: str = ""
    engine: dict = field(default_factory=dict)
    returning_tenant: str | None = None

    def generate(self, seed: int = 0, rate_scale: float = 1.0) -> list[RequestSpec]:
        """All requests, sorted by arrival time (ties by request id). Deterministic per seed."""
        reqs = [r for t in self.tenants for r in t.generate(self.duration_s, seed, rate_scale)]
        return sorted(reqs, key=lambda r: (r.arrival_s, r.request_id))

    def weights(self) -> dict[str, float]:
        return {t.tenant_id: t.weight for t in self.tenants}

    def tiers(self) -> dict[str, str]:
        return {t.tenant_id: t.tier for t in self.tenants}

    def only(self, tenant_id: str) -> "Workload":
        """The same workload with one tenant alone (for solo baselines). Raises KeyError."""
        keep = tuple(t for t in self.tenants if t.tenant_id == tenant_id)
        if not keep:
            raise KeyError(tenant_id)
        return Workload(f"{self.name}[{tenant_id} solo]", self.description, keep, self.duration_s, self.source,
                        dict(self.engine), self.returning_tenant)


def _registry() -> dict[str, Workload]:
    from fairshare.workloads import fairness_cases, vtc_paper

    out: dict[str, Workload] = {}
    for w in vtc_paper.WORKLOADS + fairness_cases.WORKLOADS:
        out[w.name] = w
    return out


def get_workload(name: str) -> Workload:
    """A workload by name (the fairness benchmark's, or an extra one such as `memory-flood`, or a
    prompted one: `shared-system-prompts`, `pool-skew`, a `shared_prefix.SharedPrefixWorkload`).
    Raises KeyError listing the known names."""
    from fairshare.workloads import memory, pool, shared_prefix, tiers

    reg = _registry()
    reg.update({w.name: w for w in memory.WORKLOADS + tiers.WORKLOADS})
    reg.update(shared_prefix.WORKLOADS)
    reg.update(pool.WORKLOADS)
    if name not in reg:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(reg)}")
    return reg[name]


def all_workloads() -> list[Workload]:
    """The fairness benchmark's workloads (every policy side by side in `fairshare sim report`)."""
    return list(_registry().values())


def tier_workloads() -> list[Workload]:
    """The priority-tier workloads (fairshare/workloads/tiers.py): `fairshare sim report` runs each under
    tier-aware VTC, tier-blind VTC and FCFS, side by side, in a section of its own."""
    from fairshare.workloads import tiers

    return list(tiers.WORKLOADS)


def quota_workloads() -> list[Workload]:
    """The memory-isolation workloads (fairshare/workloads/memory.py): `fairshare sim report` runs each
    with KV quotas off and on, side by side, in a section of its own (not in the fairness summary)."""
    from fairshare.workloads import memory

    return list(memory.WORKLOADS)
