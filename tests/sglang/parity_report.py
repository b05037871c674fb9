"""Print how far SGLang's scheduler (with the FairShare plugin) diverges from the reference
scheduler on the scripted parity workloads (`tests/parity/workloads.py`).

    .venv-sglang/bin/python -m tests.sglang.parity_report [--policy vtc] [WORKLOAD ...]

Per workload, two comparisons (the two tests of tests/sglang/test_parity_reference.py):
- admission order, iteration by iteration, against the reference run at SGLang's prefill
  granularity (`prefill_slice` = the chunk: each pick may take a whole request, as SGLang's
  `PrefillAdder` admits whole requests in queue order);
- per-tenant service shares over the four quarters of the workload's backlog window, against the
  reference at the engine's defaults (16-token slices split among tenants), where SGLang's
  batching differs by design;
plus retractions per tenant. Deterministic: same code, same figures.
"""

from __future__ import annotations

import argparse

from tests.parity.reference_driver import run_reference
from tests.parity.trace import compare
from tests.parity.workloads import WORKLOADS
from tests.sglang.sglang_driver import run_sglang


def report(name: str, policy: str = "vtc") -> str:
    """The report block of one workload."""
    w = WORKLOADS[name]
    sglang = run_sglang(w, policy)
    granular = run_reference(w, policy, prefill_slice=w.engine.chunk_tokens, max_partial_prefills=1)
    default = run_reference(w, policy)
    order = compare(granular, sglang)
    service = compare(default, sglang, w.backlog_window, w.backlogged)
    lines = [f"== {name} ({policy}): {w.description}",
             "vs reference at SGLang's granularity: " + order.describe().splitlines()[0],
             "vs reference at its defaults:"]
    lines += ["  " + line for line in service.describe().splitlines()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--policy", default="vtc", choices=("vtc", "vtc-pred", "drr", "fcfs"))
    args = ap.parse_args(argv)
    for name in args.workloads:
        print(report(name, args.policy))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
