"""Prometheus metrics of a worker, served over HTTP by `fairshare worker --metrics-port N`.

Two sources:

- `EngineCollector` reads `Engine.snapshot()` at scrape time (no engine changes, no per-step cost):
  scheduler and KV-pool load; per tier (interactive, batch, background) the charged service, its
  share, the minimum share, the deficit, blocked iterations, queue lengths and preemptions; per
  tenant the charged service, the VTC virtual counter, queue lengths, KV blocks, tokens, finished
  requests and preemptions; preemptions by reason (out-of-blocks, reclaim, tier, returning); with
  KV quotas on (``--kv-quota``), per tenant the soft quota and hard cap in blocks, whether it is
  over its soft quota, and the iterations it waited on its quota.
- `WorkerMetrics.observe_*`, called by the gRPC servicer as outputs stream: per-tenant TTFT, ITL and
  queue-time histograms, finished requests by reason, prompt and cached prompt tokens (cache hits);
  calls refused as UNAUTHENTICATED, by reason (fairshare/worker_auth.py).
- `FaultCollector`: engine faults (steps that raised, each failing its batch) and whether repeated
  faults failed the engine (worker/faults.py), for both the reference and the SGLang worker.

Tenant labels are bounded: the worker does not know the tenant list, so the first ``max_tenants``
distinct tenant ids it sees keep their own label and every later one is reported as ``other``
(summed; the virtual counter and weight, which do not add up, are not reported for ``other``).
docs/observability.md lists every series. This module does not import torch.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fairshare.worker_auth import REASONS as AUTH_REASONS

log = logging.getLogger("fairshare.worker")

OTHER_TENANT = "other"
DEFAULT_MAX_TENANTS = 64

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5)


class TenantLabels:
    """Maps tenant ids to a bounded set of label values (thread-safe).

    The first `max_tenants` distinct ids are their own label; later ones map to ``other``.
    """

    def __init__(self, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if max_tenants < 0:
            raise ValueError("max_tenants must be >= 0")
        self.max_tenants = max_tenants
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant_id: str) -> str:
        if tenant_id in self._known:
            return tenant_id
        with self._lock:
            if tenant_id in self._known:
                return tenant_id
            if len(self._known) < self.max_tenants and tenant_id != OTHER_TENANT:
                self._known.add(tenant_id)
                return tenant_id
        return OTHER_TENANT


# per-tenant snapshot fields: (metric name, help, kind, snapshot key)
_TENANT_FIELDS = (
    ("fairshare_worker_tenant_charged_service_units", "Unweighted service units charged to the tenant "
     "(alpha * prompt tokens computed + beta * output tokens, or the configured cost)", "counter", "charged_service"),
    ("fairshare_worker_tenant_prompt_tokens_computed", "Prompt tokens computed by prefill (cached ones excluded)",
     "counter", "prompt_tokens"),
    ("fairshare_worker_tenant_output_tokens", "Output tokens committed", "counter", "output_tokens"),
    ("fairshare_worker_tenant_finished_requests", "Requests finished (any reason)", "counter", "finished"),
    ("fairshare_worker_tenant_preemptions", "Preemptions (recompute) of the tenant's requests", "counter",
     "preemptions"),
    ("fairshare_worker_tenant_waiting_requests", "Requests waiting to be scheduled (queue length)", "gauge",
     "waiting"),
    ("fairshare_worker_tenant_running_requests", "Requests admitted to the running batch", "gauge", "running"),
    ("fairshare_worker_tenant_kv_blocks", "KV-cache blocks held by the tenant's requests", "gauge", "kv_blocks"),
    ("fairshare_worker_tenant_quota_waits", "Iterations the tenant's head request waited on its KV quota "
     "(0 without KV quotas)", "counter", "quota_waits"),
    ("fairshare_worker_tenant_prefix_cache_blocks", "KV blocks the radix prefix cache holds in the tenant's "
     "namespaces (its cache footprint, evictable blocks included)", "gauge", "cache_blocks"),
    ("fairshare_worker_tenant_prefix_cache_hit_tokens", "Prompt tokens served from the tenant's prefix cache "
     "(counted at admission)", "counter", "cached_prompt_tokens"),
)
# KV quotas (only while the worker runs with --kv-quota); not additive: named tenants only
_TENANT_QUOTA_LEVELS = (
    ("fairshare_worker_tenant_kv_soft_quota_blocks", "The tenant's soft KV quota, blocks", "kv_soft_quota_blocks"),
    ("fairshare_worker_tenant_kv_hard_cap_blocks", "The tenant's KV hard cap, blocks", "kv_hard_cap_blocks"),
    ("fairshare_worker_tenant_kv_over_quota", "1 while the tenant holds more KV blocks than its soft quota",
     "kv_over_quota"),
)
# not additive: reported for named tenants only
_TENANT_LEVELS = (
    ("fairshare_worker_tenant_virtual_counter", "VTC virtual counter: weighted service units", "virtual_counter"),
    ("fairshare_worker_tenant_weight", "Tenant weight as last sent by the gateway", "weight"),
)


class EngineCollector:
    """Collects the engine's load and per-tenant counters from `engine.snapshot()` at scrape time."""

    def __init__(self, engine, labels: TenantLabels, draining: Callable[[], bool] = lambda: False) -> None:
        self.engine = engine
        self.labels = labels
        self.draining = draining

    def describe(self):
        return []  # collected lazily; do not call snapshot() at registration

    def collect(self):
        try:
            snap = self.engine.snapshot()
        except Exception:  # a scrape must never take the worker down
            log.exception("engine snapshot failed during a metrics scrape")
            return
        g = GaugeMetricFamily
        yield g("fairshare_worker_waiting_requests", "Requests waiting to be scheduled", value=snap["waiting"])
        yield g("fairshare_worker_running_requests", "Requests in the running batch", value=snap["running"])
        yield g("fairshare_worker_kv_blocks_used", "KV-cache blocks in use", value=snap["kv_blocks_used"])
        yield g("fairshare_worker_kv_blocks_total", "KV-cache blocks in the pool", value=snap["kv_blocks_total"])
        yield g("fairshare_worker_kv_block_size_tokens", "Tokens per KV-cache block", value=snap["kv_block_size"])
        yield g("fairshare_worker_inflight_tokens", "Prompt + max_tokens not yet done, over live requests",
                value=snap["inflight_tokens"])
        yield g("fairshare_worker_draining", "1 while the worker drains (SIGTERM)", value=1 if self.draining() else 0)
        yield CounterMetricFamily("fairshare_worker_iterations", "Engine iterations run", value=snap["iterations"])
        info = g("fairshare_worker_policy_info", "The scheduling policy (value 1)", labels=["policy"])
        info.add_metric([str(snap["policy"])], 1)
        yield info
        quota_on = bool(snap.get("kv_quota"))
        yield g("fairshare_worker_kv_quota_enabled", "1 when per-tenant KV quotas are on (--kv-quota)",
                value=1 if quota_on else 0)
        preempt = CounterMetricFamily("fairshare_worker_preemptions", "Preemptions (recompute), by reason: "
                                      "out-of-blocks (a decode or a stalled prefill found no free block), "
                                      "reclaim (KV quotas: made room for a within-quota tenant), tier (made room "
                                      "for a higher tier's request) or returning (a returning tenant's slot share)",
                                      labels=["reason"])
        by_reason = snap.get("preemptions_by_reason")
        if by_reason is None:  # an engine that reports only the totals
            reclaim = snap.get("reclaim_preemptions", 0)
            returning = snap.get("returning_preemptions")
            by_reason = {"out-of-blocks": max(0, snap.get("preemptions", 0) - reclaim - (returning or 0)),
                         "reclaim": reclaim}
            if returning is not None:
                by_reason["returning"] = returning
        for reason, n in by_reason.items():
            preempt.add_metric([reason], n)
        yield preempt
        yield from _tier_families(snap.get("tiers", {}))
        yield g("fairshare_worker_prefix_cache_blocks", "KV blocks held by the radix prefix cache (evictable "
                "ones included)", value=snap.get("cache_blocks", 0))
        yield g("fairshare_worker_prefix_cache_public_blocks", "Of those, blocks of operator-listed public "
                "prefixes", value=snap.get("cache_public_blocks", 0))
        yield CounterMetricFamily("fairshare_worker_prefix_cache_hit_tokens", "Prompt tokens served from the "
                                  "prefix cache", value=snap.get("cache_hit_tokens", 0))
        yield CounterMetricFamily("fairshare_worker_prefix_cache_lookup_tokens", "Prompt tokens looked up in the "
                                  "prefix cache", value=snap.get("cache_lookup_tokens", 0))

        sums: dict[str, dict[str, float]] = {}
        levels: dict[str, dict[str, float]] = {}
        for t in snap["tenants"]:
            label = self.labels(t["tenant_id"])
            acc = sums.setdefault(label, {})
            for _, _, _, key in _TENANT_FIELDS:
                acc[key] = acc.get(key, 0) + t.get(key, 0)
            if label != OTHER_TENANT:
                levels[label] = {key: t.get(key, 0) for _, _, key in _TENANT_LEVELS + _TENANT_QUOTA_LEVELS}
        for name, doc, kind, key in _TENANT_FIELDS:
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["tenant"])
            for label, acc in sums.items():
                fam.add_metric([label], acc[key])
            yield fam
        for name, doc, key in _TENANT_LEVELS + (_TENANT_QUOTA_LEVELS if quota_on else ()):
            fam = GaugeMetricFamily(name, doc, labels=["tenant"])
            for label, vals in levels.items():
                fam.add_metric([label], float(vals[key]))
            yield fam


class FaultCollector:
    """``fairshare_worker_engine_faults_total`` and ``fairshare_worker_engine_failed`` from a
    `worker.faults.FaultWindow`, read at scrape time."""

    def __init__(self, faults) -> None:
        self.faults = faults

    def describe(self):
        return []

    def collect(self):
        yield CounterMetricFamily("fairshare_worker_engine_faults", "Engine steps (or scheduler calls) that "
                                  "raised; each failed the requests of its batch", value=self.faults.total)
        yield GaugeMetricFamily("fairshare_worker_engine_failed", "1 once repeated engine faults failed the "
                                "engine: health NOT_SERVING until the process restarts",
                                value=1 if self.faults.tripped else 0)


# per-tier snapshot fields (worker/scheduling/core.py, SchedulingCore.tier_snapshot)
_TIER_FIELDS = (
    ("fairshare_worker_tier_charged_service_units", "Service units charged to the tier's tenants", "counter",
     "service"),
    ("fairshare_worker_tier_service_share", "The tier's share of all service charged so far", "gauge",
     "service_share"),
    ("fairshare_worker_tier_min_share", "The tier's configured minimum share of service (0 for interactive)",
     "gauge", "min_share"),
    ("fairshare_worker_tier_deficit_units", "Service units the tier is owed now (> 0: served before higher tiers)",
     "gauge", "deficit"),
    ("fairshare_worker_tier_blocked_iterations", "Iterations the tier was owed service but nothing of it could be "
     "served (no free slot or KV room)", "counter", "blocked_iterations"),
    ("fairshare_worker_tier_waiting_requests", "Requests of the tier waiting to be scheduled", "gauge", "waiting"),
    ("fairshare_worker_tier_running_requests", "Requests of the tier in the running batch", "gauge", "running"),
    ("fairshare_worker_tier_preemptions", "Preemptions (recompute) of the tier's requests", "counter",
     "preemptions"),
)


def _tier_families(tiers: dict):
    """Metric families with a `tier` label from the engine snapshot's `tiers` table."""
    for name, doc, kind, key in _TIER_FIELDS:
        fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["tier"])
        for tier, row in tiers.items():
            fam.add_metric([tier], float(row.get(key, 0)))
        yield fam


class WorkerMetrics:
    """A worker's registry: the engine collector plus histograms and counters fed by the servicer.

    engine: the `Engine` (or None: servicer metrics only). draining: () -> bool. faults: the
    `FaultWindow` to export (default: the engine's, if it has one).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine=None, *, max_tenants: int = DEFAULT_MAX_TENANTS,
                 draining: Callable[[], bool] = lambda: False, faults=None) -> None:
        self.registry = CollectorRegistry()
        self.labels = TenantLabels(max_tenants)
        self.draining = draining
        r = self.registry
        self.ttft = Histogram("fairshare_worker_ttft_seconds", "Arrival at the worker -> first output token",
                              ["tenant"], buckets=_TTFT_BUCKETS, registry=r)
        self.queue = Histogram("fairshare_worker_queue_seconds", "Arrival at the worker -> first scheduled",
                               ["tenant"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("fairshare_worker_itl_seconds", "Inter-token latency (time between output tokens)",
                             ["tenant"], buckets=_ITL_BUCKETS, registry=r)
        self.requests = Counter("fairshare_worker_requests", "Generate calls finished, by finish reason "
                                "(stop, length, abort, cancelled, error, rejected)", ["tenant", "finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("fairshare_worker_prompt_tokens", "Prompt tokens of finished requests "
                                     "(cached ones included)", ["tenant"], registry=r)
        self.cached_prompt_tokens = Counter("fairshare_worker_cached_prompt_tokens", "Prompt tokens served from "
                                            "the tenant's prefix cache", ["tenant"], registry=r)
        self.cache_hits = Counter("fairshare_worker_cache_hit_requests", "Finished requests that reused at least "
                                  "one cached prompt token", ["tenant"], registry=r)
        self.auth_failures = Counter("fairshare_worker_auth_failures", "Generate/Abort calls refused with "
                                     "UNAUTHENTICATED (not signed by the gateway), by reason: missing, malformed, "
                                     "unknown_key, bad_signature, expired, replayed", ["reason"], registry=r)
        for reason in AUTH_REASONS:
            self.auth_failures.labels(reason)  # every reason exported from the start (0)
        if engine is not None:
            r.register(EngineCollector(engine, self.labels, lambda: self.draining()))
        faults = faults if faults is not None else getattr(engine, "faults", None)
        if faults is not None:
            r.register(FaultCollector(faults))
        self._server = None
        self._thread = None

    # -- servicer hooks -------------------------------------------------------------------------
    def observe_first_token(self, tenant_id: str, queued_s: float | None, first_token_s: float) -> None:
        """The request's first output token: its queue time and TTFT at the worker, in seconds."""
        label = self.labels(tenant_id)
        if queued_s is not None:
            self.queue.labels(label).observe(queued_s)
        self.ttft.labels(label).observe(first_token_s)

    def observe_itl(self, tenant_id: str, gap_s: float, tokens: int) -> None:
        """`tokens` output tokens that arrived `gap_s` seconds after the previous ones (one ITL sample
        each, the gap shared evenly)."""
        if tokens <= 0:
            return
        h = self.itl.labels(self.labels(tenant_id))
        for _ in range(tokens):
            h.observe(gap_s / tokens)

    def observe_finish(self, tenant_id: str, reason: str, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        """A Generate call ended: `reason` and, when it ran, its prompt and cached prompt tokens."""
        label = self.labels(tenant_id)
        self.requests.labels(label, reason).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(label).inc(prompt_tokens)
        if cached_tokens:
            self.cached_prompt_tokens.labels(label).inc(cached_tokens)
            self.cache_hits.labels(label).inc()

    def observe_auth_failure(self, reason: str) -> None:
        """A call refused as UNAUTHENTICATED (`reason`: one of fairshare.worker_auth.REASONS)."""
        self.auth_failures.labels(reason).inc()

    # -- exposition -----------------------------------------------------------------------------
    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on host:port in a daemon thread; returns the bound port.
        Raises OSError when the port cannot be bound."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def stop(self) -> None:
        """Stop the HTTP server (if serving)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["DEFAULT_MAX_TENANTS", "EngineCollector", "FaultCollector", "OTHER_TENANT", "TenantLabels", "WorkerMetrics"]
