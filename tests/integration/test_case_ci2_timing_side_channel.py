"""Case CI2 (../shared/cases/cache-isolation.md): a tenant probing TTFT with prompts that share a
prefix with another tenant's recent prompts learns nothing: a threshold classifier on the probe's
TTFT does no better than chance.

Real worker subprocesses (random-tiny) over real gRPC; protocol in loadtests/bench/sidechannel.py: the
victim sends fresh random prefixes (+32 tokens), the attacker then sends, in random order, one
probe per victim prefix (that prefix + its own 32 tokens) and as many same-length controls; every
probe is fresh for the attacker (and carries a fresh cache_salt), so it can never hit its own
cache. Prefixes are 512 tokens in the unsafe arm (a wide gap, so that CPU hiccups on a loaded
2-core machine cannot blur a real leak below the bound) and 256 in the namespaced arm (cheaper
probes, hence 200 + 200 of them in the time budget).
The statistic is the ROC AUC of "TTFT below a threshold ⇒ shared" (Mann–Whitney U / n1·n2, ties
1/2; loadtests/bench/sidechannel_stats.py):

- with the worker's experiment-only `--unsafe-global-cache` (one namespace for everybody) the
  leak must be visible: AUC > 0.9. This proves the experiment can see one;
- with namespaces on (the default) AUC must lie in [0.4, 0.6]. With 200 + 200 probes the AUC's
  standard deviation under no leak is about 0.029, so the band is about ±3.5σ: not flaky on a
  noisy machine, yet a real leak (AUC near 1) cannot pass.

The bounds are on a rank statistic of the two classes measured in the same run, interleaved, not
on wall-clock values, so a slow or loaded machine moves both classes alike. The worker's own
report of cached prompt tokens is checked as well (the mechanism: hits in the unsafe arm, none
for the attacker with namespaces). The report (samples, median TTFT per class, AUC) is printed;
`python -m loadtests.bench.sidechannel` prints the same one, and also the arm with a TTFT floor.
"""

from __future__ import annotations

import pytest

from loadtests.bench.sidechannel import ProbeConfig, probe_worker, setup_line, start_worker, stop_worker
from loadtests.bench.sidechannel_stats import format_report

UNSAFE = ProbeConfig(pairs=80, prefix_tokens=512, suffix_tokens=32, batch=20, seed=1)
NAMESPACED = ProbeConfig(pairs=200, prefix_tokens=256, suffix_tokens=32, batch=20, seed=2)


@pytest.fixture(scope="module")
def report():
    arms = []
    yield arms
    for cfg, res in arms:
        print("\n" + format_report([res], setup_line(cfg)))


def test_case_ci2_unsafe_global_cache_leaks_through_ttft(report, tmp_path):
    proc, addr = start_worker(["--unsafe-global-cache"], log_path=tmp_path / "worker-unsafe.log")
    try:
        res = probe_worker(addr, "unsafe global cache", UNSAFE)
    finally:
        stop_worker(proc)
    report.append((UNSAFE, res))
    assert res.shared_cached >= UNSAFE.prefix_tokens and res.control_cached == 0   # it did hit the victim's blocks
    assert res.auc > 0.9, format_report([res])


def test_case_ci2_namespaced_cache_ttft_is_chance(report, worker_addr):
    res = probe_worker(worker_addr, "per-tenant namespaces (default)", NAMESPACED)
    report.append((NAMESPACED, res))
    assert res.shared_cached == 0 and res.control_cached == 0        # no hit on the victim's blocks
    assert 0.4 <= res.auc <= 0.6, format_report([res])
