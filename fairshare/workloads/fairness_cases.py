"""The seed lesson's fairness cases as workloads.

- weights-costs: weights 1 and 3, requests costing 2 and 10 units (here ×32 so that they are real
  token counts under α=1, β=2: 32 in / 16 out = 64 units, 64 in / 128 out = 320 units). In the
  fluid ideal over any 120-unit stretch the tenants get 30 and 90 units (15 and 9 requests).
- bursty-return: a tenant idle most of the time sends bursts of 10 requests every 60 s while another
  keeps the server overloaded (the returning tenant).
- long-outputs: a tenant with only long outputs (16 in / 1024 out) next to a 256/256 tenant.
- memory-constrained: a tenant whose 3000-token prompts barely fit a small KV pool (4096 tokens)
  next to two 256/256 tenants: it is skipped while memory is short, then memory is reserved for it.
- cancel-half: a tenant that cancels half of its requests 2 s after sending them; they keep what
  they consumed.
Rates as in `vtc_paper.py` (about 2 requests/s of 256/256 capacity).
"""

from __future__ import annotations

from fairshare.workloads import TenantLoad, Workload

SRC = "seed lesson"

WEIGHTS_COSTS = Workload(
    "weights-costs", "weights 1 and 3, request costs 2 and 10 (x32 units: 32/16 and 64/128 tokens), both overloaded",
    (TenantLoad("light", 60.0, 32, 16, weight=1.0), TenantLoad("heavy", 15.0, 64, 128, weight=3.0)), source=SRC)

BURSTY_RETURN = Workload(
    "bursty-return", "steady sends 3 req/s; bursty sends 10 requests at once every 60 s (a returning tenant)",
    (TenantLoad("steady", 3.0), TenantLoad("bursty", 1 / 60, arrival="burst", burst_size=10, start_s=10.0)),
    source=SRC, returning_tenant="bursty")

LONG_OUTPUTS = Workload(
    "long-outputs", "one tenant with only long outputs (16 in / 1024 out, 0.5 req/s) next to 256/256 at 2 req/s",
    (TenantLoad("long-out", 0.5, 16, 1024), TenantLoad("regular", 2.0)), source=SRC)

MEMORY_CONSTRAINED = Workload(
    "memory-constrained", "3000-token prompts (64 out, 0.3 req/s) in a 4096-token KV pool next to two 256/256 "
    "tenants at 1.5 req/s", (TenantLoad("big-prompts", 0.3, 3000, 64), TenantLoad("small1", 1.5),
                             TenantLoad("small2", 1.5)),
    source=SRC, engine={"num_kv_blocks": 256})

CANCEL_HALF = Workload(
    "cancel-half", "a tenant cancels half of its requests 2 s after sending them; the other does not (both 2 req/s)",
    (TenantLoad("canceller", 2.0, cancel_fraction=0.5, cancel_after_s=2.0), TenantLoad("patient", 2.0)), source=SRC)

WORKLOADS = [WEIGHTS_COSTS, BURSTY_RETURN, LONG_OUTPUTS, MEMORY_CONSTRAINED, CANCEL_HALF]
