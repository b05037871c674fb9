"""Priority-tier workloads (docs/fairness.md, "Tiers").

- tiers: an interactive tenant (`chat`, 256/256 at 0.6 req/s: 30 % of the reference capacity) beside
  a background flood (`bulk`, 256/256 at 3 req/s: 1.5 times the capacity), for 120 s. With tiers,
  `chat` is served as if it were alone (strict priority; lower-tier work it needs room from is
  preempted) and `bulk` still receives at least its minimum share (5 %) of the service; tier-blind
  VTC splits the server between them and FCFS queues `chat` behind the flood. Registered for
  `get_workload` and the tiers section of `fairshare sim report` (`loadtests.reports.tiers`), not
  in the fairness benchmark's `all_workloads`.
- tiers-heavy: the same with `chat` at 70 % of capacity, more than the half that weight-1 VTC would
  give it: tier-blind VTC splits the server and queues `chat`; tiers serve it first.
"""

from __future__ import annotations

from fairshare.workloads import TenantLoad, Workload

SRC = "priority tiers (DESIGN.md, Fairness)"

TIERS = Workload(
    "tiers", "chat (interactive) sends 256/256 at 0.6 req/s (30 % of capacity); bulk (background) floods at 3 req/s",
    (TenantLoad("chat", 0.6, 256, 256, tier="interactive"), TenantLoad("bulk", 3.0, 256, 256, tier="background")),
    duration_s=120.0, source=SRC, returning_tenant="chat")

TIERS_HEAVY = Workload(
    "tiers-heavy", "chat (interactive) sends 256/256 at 1.4 req/s (70 % of capacity, above a weight-1 share); bulk "
    "(background) floods at 3 req/s",
    (TenantLoad("chat", 1.4, 256, 256, tier="interactive"), TenantLoad("bulk", 3.0, 256, 256, tier="background")),
    duration_s=120.0, source=SRC, returning_tenant="chat")

WORKLOADS = [TIERS, TIERS_HEAVY]
