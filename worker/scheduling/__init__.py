"""The scheduling core and its policies (framework-free: no torch, no grpc, no SGLang, no engine
import): every decision about whose work runs, for every executor (docs/scheduling-core.md).

- `core`: `SchedulingCore` (queues, tiers, fairness, admission, the iteration plan, backlog).
- `ledger`: `KVLedger` (the one account of KV room and running slots).
- `tiers`: `TierShares` (strict priority with minimum shares).
- `preemption`: `RoomMaker` (whom to preempt and why).
- `decode_share`: the iteration token target (a contended iteration shared by tier and weight).

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
