"""Statistics of the prefix-cache timing side-channel experiment (case CI2).

An attacker tenant measures the TTFT of two classes of probe: *shared* probes, whose first tokens
are another tenant's recent prompt, and *control* probes of the same length that share nothing with
anyone. If the radix cache leaked across tenants, shared probes would skip most of their prefill and
come back sooner. The attacker's best single-feature classifier is a threshold on TTFT ("faster
than t seconds means shared"); its quality over every threshold is the area under its ROC curve:

    AUC = P(TTFT_shared < TTFT_control) + 1/2 · P(TTFT_shared = TTFT_control)

which is the Mann–Whitney U statistic of the two samples divided by n1·n2 (Mann & Whitney 1947;
Hanley & McNeil, Radiology 1982, "The meaning and use of the area under a ROC curve", §2).
AUC = 0.5: TTFT says nothing about the other tenant's cache; 1.0: it reveals it every time.
Under the null hypothesis (both samples from one distribution, no ties) U has standard deviation
sqrt(n1·n2·(n1+n2+1)/12), so the AUC's is sqrt((n1+n2+1)/(12·n1·n2)) (≈ 0.029 for 200 + 200).

The experiment's verdict uses the *paired* form (`paired_auc`): probes are sent in pairs, a shared
probe and its same-length control back to back in a random order, so both see the same machine
load, and the statistic compares each shared probe with its own control only:

    paired AUC = (1/n) · Σ_i ( 1[TTFT_shared,i < TTFT_control,i] + 1/2 · 1[equal] )

the AUC restricted to the n matched (positive, negative) pairs: the chance that an attacker shown
one pair picks the shared probe as the faster one (the sign test's statistic; Dixon & Mood, JASA
1946). Load that slows a moment slows both probes of the pair, so it cancels, where in the pooled
AUC a probe sent during a hiccup is compared with every probe sent in quiet moments. Under no leak
the order within a pair is a fair coin and both probes are alike, so each pair is a Bernoulli(1/2)
trial: mean 0.5, standard deviation 0.5/sqrt(n) (≈ 0.029 for 300 pairs).

Pure Python, no torch or grpc: the driver (`loadtests/bench/sidechannel.py`) collects the samples over
gRPC and hands them to `analyse`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


def roc_auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """AUC of the classifier "score < threshold ⇒ positive" over every threshold.

    positives / negatives: the scores (here TTFT, seconds) of each class; lower scores are taken as
    evidence for the positive class. Equals P(pos < neg) + P(pos = neg) / 2, computed from the
    Mann–Whitney U statistic with mid-ranks for ties, in O((n1 + n2) log(n1 + n2)).
    Raises ValueError when a class is empty.
    """
    n1, n2 = len(positives), len(negatives)
    if n1 == 0 or n2 == 0:
        raise ValueError("both classes need at least one sample")
    merged = sorted([(float(x), 0) for x in positives] + [(float(x), 1) for x in negatives])
    # mid-ranks (1-based), ties share the average of the ranks they span
    rank_sum_neg = 0.0
    i = 0
    while i < len(merged):
        j = i
        while j + 1 < len(merged) and merged[j + 1][0] == merged[i][0]:
            j += 1
        mid = (i + j) / 2 + 1
        rank_sum_neg += mid * sum(1 for k in range(i, j + 1) if merged[k][1] == 1)
        i = j + 1
    # U of the negatives = number of (pos, neg) pairs with pos < neg (+1/2 per tie)
    u_neg = rank_sum_neg - n2 * (n2 + 1) / 2
    return u_neg / (n1 * n2)


def paired_auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """Paired AUC (module docstring): the fraction of pairs i with positives[i] < negatives[i], ties
    counting 1/2. positives[i] and negatives[i] are the scores (TTFT, seconds) of the i-th pair's
    shared and control probe. Raises ValueError when empty or of unequal length."""
    if not positives or len(positives) != len(negatives):
        raise ValueError("paired_auc needs two non-empty samples of equal length (one entry per pair)")
    return sum((float(p) < float(n)) + 0.5 * (float(p) == float(n))
               for p, n in zip(positives, negatives)) / len(positives)


def paired_auc_null_std(n: int) -> float:
    """Standard deviation of `paired_auc` over `n` pairs when there is no leak (each pair a fair
    coin): 0.5/sqrt(n). Raises ValueError when n <= 0."""
    if n <= 0:
        raise ValueError("need at least one pair")
    return 0.5 / math.sqrt(n)


def auc_null_std(n1: int, n2: int) -> float:
    """Standard deviation of the AUC when both classes share one continuous distribution:
    sqrt((n1 + n2 + 1) / (12·n1·n2)). Raises ValueError when a class is empty."""
    if n1 <= 0 or n2 <= 0:
        raise ValueError("both classes need at least one sample")
    return math.sqrt((n1 + n2 + 1) / (12 * n1 * n2))


def best_threshold(positives: Sequence[float], negatives: Sequence[float]) -> tuple[float, float]:
    """The threshold t (seconds) maximising the balanced accuracy of "score < t ⇒ positive", and
    that accuracy (0.5 = chance, 1.0 = perfect). Thresholds tried: midpoints between consecutive
    distinct scores, plus one below all of them. Raises ValueError when a class is empty."""
    n1, n2 = len(positives), len(negatives)
    if n1 == 0 or n2 == 0:
        raise ValueError("both classes need at least one sample")
    values = sorted(set(map(float, positives)) | set(map(float, negatives)))
    cuts = [values[0] - 1.0] + [(a + b) / 2 for a, b in zip(values, values[1:])] + [values[-1] + 1.0]
    pos, neg = sorted(map(float, positives)), sorted(map(float, negatives))
    best_t, best_acc = cuts[0], 0.5
    ip = ineg = 0
    for t in cuts:
        while ip < n1 and pos[ip] < t:
            ip += 1
        while ineg < n2 and neg[ineg] < t:
            ineg += 1
        acc = 0.5 * (ip / n1 + (n2 - ineg) / n2)  # TPR and TNR
        if acc > best_acc:
            best_t, best_acc = t, acc
    return best_t, best_acc


@dataclass(frozen=True)
class SideChannelResult:
    """One arm of the experiment.

    label: the worker's cache mode (e.g. "unsafe global cache"). shared / control: probe TTFTs,
    seconds (client-measured: call sent -> first response carrying tokens), shared[i] and control[i]
    sent back to back as pair i. auc: `paired_auc(shared, control)`, the verdict's statistic.
    null_std: `paired_auc_null_std`. pooled_auc: `roc_auc(shared, control)` over all probes, for the
    record. threshold_s / threshold_accuracy: `best_threshold` over all probes. shared_cached /
    control_cached: mean prompt tokens the worker reported as cached per probe
    (usage.cached_prompt_tokens), for the record. worker_auc: the paired AUC over the TTFTs the
    worker itself reported (arrival at the worker -> first token), None when not measured.
    """

    label: str
    shared: tuple[float, ...]
    control: tuple[float, ...]
    auc: float
    null_std: float
    threshold_s: float
    threshold_accuracy: float
    shared_cached: float = 0.0
    control_cached: float = 0.0
    worker_auc: float | None = None
    pooled_auc: float | None = None

    @property
    def z(self) -> float:
        """(AUC − 0.5) in units of the null standard deviation."""
        return (self.auc - 0.5) / self.null_std

    def row(self) -> str:
        """One line of the report table (see `format_report`)."""
        return (f"{self.label:<34} {len(self.shared):>4}+{len(self.control):<4} "
                f"{statistics.median(self.shared) * 1e3:>9.1f} {statistics.median(self.control) * 1e3:>9.1f} "
                f"{self.auc:>6.3f} {self.z:>+6.1f} "
                f"{'-' if self.pooled_auc is None else format(self.pooled_auc, '.3f'):>6} {self.threshold_accuracy:>6.3f} "
                f"{self.shared_cached:>7.1f} {self.control_cached:>7.1f} "
                f"{'-' if self.worker_auc is None else format(self.worker_auc, '.3f'):>6}")


def analyse(label: str, shared: Sequence[float], control: Sequence[float], shared_cached: float = 0.0,
            control_cached: float = 0.0, worker_shared: Sequence[float] = (),
            worker_control: Sequence[float] = ()) -> SideChannelResult:
    """Build a `SideChannelResult` from the two TTFT samples (seconds; shared[i] and control[i] are
    pair i), and optionally the worker-reported TTFTs of the same probes, paired alike. Raises
    ValueError when a class is empty or the classes differ in length."""
    t, acc = best_threshold(shared, control)
    worker_auc = paired_auc(worker_shared, worker_control) if worker_shared and worker_control else None
    return SideChannelResult(label, tuple(shared), tuple(control), paired_auc(shared, control),
                             paired_auc_null_std(len(shared)), t, acc, shared_cached, control_cached,
                             worker_auc, roc_auc(shared, control))


REPORT_HEADER = (f"{'worker cache mode':<34} {'n':>9} {'p50 shr':>9} {'p50 ctl':>9} {'AUC':>6} {'z':>6} {'pooled':>6} "
                 f"{'thrAcc':>6} {'cch shr':>7} {'cch ctl':>7} {'AUC@w':>6}")


def format_report(results: Sequence[SideChannelResult], setup: str = "") -> str:
    """The printed report: one row per arm. Columns: probes shared+control, median TTFT of each
    class (ms), paired AUC, its z-score against chance, pooled AUC (every shared probe against every
    control), best threshold balanced accuracy, mean cached prompt tokens per probe reported by the
    worker for each class, paired AUC over the worker-reported TTFTs."""
    lines = []
    if setup:
        lines.append(setup)
    lines.append(REPORT_HEADER)
    lines.extend(r.row() for r in results)
    lines.append("AUC = P(TTFT shared < TTFT of its paired control), ties 1/2, over the back-to-back pairs; "
                 "pooled = the same over all shared x control (Mann-Whitney U / n1 n2); 0.5 = chance.")
    return "\n".join(lines)
