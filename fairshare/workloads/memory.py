"""Memory-isolation workloads (docs/memory-isolation.md).

- memory-flood: a tenant sends prompts near the model's context length (1900 of 2048 tokens, 128 out)
  far faster than the server can serve them, into a small KV pool (512 blocks × 16 = 8192 tokens);
  the victim tenant sends ordinary 256/256 requests at 0.3 req/s. With per-tenant KV quotas the flood waits above
  the watermark and is preempted first; without them the victim's requests are preempted and queue
  behind the flood's memory. Registered for `get_workload` (and the quota side-by-side report,
  `python -m loadtests.reports.quota`), not in the fairness benchmark's `all_workloads`.
"""

from __future__ import annotations

from fairshare.workloads import TenantLoad, Workload

SRC = "memory isolation (KV quotas)"

MEMORY_FLOOD = Workload(
    "memory-flood", "flood sends 1900-token prompts (128 out) at 1 req/s into a 512-block pool; victim sends 256/256 "
    "at 0.3 req/s", (TenantLoad("flood", 1.0, 1900, 128), TenantLoad("victim", 0.3, 256, 256)),
    duration_s=120.0, source=SRC, engine={"num_kv_blocks": 512, "max_model_len": 2048}, returning_tenant="victim")

WORKLOADS = [MEMORY_FLOOD]
