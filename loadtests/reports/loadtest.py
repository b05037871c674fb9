"""Per-tenant figures, plots and `report.md` for a campaign run under one or more policies.

Input per policy (a "run"): the Locust records JSON written by `loadtests/locustfile.py`, the worker
samples taken during the run (per-tenant counters from GetLoad or the worker's Prometheus metrics,
summed over workers) and Locust's own CSV stats. `summarize` turns a run into per-tenant figures;
`write_report` writes ``report.md``, ``summary.json`` and three PNG plots, with the policies side by
side:

- ``ttft.png``: TTFT of every request per tenant over the run (requests still waiting for their first
  token when the run ended are drawn hollow at their wait so far, a lower bound);
- ``service.png``: service rate per tenant (service units/s over a sliding window) from the worker's
  charged service, or, without worker access, estimated on the client from usage (α·P + β·O);
- ``rejections.png``: 429s per tenant per time bin.

Percentiles are linear interpolation between order statistics (numpy's default).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.reports.common import cell, percentile, pyplot

ALPHA, BETA = 1.0, 2.0  # the worker's default cost c = α·P + β·O (fairshare worker --alpha/--beta)
SERVICE_WINDOW_S = 5.0
BIN_S = 5.0


@dataclass
class Run:
    """One campaign run under one policy."""

    policy: str
    data: dict  # the records JSON written by the locustfile
    samples: list[dict] = field(default_factory=list)  # [{"t": s since t0, "tenants": {id: {counter: v}}}]
    locust_stats: list[dict] = field(default_factory=list)  # rows of Locust's <prefix>_stats.csv
    worker_source: str = ""  # "GetLoad 127.0.0.1:50051", "metrics http://...", or "" (none)
    setup: dict = field(default_factory=dict)  # how it was run (url, model, max_running, ...)

    @property
    def records(self) -> list[dict]:
        return self.data.get("records", [])

    @property
    def tenants(self) -> list[str]:
        seen = list(self.data.get("weights", {}))
        for r in self.records:
            if r["tenant"] not in seen:
                seen.append(r["tenant"])
        return seen


def read_locust_stats(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _ttft_samples(run: Run, tenant: str) -> tuple[list[float], list[float]]:
    """(measured TTFTs, lower bounds for requests cut while still waiting for their first token)."""
    t_end = run.data.get("t_end") or 0.0
    got, censored = [], []
    for r in run.records:
        if r["tenant"] != tenant:
            continue
        if r["ttft_s"] is not None:
            got.append(r["ttft_s"])
        elif r["outcome"] == "cut":
            censored.append(max(t_end - r["t_send"], 0.0))
    return got, censored


def _worker_service(run: Run) -> dict[str, float] | None:
    """Charged service per tenant over the run (last sample minus first), or None without samples."""
    if len(run.samples) < 2:
        return None
    first, last = run.samples[0]["tenants"], run.samples[-1]["tenants"]
    out = {}
    for t in set(first) | set(last):
        out[t] = last.get(t, {}).get("charged_service", 0.0) - first.get(t, {}).get("charged_service", 0.0)
    return out


def overtakes(run: Run, tenant: str) -> list[int]:
    """Per answered request of `tenant`: how many other tenants' requests got their first token after it
    was sent and before its own first token (client clock, order only).

    An order statistic of what the scheduler did, not a duration: under FCFS a request waits behind
    everything queued before it (the flood's whole backlog), under VTC (Sheng et al., OSDI '24, §4) a
    tenant with the lowest virtual counter takes the next free slot, so only the requests already being
    admitted pass it. A slow or loaded machine stretches TTFTs but not this count.
    """
    firsts = [(r["t_send"] + r["ttft_s"], r["tenant"]) for r in run.records if r["ttft_s"] is not None]
    out = []
    for r in run.records:
        if r["tenant"] != tenant or r["ttft_s"] is None:
            continue
        t0, t1 = r["t_send"], r["t_send"] + r["ttft_s"]
        out.append(sum(1 for t, who in firsts if who != tenant and t0 < t < t1))
    return out


def summarize(run: Run) -> dict:
    """Per-tenant figures of one run: {"tenants": {id: {...}}, "totals": {...}}."""
    weights = run.data.get("weights", {})
    planned = run.data.get("planned", {})
    unsent = run.data.get("unsent", {})
    wsvc = _worker_service(run)
    dur = max(run.data.get("t_end") or run.data.get("duration_s") or 1.0, 1e-9)
    span = (run.samples[-1]["t"] - run.samples[0]["t"]) if len(run.samples) >= 2 else dur
    out: dict[str, dict] = {}
    for t in run.tenants:
        recs = [r for r in run.records if r["tenant"] == t]
        by = {k: [r for r in recs if r["outcome"] == k] for k in ("ok", "rejected", "error", "cut")}
        ttft, censored = _ttft_samples(run, t)
        ttft_all = ttft + censored  # censored values are lower bounds: percentiles are too
        itl = [g for r in recs for g in r["itl_s"]]
        e2e = [r["e2e_s"] for r in by["ok"] if r["e2e_s"] is not None]
        out_tok = sum((r["completion_tokens"] or 0) for r in by["ok"])
        prompt_tok = sum((r["prompt_tokens"] or 0) for r in by["ok"])
        client_units = ALPHA * prompt_tok + BETA * out_tok
        late = [r["late_s"] for r in recs]
        passed = overtakes(run, t)
        out[t] = {
            "weight": weights.get(t),
            "users": run.data.get("users", {}).get(t),
            "planned": planned.get(t),
            "sent": len(recs),
            "unsent": unsent.get(t, 0),
            "ok": len(by["ok"]),
            "rejected_429": len(by["rejected"]),
            "errors": len(by["error"]),
            "cut": len(by["cut"]),
            "waiting_at_end": len(censored),
            "late_over_1s": sum(1 for x in late if x > 1.0),
            "ttft_p50_s": percentile(ttft_all, 50),
            "ttft_p90_s": percentile(ttft_all, 90),
            "ttft_p99_s": percentile(ttft_all, 99),
            "ttft_max_s": max(ttft_all) if ttft_all else None,
            "ttft_n": len(ttft_all),
            "overtaken_mean": (sum(passed) / len(passed)) if passed else None,
            "overtaken_max": max(passed) if passed else None,
            "itl_p50_s": percentile(itl, 50),
            "itl_p99_s": percentile(itl, 99),
            "e2e_p50_s": percentile(e2e, 50),
            "output_tokens": out_tok,
            "output_tok_per_s": out_tok / dur,
            "client_service_units": client_units,
            "worker_service_units": None if wsvc is None else wsvc.get(t, 0.0),
            "worker_service_rate": None if wsvc is None else wsvc.get(t, 0.0) / max(span, 1e-9),
        }
    total_svc = sum((v["worker_service_units"] or 0.0) for v in out.values()) if wsvc is not None else None
    for v in out.values():
        v["worker_service_share"] = (v["worker_service_units"] / total_svc) if total_svc else None
    return {"policy": run.policy, "tenants": out,
            "totals": {"requests": len(run.records), "worker_service_units": total_svc, "duration_s": dur}}


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------

def _colors(tenants: list[str]) -> dict[str, str]:
    palette = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    return {t: palette[i % len(palette)] for i, t in enumerate(tenants)}


@contextlib.contextmanager
def _figure(runs: list[Run], title: str, ylabel: str, path: Path):
    """One panel per run, side by side with a shared y axis, saved to `path` (PNG) on exit.

    Yields (panels [(axes, run)], tenants of all runs, {tenant: colour})."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(6.4 * len(runs), 4.2), sharey=True, squeeze=False)
    fig.suptitle(title)
    tenants = _all_tenants(runs)
    yield list(zip(axes[0], runs, strict=True)), tenants, _colors(tenants)
    axes[0][0].set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _label_panel(ax, title: str, xlabel: str, title_size: int | None = None, grid_which: str = "major",
                 **legend) -> None:
    """Title, x label, grid and legend (`legend`: Axes.legend keywords) of one panel."""
    ax.set_title(title, fontsize=title_size)
    ax.set_xlabel(xlabel)
    ax.grid(True, which=grid_which, alpha=0.3)
    ax.legend(**legend)


def service_series(run: Run, window_s: float = SERVICE_WINDOW_S) -> tuple[str, dict[str, tuple[list, list]]]:
    """(source, {tenant: (times, service units/s)}) from worker samples, else from client usage."""
    if len(run.samples) >= 2:
        out: dict[str, tuple[list, list]] = {}
        tenants = sorted({t for s in run.samples for t in s["tenants"]})
        for t in tenants:
            xs, ys = [], []
            j = 0
            for i, s in enumerate(run.samples):
                while run.samples[j]["t"] < s["t"] - window_s:
                    j += 1
                if i == j:
                    continue
                a = run.samples[j]
                dt = s["t"] - a["t"]
                dv = s["tenants"].get(t, {}).get("charged_service", 0.0) - a["tenants"].get(t, {}).get(
                    "charged_service", 0.0)
                xs.append(s["t"])
                ys.append(dv / dt if dt > 0 else 0.0)
            out[t] = (xs, ys)
        return "worker charged service", out
    out = {}
    t_end = run.data.get("t_end") or run.data.get("duration_s") or 0.0
    n = max(int(math.ceil(t_end / BIN_S)), 1)
    for t in run.tenants:
        bins = [0.0] * n
        for r in run.records:
            if r["tenant"] == t and r["outcome"] == "ok" and r["e2e_s"] is not None:
                k = min(int((r["t_send"] + r["e2e_s"]) / BIN_S), n - 1)
                bins[k] += ALPHA * (r["prompt_tokens"] or 0) + BETA * (r["completion_tokens"] or 0)
        out[t] = ([(k + 1) * BIN_S for k in range(n)], [b / BIN_S for b in bins])
    return f"client-side estimate ({ALPHA:g}·prompt + {BETA:g}·output tokens of completed requests)", out


def plot_ttft(runs: list[Run], path: Path, focus: str | None = None) -> None:
    """TTFT per tenant over time, one panel per run (PNG at `path`); `focus` drawn larger."""
    with _figure(runs, "TTFT per tenant over time", "TTFT (s, log scale)", path) as (panels, tenants, col):
        for ax, run in panels:
            t_end = run.data.get("t_end") or 0.0
            for t in tenants:
                pts = [(r["t_send"], r["ttft_s"]) for r in run.records if r["tenant"] == t and r["ttft_s"] is not None]
                cut = [(r["t_send"], max(t_end - r["t_send"], 1e-3)) for r in run.records
                       if r["tenant"] == t and r["ttft_s"] is None and r["outcome"] == "cut"]
                size = 22 if t == focus else 10
                if pts:
                    ax.scatter([p[0] for p in pts], [max(p[1], 1e-3) for p in pts], s=size, color=col[t], label=t,
                               alpha=0.8, zorder=3 if t == focus else 2)
                if cut:
                    ax.scatter([p[0] for p in cut], [p[1] for p in cut], s=size, facecolors="none",
                               edgecolors=col[t], label=f"{t} (no first token by the end; ≥)")
            ax.set_yscale("log")
            _label_panel(ax, f"policy: {run.policy}", "request sent at (s since start)", grid_which="both",
                         fontsize=7, loc="best", framealpha=0.6)


def plot_service(runs: list[Run], path: Path) -> None:
    """Service rate per tenant over time, one panel per run (PNG at `path`)."""
    title = f"Service rate per tenant ({SERVICE_WINDOW_S:g} s window)"
    with _figure(runs, title, "service units / s", path) as (panels, tenants, col):
        for ax, run in panels:
            source, series = service_series(run)
            for t in tenants:
                if t in series and series[t][0]:
                    ax.plot(series[t][0], series[t][1], color=col[t], label=t)
            _label_panel(ax, f"policy: {run.policy}\n({source})", "time (s since start)", title_size=9,
                         fontsize=8, loc="upper left")


def plot_rejections(runs: list[Run], path: Path) -> None:
    """429 responses per tenant per BIN_S seconds, one panel per run (PNG at `path`)."""
    with _figure(runs, f"429s per tenant (per {BIN_S:g} s)", "429 responses", path) as (panels, tenants, col):
        for ax, run in panels:
            t_end = run.data.get("t_end") or run.data.get("duration_s") or BIN_S
            n = max(int(math.ceil(t_end / BIN_S)), 1)
            xs = [k * BIN_S for k in range(n)]
            for t in tenants:
                bins = [0] * n
                for r in run.records:
                    if r["tenant"] == t and r["outcome"] == "rejected":
                        bins[min(int(r["t_send"] / BIN_S), n - 1)] += 1
                ax.step(xs + [n * BIN_S], bins + bins[-1:], where="post", color=col[t], label=f"{t} ({sum(bins)})")
            _label_panel(ax, f"policy: {run.policy}", "time (s since start)", fontsize=8, loc="upper left")


def _all_tenants(runs: list[Run]) -> list[str]:
    out: list[str] = []
    for r in runs:
        for t in r.tenants:
            if t not in out:
                out.append(t)
    return out


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------

_s = cell


def _ms(x) -> str:
    return cell(None if x is None else x * 1000.0, 0)


def _locust_row(run: Run, rtype: str, tenant: str) -> dict | None:
    for row in run.locust_stats:
        if row.get("Type") == rtype and row.get("Name") == tenant:
            return row
    return None


def write_report(out_dir: Path, runs: list[Run], campaign, focus: str | None = None) -> dict:
    """Write report.md, summary.json and the plots into `out_dir`; return the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {run.policy: summarize(run) for run in runs}
    plot_ttft(runs, out_dir / "ttft.png", focus)
    plot_service(runs, out_dir / "service.png")
    plot_rejections(runs, out_dir / "rejections.png")

    comparison = None
    pols = [r.policy for r in runs]
    if focus and "fcfs" in summaries and "vtc" in summaries:
        f = summaries["fcfs"]["tenants"].get(focus, {}).get("ttft_p99_s")
        v = summaries["vtc"]["tenants"].get(focus, {}).get("ttft_p99_s")
        comparison = {"tenant": focus, "ttft_p99_fcfs_s": f, "ttft_p99_vtc_s": v,
                      "ratio_fcfs_over_vtc": (f / v) if f and v else None,
                      "overtaken_mean_fcfs": summaries["fcfs"]["tenants"].get(focus, {}).get("overtaken_mean"),
                      "overtaken_mean_vtc": summaries["vtc"]["tenants"].get(focus, {}).get("overtaken_mean")}

    first = runs[0]
    setup = first.setup
    L: list[str] = []
    L.append(f"# Load-test campaign `{campaign.name}`: {' vs '.join(p.upper() for p in pols)}")
    L.append("")
    L.append(campaign.description + ".")
    if campaign.notes:
        L.append("")
        L.append(campaign.notes)
    L.append("")
    L.append("## Setup")
    L.append("")
    for run in runs:
        L.append(f"- {run.policy}: {run.setup.get('target', '?')}; worker figures from "
                 f"{run.worker_source or 'none (client-side estimate from usage)'}")
    L.append(f"- model: `{first.data.get('model')}`; worker running-batch limit: {setup.get('max_running', '?')}")
    L.append(f"- workload: {first.data.get('workload')} (seed {first.data.get('seed')}, "
             f"rate scale {first.data.get('rate_scale')}, length scale {first.data.get('length_scale', 1.0)}, "
             f"{first.data.get('duration_s'):g} s per policy)")
    def tenant_line(t: str) -> str:
        lim = setup.get("limits", {}).get(t)
        return (f"`{t}` weight {first.data.get('weights', {}).get(t, 1.0):g}, "
                f"{first.data.get('users', {}).get(t)} users" + (f", limits {lim}" if lim else ""))

    L.append("- tenants: " + "; ".join(tenant_line(t) for t in first.tenants))
    L.append(f"- service unit (worker's cost function): c = α·P + β·O with α = {ALPHA:g}, β = {BETA:g} "
             "(the worker's defaults; P prompt tokens computed, O output tokens; prompt tokens served from the "
             "prefix cache at the worker's --cached-rate·α, default 0, while the client-side estimates below count "
             "every prompt token at α)")
    L.append("- users replay each tenant's requests open-loop (arrival times from the workload); a request sent "
             "more than 1 s after its arrival time counts as late; TTFT = request sent → first content chunk, "
             "ITL = gap between content chunks, both on the client")
    L.append("")
    if comparison:
        L.append("## Result")
        L.append("")
        f, v, ratio = comparison["ttft_p99_fcfs_s"], comparison["ttft_p99_vtc_s"], comparison["ratio_fcfs_over_vtc"]
        L.append(f"p99 TTFT of `{focus}`: **FCFS {_s(f)} s, VTC {_s(v)} s**"
                 + (f" ({ratio:.1f}× lower under VTC)." if ratio and ratio >= 1 else
                    f" (ratio FCFS/VTC {_s(ratio)})."))
        L.append("")
        of, ov = comparison["overtaken_mean_fcfs"], comparison["overtaken_mean_vtc"]
        L.append(f"Other tenants' requests that got their first token while a `{focus}` request waited for its "
                 f"own (mean per request): **FCFS {_s(of, 1)}, VTC {_s(ov, 1)}** (an order count: what the "
                 "scheduler did, whatever the machine's speed).")
        L.append("")
    L.append("## Per tenant")
    L.append("")
    L.append("| policy | tenant | sent | unsent | ok | 429 | errors | cut | late | TTFT p50 (ms) | TTFT p99 (ms) | "
             "TTFT max (ms) | ITL p50 (ms) | ITL p99 (ms) | E2E p50 (s) | output tok/s | service units/s | "
             "service share |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        for t, s in summaries[run.policy]["tenants"].items():
            share = s["worker_service_share"]
            L.append(f"| {run.policy} | {t} | {s['sent']} | {s['unsent']} | {s['ok']} | {s['rejected_429']} | "
                     f"{s['errors']} | {s['cut']} | {s['late_over_1s']} | {_ms(s['ttft_p50_s'])} | "
                     f"{_ms(s['ttft_p99_s'])} | "
                     f"{_ms(s['ttft_max_s'])} | {_ms(s['itl_p50_s'])} | {_ms(s['itl_p99_s'])} | "
                     f"{_s(s['e2e_p50_s'])} | {_s(s['output_tok_per_s'], 1)} | {_s(s['worker_service_rate'], 1)} | "
                     f"{'–' if share is None else f'{share:.1%}'} |")
    L.append("")
    L.append("*unsent*: scheduled requests never sent because all of the tenant's users were busy (a tenant "
             "asking for more than it gets); *late*: sent more than 1 s after their arrival time. "
             "*cut*: still running when the run ended (its connection closed). TTFT percentiles include, as "
             "lower bounds, the wait so far of requests that had no first token by the end "
             "(" + ", ".join(f"{r.policy}: {sum(s['waiting_at_end'] for s in summaries[r.policy]['tenants'].values())}"
                              for r in runs) + "). *service*: the worker's charged service over the run.")
    L.append("")
    L.append("## Plots")
    L.append("")
    L.append("![TTFT per tenant over time](ttft.png)")
    L.append("")
    L.append("![Service rate per tenant](service.png)")
    L.append("")
    L.append("![429s per tenant](rejections.png)")
    L.append("")
    if any(r.locust_stats for r in runs):
        L.append("## Locust's own statistics (event hooks)")
        L.append("")
        L.append("Locust rounds its percentiles; its CSV may lag the records by a few requests.")
        L.append("")
        L.append("| policy | tenant | chat requests | chat failures | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | "
                 "ITL p99 (ms) |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|")
        for run in runs:
            for t in run.tenants:
                chat, tt, it = (_locust_row(run, k, t) for k in ("chat", "TTFT", "ITL"))
                g = lambda row, k: (row or {}).get(k, "–") or "–"  # noqa: E731
                L.append(f"| {run.policy} | {t} | {g(chat, 'Request Count')} | {g(chat, 'Failure Count')} | "
                         f"{g(tt, '50%')} | {g(tt, '99%')} | {g(it, '50%')} | {g(it, '99%')} |")
        L.append("")
    L.append("Files: `summary.json` (every figure above), `<policy>/records.json` (every request), "
             "`<policy>/worker_samples.json`, `<policy>/locust_stats.csv`, `<policy>/locust.log`.")
    L.append("")
    (out_dir / "report.md").write_text("\n".join(L))

    summary = {"campaign": campaign.name, "policies": pols, "focus": focus, "comparison": comparison,
               "runs": summaries, "setup": setup}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
