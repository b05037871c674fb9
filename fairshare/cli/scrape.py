"""Read Prometheus text from a /metrics URL into plain samples (prometheus_client's own parser).

`Samples` maps ``(sample name, ((label, value), ...))`` to a float; sample names keep their
suffixes (``_total``, ``_bucket``, ``_count``). `counter_delta` and `histogram_quantile` are the
two computations PromQL's ``increase()`` and ``histogram_quantile()`` make, on two scrapes.
"""

from __future__ import annotations

import math
import urllib.request
from typing import Iterator

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


def add_metrics_url_options(parser, *, gateway: bool) -> None:
    """Add the repeatable ``--worker-metrics URL`` option (with `gateway`, ``--gateway-metrics URL``
    too) to `parser` (an ``argparse`` parser or argument group): the /metrics URLs `fairshare top` and
    `fairshare loadtest` scrape, each collected into a list (``args.worker_metrics``,
    ``args.gateway_metrics``; empty when not given)."""
    if gateway:
        parser.add_argument("--gateway-metrics", action="append", default=[], metavar="URL",
                            help="a gateway's admin /metrics URL (repeatable), e.g. http://gateway:9100/metrics")
    parser.add_argument("--worker-metrics", action="append", default=[], metavar="URL",
                        help="a worker's Prometheus /metrics URL (repeatable), e.g. http://worker-0:9101/metrics")


def parse(text: str) -> Samples:
    """Every sample of a text exposition (``*_created`` timestamps left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def fetch(url: str, timeout_s: float = 3.0) -> Samples:
    """GET `url` and parse it. Raises OSError (unreachable, HTTP error) or ValueError (not Prometheus text)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return parse(r.read().decode("utf-8", "replace"))


def select(samples: Samples, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name`."""
    for (n, labels), v in samples.items():
        if n == name:
            yield dict(labels), v


def counter_delta(new: float, old: float | None) -> float:
    """How much a counter grew from `old` to `new`; a counter that went down was reset (its process
    restarted), so all of `new` is growth (as PromQL's ``increase`` counts it). `old` None: since start."""
    if old is None or new < old:
        return new
    return new - old


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The `q`-quantile (0..1) of a histogram given as {upper bound ``le``: cumulative count},
    interpolating linearly inside the bucket (PromQL's ``histogram_quantile``); a quantile in the
    ``+Inf`` bucket is the largest finite bound. None when the histogram is empty."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le in bounds:
        c = buckets[le]
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


__all__ = ["Samples", "counter_delta", "fetch", "histogram_quantile", "parse", "select"]
