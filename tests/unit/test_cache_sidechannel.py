"""The statistics of the CI2 timing side-channel experiment (loadtests/bench/sidechannel_stats.py)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from loadtests.bench.sidechannel_stats import (analyse, auc_null_std, best_threshold, format_report, paired_auc,
                                               paired_auc_null_std, roc_auc)


def brute_auc(pos, neg):
    return sum((p < n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def test_auc_matches_pair_counting_with_ties():
    rng = random.Random(7)
    for _ in range(50):
        pos = [rng.randint(0, 12) for _ in range(rng.randint(1, 30))]
        neg = [rng.randint(0, 12) for _ in range(rng.randint(1, 30))]
        assert roc_auc(pos, neg) == pytest.approx(brute_auc(pos, neg))


def test_auc_extremes_and_direction():
    assert roc_auc([0.01, 0.02], [0.05, 0.06]) == 1.0      # shared probes faster: full leak
    assert roc_auc([0.05, 0.06], [0.01, 0.02]) == 0.0
    assert roc_auc([0.03] * 4, [0.03] * 5) == 0.5          # all tied: chance
    with pytest.raises(ValueError):
        roc_auc([], [1.0])


def test_null_distribution_of_the_auc():
    assert auc_null_std(200, 200) == pytest.approx(0.0289, abs=1e-4)
    rng = random.Random(11)
    aucs = [roc_auc([rng.random() for _ in range(200)], [rng.random() for _ in range(200)]) for _ in range(200)]
    mean = sum(aucs) / len(aucs)
    sd = (sum((a - mean) ** 2 for a in aucs) / (len(aucs) - 1)) ** 0.5
    assert abs(mean - 0.5) < 0.01 and 0.022 < sd < 0.036
    assert all(0.4 <= a <= 0.6 for a in aucs)               # the CI2 band holds for 200 + 200 draws of no leak


def test_paired_auc_counts_each_probe_against_its_own_control():
    assert paired_auc([0.01, 0.05, 0.03], [0.02, 0.04, 0.03]) == pytest.approx((1 + 0 + 0.5) / 3)
    assert paired_auc([0.01, 0.02], [0.05, 0.06]) == 1.0
    # a load swing that slows both probes of a pair cancels; the pooled AUC is blurred by it
    shared = [0.010, 0.100, 0.011, 0.101]
    control = [0.020, 0.200, 0.021, 0.201]
    assert paired_auc(shared, control) == 1.0 and roc_auc(shared, control) < 0.9
    with pytest.raises(ValueError):
        paired_auc([0.1], [0.1, 0.2])
    with pytest.raises(ValueError):
        paired_auc([], [])


def test_null_distribution_of_the_paired_auc():
    assert paired_auc_null_std(300) == pytest.approx(0.0289, abs=1e-4)
    rng = random.Random(13)
    aucs = []
    for _ in range(300):
        load = [rng.expovariate(1.0) for _ in range(300)]  # per-pair load: both probes of a pair alike
        aucs.append(paired_auc([l * rng.random() for l in load], [l * rng.random() for l in load]))
    mean = sum(aucs) / len(aucs)
    sd = (sum((a - mean) ** 2 for a in aucs) / (len(aucs) - 1)) ** 0.5
    assert abs(mean - 0.5) < 0.01 and 0.022 < sd < 0.036
    assert all(0.4 <= a <= 0.6 for a in aucs)               # the CI2 band holds for 300 pairs of no leak


def test_best_threshold_and_report():
    t, acc = best_threshold([1, 2, 3], [4, 5, 6])
    assert 3 < t < 4 and acc == 1.0
    assert best_threshold([1, 4], [1, 4])[1] == 0.5
    res = analyse("arm", [0.01, 0.02, 0.03], [0.02, 0.05, 0.06], 256.0, 0.0, [0.009], [0.05])
    assert res.auc == pytest.approx(paired_auc(res.shared, res.control)) and res.worker_auc == 1.0
    assert res.pooled_auc == pytest.approx(brute_auc(res.shared, res.control))
    res = analyse("arm", [0.01, 0.02, 0.03], [0.02, 0.05, 0.06], 256.0, 0.0, [0.009, 0.01, 0.02], [0.05, 0.02, 0.03])
    assert res.auc == 1.0 and res.worker_auc == 1.0
    text = format_report([res], "setup")
    assert text.splitlines()[0] == "setup" and "arm" in text and f"{res.auc:.3f}" in text


def test_bench_and_sidechannel_modules_import_neither_torch_nor_grpc():
    code = ("import sys, loadtests.bench.sidechannel_stats, loadtests.bench.cache; "
            "bad=[m for m in ('torch','grpc') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
