"""Print how far SGLang's scheduler (with the FairShare plugin) diverges from the reference
scheduler on the scripted parity workloads (`tests/parity/workloads.py`).

    .venv-sglang/bin/python -m tests.sglang.parity_report [--policy vtc] [WORKLOAD ...]

Per workload (the comparisons of tests/sglang/test_parity_reference.py):
- against the reference run with SGLang's batching (`prefill_slice` = the chunk, one partial
  prefill at most: `reference_driver.sglang_batching`): admission order iteration by iteration, the
  first iteration whose admissions, retractions or tokens differ (`trace.first_step_difference`),
  per-tenant service shares over the four quarters of the backlog window;
- against the reference at the engine's defaults (16-token slices among any number of partial
  prefills, which SGLang's batching cannot do): the same shares, beside the reference's own
  difference between its two settings;
plus retractions per tenant. Deterministic: same code, same figures.
"""

from __future__ import annotations

import argparse

from tests.parity.reference_driver import run_reference, sglang_batching
from tests.parity.trace import compare, first_step_difference
from tests.parity.workloads import WORKLOADS
from tests.sglang.sglang_driver import run_sglang


def report(name: str, policy: str = "vtc") -> str:
    """The report block of one workload."""
    w = WORKLOADS[name]
    sglang = run_sglang(w, policy)
    granular = run_reference(w, policy, **sglang_batching(w))
    default = run_reference(w, policy)
    order = compare(granular, sglang, w.backlog_window, w.backlogged)
    step = first_step_difference(granular, sglang)
    service = compare(default, sglang, w.backlog_window, w.backlogged)
    own = compare(default, granular, w.backlog_window, w.backlogged)
    lines = [f"== {name} ({policy}): {w.description}", "vs reference at SGLang's batching (prefill_slice = chunk, "
             "max_partial_prefills = 1):"]
    lines += ["  " + line for line in order.describe().splitlines()]
    lines += ["  " + line for line in (step.describe(("reference", "SGLang")).splitlines() if step else
                                       ["every iteration's admissions, retractions and tokens agree"])]
    lines += ["vs reference at its defaults (16-token slices; the reference itself at SGLang's batching: "
              + ", ".join(f"{e:.1%}" for e in own.share_errors) + "):"]
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
