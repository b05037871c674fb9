"""Scheduling policy (framework-free: no torch, no grpc): service cost, fair-share policies,
eligibility under memory pressure and fairness metrics.

- `cost`: `LinearCost` (α·P + β·O), `ProfiledCost` (h(P, O)), `make_cost`.
- `policy`: `VTCPolicy` (weighted VTC), `VTCPredictPolicy`, `FCFSPolicy`, `make_policy`.
- `drr`: `DRRPolicy` (deficit round robin).
- `eligibility`: `EligibilityGate` (bounded skips, then a memory reservation).
- `metrics`: `EventLog` (the engine's recorder) and `compute_metrics`.
"""

from worker.scheduling.cost import LinearCost, ProfiledCost, make_cost
from worker.scheduling.policy import (FCFSPolicy, SchedulingPolicy, TenantAccount, VTCPolicy, VTCPredictPolicy,
                                      make_policy)

__all__ = ["LinearCost", "ProfiledCost", "make_cost", "FCFSPolicy", "SchedulingPolicy", "TenantAccount", "VTCPolicy",
           "VTCPredictPolicy", "make_policy"]
