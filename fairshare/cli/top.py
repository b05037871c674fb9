"""`fairshare top`: a live per-tenant view of the platform, from the gateways' and workers' metrics.

::

    fairshare top [--state-dir DIR]                        # against `fairshare up` (reads run.json)
    fairshare top --gateway-metrics URL --worker-metrics URL [--worker-metrics URL ...]  # a cluster
                  [--interval 2] [--window 60] [--once] [--json]

One row per tenant: tier and weight (the gateway's tenants file), its share of the charged service
(the workers' ``fairshare_worker_tenant_charged_service_units_total``) against its ideal weighted
share, queued and running requests, KV blocks, prefix-cache hit rate, TTFT p50/p99 (as the gateway
saw it) and 429s. Counters are read as increases over the window (PromQL's ``increase``, a counter
that went down was reset by a restart): the live view keeps its own scrapes and shows the last
``--window`` seconds (60 by default; fewer while it has not run that long). ``--once`` prints one
frame: over the workers' whole life by default, or over ``--window S`` seconds (two scrapes S apart).
``--json`` prints the same figures as one JSON object per frame.

The ideal share of a tenant is its weight over the sum of the weights of the *active* tenants (those
charged service in the window or with requests queued or running): what weighted VTC gives tenants
that keep the workers busy (docs/fairness.md).

Sources: the gateway's admin listener (``fairshare gateway --metrics-port``) and each worker's
(``fairshare worker --metrics-port``); `fairshare up` starts both on loopback and writes their URLs
to ``run.json`` in its state directory, which is where this command looks without URLs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from fairshare.cli.scrape import Samples, add_metrics_url_options, counter_delta, fetch, histogram_quantile, select

DEFAULT_INTERVAL_S = 2.0
DEFAULT_WINDOW_S = 60.0

# sample names read (the metrics are documented in docs/observability.md)
G_WEIGHT = "fairshare_gateway_tenant_weight"
G_TTFT = "fairshare_gateway_ttft_seconds_bucket"
G_429 = "fairshare_gateway_rate_limited_total"
G_REQUESTS = "fairshare_gateway_requests_total"
G_WORKER_UP = "fairshare_gateway_worker_up"
G_REDIS_UP = "fairshare_gateway_redis_up"
G_RATE = "fairshare_gateway_output_tokens_per_second"
W_SERVICE = "fairshare_worker_tenant_charged_service_units_total"
W_WAITING = "fairshare_worker_tenant_waiting_requests"
W_RUNNING = "fairshare_worker_tenant_running_requests"
W_KV = "fairshare_worker_tenant_kv_blocks"
W_WEIGHT = "fairshare_worker_tenant_weight"
W_PROMPT = "fairshare_worker_prompt_tokens_total"
W_CACHED = "fairshare_worker_cached_prompt_tokens_total"
W_KV_USED = "fairshare_worker_kv_blocks_used"
W_KV_TOTAL = "fairshare_worker_kv_blocks_total"
W_POLICY = "fairshare_worker_policy_info"


class TopError(Exception):
    """A usage problem (no sources): one line, exit status 2."""


@dataclass
class Sources:
    """Where the metrics are: /metrics URLs of the gateways and of the workers."""

    gateways: list[str]
    workers: list[str]
    where: str = ""  # how they were found, for the header


@dataclass
class Scrape:
    """One read of every source: samples per URL (None when it could not be read)."""

    t: float  # time.monotonic()
    wall: float  # time.time()
    gateways: dict[str, Samples | None]
    workers: dict[str, Samples | None]
    errors: list[str] = field(default_factory=list)


def find_sources(args) -> Sources:
    """The URLs given, else those of the `fairshare up` whose state dir is `--state-dir` (or the
    default one). Raises TopError when there are none."""
    if args.gateway_metrics or args.worker_metrics:
        return Sources(list(args.gateway_metrics), list(args.worker_metrics), "given URLs")
    from fairshare.cli.up import default_state_dir

    state = (args.state_dir or default_state_dir()).expanduser().resolve()
    run = state / "run.json"
    try:
        info = json.loads(run.read_text())
        metrics = info["metrics"]
    except FileNotFoundError:
        raise TopError(f"no {run}: is `fairshare up` running with this state dir? (pass --state-dir DIR, or "
                       "--gateway-metrics URL --worker-metrics URL for a cluster)") from None
    except (OSError, ValueError, KeyError) as e:
        raise TopError(f"cannot read the metrics URLs from {run} ({type(e).__name__}: {e}); pass "
                       "--gateway-metrics URL --worker-metrics URL") from None
    return Sources(list(metrics.get("gateway", [])), list(metrics.get("workers", [])),
                   f"fairshare up (pid {info.get('pid')}, {state})")


def take_scrape(sources: Sources, timeout_s: float = 3.0) -> Scrape:
    """Read every source once; a source that fails is None, with its error in ``errors``."""
    errors: list[str] = []

    def read(url: str) -> Samples | None:
        try:
            return fetch(url, timeout_s)
        except (OSError, ValueError) as e:
            errors.append(f"{url}: {type(e).__name__}: {getattr(e, 'reason', e)}")
            return None

    t, wall = time.monotonic(), time.time()
    return Scrape(t, wall, {u: read(u) for u in sources.gateways}, {u: read(u) for u in sources.workers}, errors)


# -- figures ---------------------------------------------------------------------------------------

def _latest(per_url: dict[str, Samples | None], name: str, by: str = "tenant") -> dict[str, float]:
    """Sum over sources of the current value of `name`, per value of label `by`."""
    out: dict[str, float] = {}
    for samples in per_url.values():
        for labels, v in select(samples or {}, name):
            k = labels.get(by, "")
            out[k] = out.get(k, 0.0) + v
    return out


def _increase(new: dict[str, Samples | None], base: dict[str, Samples | None] | None, name: str,
              by: tuple[str, ...] = ("tenant",)) -> dict[tuple[str, ...], float]:
    """Sum over sources of how much counter `name` grew since `base` (None: since start), per `by`."""
    out: dict[tuple[str, ...], float] = {}
    for url, samples in new.items():
        if samples is None:
            continue
        old = (base or {}).get(url)
        for (n, labels), v in samples.items():
            if n != name:
                continue
            lab = dict(labels)
            k = tuple(lab.get(b, "") for b in by)
            out[k] = out.get(k, 0.0) + counter_delta(v, None if old is None else old.get((n, labels)))
    return out


def _quantiles(buckets: dict[tuple[str, ...], float], tenant: str) -> tuple[float | None, float | None]:
    hist: dict[float, float] = {}
    for (t, le), c in buckets.items():
        if t == tenant:
            b = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
            hist[b] = hist.get(b, 0.0) + c
    return histogram_quantile(0.5, hist), histogram_quantile(0.99, hist)


def summarize(new: Scrape, base: Scrape | None, sources: Sources) -> dict:
    """The figures of one frame: over ``new - base`` (base None: since the counters started).

    Returns ``{"time", "window_s", "sources", "errors", "platform": {...}, "tenants": [{...}]}``;
    per tenant: ``tenant, tier, weight, service_units`` (in the window), ``service_units_total``
    (since the workers started), ``service_share``, ``ideal_share``, ``service_units_per_s``,
    ``queued, running, kv_blocks, cache_hit_rate, ttft_p50_s, ttft_p99_s, rate_limited, requests``.
    Unknown figures are None.
    """
    g_new, w_new = new.gateways, new.workers
    g_base, w_base = (base.gateways, base.workers) if base else (None, None)
    window_s = (new.t - base.t) if base else None

    weights: dict[str, float] = {}
    tiers: dict[str, str] = {}
    for samples in g_new.values():
        for labels, v in select(samples or {}, G_WEIGHT):
            weights[labels["tenant"]] = v
            tiers[labels["tenant"]] = labels.get("tier", "")
    for t, v in _latest(w_new, W_WEIGHT).items():
        weights.setdefault(t, v)
    service = {k[0]: v for k, v in _increase(w_new, w_base, W_SERVICE).items()}
    service_total = _latest(w_new, W_SERVICE)
    queued, running, kv = _latest(w_new, W_WAITING), _latest(w_new, W_RUNNING), _latest(w_new, W_KV)
    prompt = {k[0]: v for k, v in _increase(w_new, w_base, W_PROMPT).items()}
    cached = {k[0]: v for k, v in _increase(w_new, w_base, W_CACHED).items()}
    ttft = _increase(g_new, g_base, G_TTFT, ("tenant", "le"))
    limited: dict[str, float] = {}
    for (t,), v in _increase(g_new, g_base, G_429).items():
        limited[t] = limited.get(t, 0.0) + v
    requests: dict[str, float] = {}
    for (t,), v in _increase(g_new, g_base, G_REQUESTS).items():
        requests[t] = requests.get(t, 0.0) + v

    tenants = sorted((set(weights) | set(service_total) | set(requests) | set(queued)) - {"unknown", ""})
    total = sum(service.get(t, 0.0) for t in tenants)
    active = [t for t in tenants if service.get(t, 0) > 0 or queued.get(t, 0) + running.get(t, 0) > 0]
    active_weight = sum(weights.get(t, 0.0) for t in active)
    rows = []
    for t in tenants:
        svc = service.get(t, 0.0)
        p50, p99 = _quantiles(ttft, t)
        rows.append({
            "tenant": t, "tier": tiers.get(t), "weight": weights.get(t),
            "service_units": svc, "service_units_total": service_total.get(t, 0.0),
            "service_share": svc / total if total > 0 else None,
            "ideal_share": (weights[t] / active_weight if t in active and t in weights and active_weight > 0
                            else None),
            "service_units_per_s": svc / window_s if window_s else None,
            "queued": int(queued.get(t, 0)), "running": int(running.get(t, 0)), "kv_blocks": int(kv.get(t, 0)),
            "cache_hit_rate": cached.get(t, 0.0) / prompt[t] if prompt.get(t) else None,
            "ttft_p50_s": p50, "ttft_p99_s": p99,
            "rate_limited": int(limited.get(t, 0)), "requests": int(requests.get(t, 0)),
        })
    up = [v for s in g_new.values() for _, v in select(s or {}, G_WORKER_UP)]
    redis = [v for s in g_new.values() for _, v in select(s or {}, G_REDIS_UP)]
    policies = sorted({lab.get("policy", "") for s in w_new.values() for lab, _ in select(s or {}, W_POLICY)})
    rates = {lab.get("model", ""): v for s in g_new.values() for lab, v in select(s or {}, G_RATE)}
    platform = {
        "gateways": len(g_new), "gateways_reachable": sum(s is not None for s in g_new.values()),
        "workers": len(w_new), "workers_reachable": sum(s is not None for s in w_new.values()),
        "workers_up": int(sum(up)) if up else None, "workers_known": len(up) if up else None,
        "redis_up": (min(redis) == 1) if redis else None, "policy": ",".join(p for p in policies if p) or None,
        "kv_blocks_used": int(sum(_latest(w_new, W_KV_USED).values())),
        "kv_blocks_total": int(sum(_latest(w_new, W_KV_TOTAL).values())),
        "service_units_per_s": total / window_s if window_s else None,
        "output_tokens_per_s_per_stream": rates,
    }
    return {"time": new.wall, "window_s": window_s, "sources": {"gateway": sources.gateways,
                                                                "workers": sources.workers},
            "errors": list(new.errors), "platform": platform, "tenants": rows}


class History:
    """The scrapes of the last `window_s` seconds; `base()` is the oldest of them (None: only one)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.scrapes: deque[Scrape] = deque()

    def add(self, s: Scrape) -> None:
        self.scrapes.append(s)
        while len(self.scrapes) > 2 and s.t - self.scrapes[1].t >= self.window_s:
            self.scrapes.popleft()

    def base(self) -> Scrape | None:
        return self.scrapes[0] if len(self.scrapes) > 1 else None


# -- rendering -------------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s"


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(summary: dict, sources: Sources, window_s: float | None):
    """The frame as a rich renderable (a header line, the tenants table, errors)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    p = summary["platform"]
    win = summary["window_s"]
    when = time.strftime("%H:%M:%S", time.localtime(summary["time"]))
    if win is None:
        span = "workers' whole life"
    elif window_s and win < window_s - 0.5:
        span = f"last {win:.0f} s of a {window_s:.0f} s window"
    else:
        span = f"last {win:.0f} s"
    workers = (f"workers {p['workers_up']}/{p['workers_known']} up" if p["workers_up"] is not None
               else f"workers {p['workers_reachable']}/{p['workers']} reachable")
    redis = {True: "Redis up", False: "Redis DOWN", None: "Redis ?"}[p["redis_up"]]
    head = Text.assemble(("FairShare top", "bold"), f"  {when}  {workers}  {redis}  policy {p['policy'] or '?'}  "
                         f"KV {p['kv_blocks_used']}/{p['kv_blocks_total']} blocks  "
                         f"{_num(p['service_units_per_s'])} service units/s  over the {span}")
    table = Table(expand=False, header_style="bold")
    for col, just in (("tenant", "left"), ("tier", "left"), ("weight", "right"), ("service share", "right"),
                      ("ideal", "right"), ("units/s", "right"), ("queued", "right"), ("running", "right"),
                      ("KV blocks", "right"), ("cache hit", "right"), ("TTFT p50", "right"), ("TTFT p99", "right"),
                      ("429s", "right"), ("requests", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    for r in summary["tenants"]:
        share, ideal = r["service_share"], r["ideal_share"]
        style = ""
        if share is not None and ideal is not None and ideal > 0 and abs(share - ideal) / ideal > 0.2:
            style = "yellow"  # more than 20 % away from its weighted share
        table.add_row(r["tenant"], r["tier"] or "-", _num(r["weight"], "{:g}"), Text(_pct(share), style=style),
                      _pct(ideal), _num(r["service_units_per_s"]), str(r["queued"]), str(r["running"]),
                      str(r["kv_blocks"]), _pct(r["cache_hit_rate"]), _secs(r["ttft_p50_s"]),
                      _secs(r["ttft_p99_s"]), str(r["rate_limited"]), str(r["requests"]))
    parts = [head, table]
    for e in summary["errors"]:
        parts.append(Text(f"unreachable: {e}", style="red"))
    parts.append(Text(f"sources: {sources.where or 'given URLs'}; Ctrl-C quits", style="dim"))
    return Group(*parts)


# -- command line ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fairshare top", description="Live per-tenant view of a FairShare platform "
                                "(from the gateway's and workers' Prometheus metrics).")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="state dir of the `fairshare up` to watch (default: the one `fairshare up` uses)")
    add_metrics_url_options(p, gateway=True)
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S,
                   help=f"seconds between refreshes (default {DEFAULT_INTERVAL_S:g})")
    p.add_argument("--window", type=float, default=None,
                   help=f"seconds the shares, rates and quantiles cover (default {DEFAULT_WINDOW_S:g}; with --once: "
                        "the workers' whole life unless given)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="JSON instead of the table (one object per frame)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare top`; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.interval <= 0 or (args.window is not None and args.window < 0):
        print("fairshare top: --interval must be > 0 and --window >= 0", file=sys.stderr)
        return 2
    try:
        sources = find_sources(args)
    except TopError as e:
        print(f"fairshare top: {e}", file=sys.stderr)
        return 2
    if args.once:
        return _once(args, sources)
    try:
        return _live(args, sources)
    except KeyboardInterrupt:
        return 0


def _emit_json(summary: dict) -> None:
    print(json.dumps(summary, sort_keys=False), flush=True)


def _once(args, sources: Sources) -> int:
    first = take_scrape(sources)
    base = None
    if args.window:
        time.sleep(args.window)
        base, first = first, take_scrape(sources)
    summary = summarize(first, base, sources)
    if args.json:
        _emit_json(summary)
    else:
        from rich.console import Console

        # not a terminal (a pipe, a file): wide enough for every column instead of rich's 80
        Console(width=None if sys.stdout.isatty() else 200).print(render(summary, sources, args.window))
    reachable = any(s is not None for s in [*first.gateways.values(), *first.workers.values()])
    if not reachable:
        print("fairshare top: no source could be read: " + "; ".join(first.errors), file=sys.stderr)
        return 1
    return 0


def _live(args, sources: Sources) -> int:
    window = DEFAULT_WINDOW_S if args.window is None else args.window
    hist = History(window)
    if args.json:
        while True:
            s = take_scrape(sources)
            hist.add(s)
            _emit_json(summarize(s, hist.base(), sources))
            time.sleep(max(0.0, args.interval - (time.monotonic() - s.t)))
    from rich.console import Console
    from rich.live import Live

    console = Console()
    s = take_scrape(sources)
    hist.add(s)
    with Live(render(summarize(s, None, sources), sources, window), console=console, auto_refresh=False,
              screen=console.is_terminal) as live:
        while True:
            time.sleep(max(0.0, args.interval - (time.monotonic() - s.t)))
            s = take_scrape(sources)
            hist.add(s)
            live.update(render(summarize(s, hist.base(), sources), sources, window), refresh=True)


if __name__ == "__main__":
    sys.exit(main())
