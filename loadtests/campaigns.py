"""Load-test campaigns: which tenants send what, how many connections each has, how they are configured.

A `Campaign` pairs a workload (`fairshare.workloads`: arrival process, prompt and output lengths per
tenant, deterministic per seed) with what a live run needs on top of it:

- per tenant, how many Locust users (concurrent connections) replay its requests, and the tier and
  gateway limits its entry in the tenants file gets when `fairshare loadtest` starts the platform;
- the worker's `--max-running` for a local platform (a small batch makes requests queue, which is
  when the scheduling policy matters);
- the tenant whose latency the campaign is about (`focus`), compared across policies in the report.

Users replay the workload open-loop: each user takes the tenant's next request, waits for its
arrival time and sends it; when all of a tenant's users are busy, its next request goes out late
(the report counts late and unsent requests). A tenant with a rate far above capacity is therefore
a closed loop of `users` connections.

Campaigns:

- `noisy-neighbour`: `flood` keeps 24 streams open (rate far above capacity, at most 20 in flight at
  the gateway, so it also collects 429s), each asking for 4x the trickle's output; `trickle` sends a
  short request every 2 s.
  With `--max-running 2`, FCFS queues each trickle request behind the flood's backlog; VTC serves it
  at the next free slot.
- `bursty-return`: the shared `bursty-return` workload (steady overload; `bursty` sends 10 requests at
  once every 60 s).
- `long-output`: the shared `long-outputs` workload (16 in / 1024 out next to 256 / 256).
- `mixed-tiers`: an interactive, a batch and a background tenant with different weights, all busy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from fairshare.workloads import RequestSpec, TenantLoad, Workload, get_workload


@dataclass(frozen=True)
class TenantSetup:
    """A tenant's Locust users and platform configuration (weight comes from the workload)."""

    users: int = 4
    tier: str = "interactive"
    limits: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Campaign:
    name: str
    description: str
    build: Callable[[float], Workload]  # duration_s -> workload
    tenants: dict[str, TenantSetup]
    duration_s: float = 60.0
    max_running: int = 4
    focus: str | None = None  # the tenant whose TTFT is compared across policies
    notes: str = ""

    def workload(self, duration_s: float | None = None) -> Workload:
        d = float(duration_s or self.duration_s)
        w = self.build(d)
        missing = {t.tenant_id for t in w.tenants} - set(self.tenants)
        if missing:
            raise ValueError(f"campaign {self.name}: no TenantSetup for {sorted(missing)}")
        return w

    def requests(self, duration_s: float | None = None, seed: int = 0, rate_scale: float = 1.0,
                 length_scale: float = 1.0) -> list[RequestSpec]:
        """The campaign's requests (deterministic per seed); `length_scale` multiplies prompt and output
        lengths (e.g. 0.25 to run a GPU-sized campaign on a CPU), keeping at least one token each."""
        reqs = self.workload(duration_s).generate(seed=seed, rate_scale=rate_scale)
        if length_scale != 1.0:
            reqs = [dataclasses.replace(r, prompt_tokens=max(1, round(r.prompt_tokens * length_scale)),
                                        output_tokens=max(1, round(r.output_tokens * length_scale)))
                    for r in reqs]
        return reqs

    def tenant_ids(self) -> list[str]:
        return list(self.tenants)

    def tenants_file(self, duration_s: float | None = None) -> dict:
        """The tenants YAML content (`fairshare/config.py` schema) for a local platform."""
        w = self.workload(duration_s)
        weights = w.weights()
        out = []
        for tid, setup in self.tenants.items():
            entry: dict = {"id": tid, "weight": float(weights.get(tid, 1.0)), "tier": setup.tier}
            if setup.limits:
                entry["limits"] = dict(setup.limits)
            out.append(entry)
        return {"tenants": out}

    def total_users(self) -> int:
        return sum(s.users for s in self.tenants.values())


def _with_duration(name: str) -> Callable[[float], Workload]:
    """A shared workload, its duration set to the campaign's."""

    def build(duration_s: float) -> Workload:
        return dataclasses.replace(get_workload(name), duration_s=duration_s)

    return build


def _noisy_neighbour(duration_s: float) -> Workload:
    # The trickle starts once the flood has filled the worker's queue and stops a while before the
    # end, so that its last requests get their first token within the run even under FCFS. Its
    # demand (~0.5 x 65 service units/s with the chat template) stays far below half the capacity
    # of even a slow machine, so VTC owes it its whole demand; the flood is a closed loop of 24
    # connections (at most 20 in flight at the gateway), always backlogged.
    trickle_stop = max(duration_s - min(12.0, duration_s / 4), 6.0)
    return Workload(
        "noisy-neighbour",
        "flood: 20 req/s (far above capacity: a closed loop of 24 connections) of 64 in / 64 out; "
        "trickle: 0.5 req/s of 16 in / 16 out from t=5 s",
        (TenantLoad("flood", 20.0, 64, 64, weight=1.0),
         TenantLoad("trickle", 0.5, 16, 16, weight=1.0, arrival="uniform", start_s=5.0, stop_s=trickle_stop)),
        duration_s=duration_s, source="loadtests/campaigns.py", returning_tenant="trickle")


def _mixed_tiers(duration_s: float) -> Workload:
    return Workload(
        "mixed-tiers",
        "interactive (w=1, 1 req/s of 128/64), batch (w=2, 2 req/s of 256/256), "
        "background (w=1, 1 req/s of 256/512): together above capacity",
        (TenantLoad("interactive", 1.0, 128, 64, weight=1.0),
         TenantLoad("batch", 2.0, 256, 256, weight=2.0),
         TenantLoad("background", 1.0, 256, 512, weight=1.0)),
        duration_s=duration_s, source="loadtests/campaigns.py")


CAMPAIGNS: dict[str, Campaign] = {
    c.name: c for c in (
        Campaign(
            "noisy-neighbour",
            "one tenant floods (24 streams, 64-token outputs), one sends a trickle of short requests",
            _noisy_neighbour,
            {"flood": TenantSetup(users=24, limits={"max_concurrent_requests": 20}),
             "trickle": TenantSetup(users=8)},
            duration_s=60.0, max_running=2, focus="trickle",
            notes="With a small running batch, FCFS makes each trickle request wait for the flood requests "
                  "queued before it; VTC admits it at the next free slot because the trickle's counter is "
                  "the smallest."),
        Campaign(
            "bursty-return", "a steady tenant keeps the worker overloaded; a bursty one returns with 10 requests "
            "at once every 60 s (shared workload `bursty-return`)",
            _with_duration("bursty-return"),
            {"steady": TenantSetup(users=12), "bursty": TenantSetup(users=10)},
            duration_s=140.0, max_running=4, focus="bursty",
            notes="The bursts arrive at 70 s and 130 s; a run shorter than 70 s has none."),
        Campaign(
            "long-output", "a tenant asking only for long outputs next to a regular one (shared workload "
            "`long-outputs`)",
            _with_duration("long-outputs"),
            {"long-out": TenantSetup(users=8), "regular": TenantSetup(users=8)},
            duration_s=90.0, max_running=4, focus="regular"),
        Campaign(
            "mixed-tiers", "interactive, batch and background tenants with different weights, all busy",
            _mixed_tiers,
            {"interactive": TenantSetup(users=4, tier="interactive"),
             "batch": TenantSetup(users=8, tier="batch", limits={"max_concurrent_requests": 8}),
             "background": TenantSetup(users=8, tier="background")},
            duration_s=90.0, max_running=4, focus="interactive"),
    )
}


def get_campaign(name: str) -> Campaign:
    """A campaign by name. Raises KeyError listing the known names."""
    if name not in CAMPAIGNS:
        raise KeyError(f"unknown campaign {name!r}; known: {', '.join(CAMPAIGNS)}")
    return CAMPAIGNS[name]
