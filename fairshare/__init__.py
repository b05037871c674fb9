"""FairShare: multi-tenant LLM serving with weighted fair scheduling (VTC).

What both tiers share lives here: the tenant config schema (`fairshare.config`), the tier
vocabulary (`fairshare.tiers`), the gRPC contract's names (`fairshare.contract`) and generated stubs
(`fairshare.v1`), telemetry set-up, worker authentication, the pool board's reports and the workload
definitions (`fairshare.workloads`). It imports neither tier. The `fairshare` command line sits above
both tiers in `fairshare.cli` (tests/unit/test_import_layers.py checks the direction).
"""

__version__ = "0.1.0"
