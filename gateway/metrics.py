"""Prometheus metrics of one gateway app (its own registry, so several apps can live in one process).

Tenant labels are bounded: they are ids of configured tenants (the only ones a key can authenticate
as), or ``unknown`` for requests refused before authentication succeeded. API keys never appear in a
label. docs/observability.md lists every series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ADMISSION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

UNKNOWN_TENANT = "unknown"  # label of requests that did not authenticate


class GatewayMetrics:
    """Counters and histograms exposed on ``/metrics``. Durations in seconds, sizes in tokens."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fairshare_gateway_requests", "HTTP requests answered",
                                ["tenant", "endpoint", "status"], registry=r)
        self.rejections = Counter("fairshare_gateway_admission_rejections", "Requests refused by admission",
                                  ["tenant", "reason"], registry=r)
        self.tokens = Counter("fairshare_gateway_tokens", "Tokens used by finished requests",
                              ["tenant", "model", "kind"], registry=r)
        self.latency = Histogram("fairshare_gateway_request_seconds", "Request latency (to last byte)",
                                 ["tenant", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("fairshare_gateway_ttft_seconds", "Time to the first token seen by the gateway",
                              ["tenant", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("fairshare_gateway_inflight_requests", "Admitted requests not yet finished",
                              ["tenant"], registry=r)
        self.worker_up = Gauge("fairshare_gateway_worker_up", "1 when the worker is SERVING and agrees on the "
                               "tokenizer", ["worker"], registry=r)
        self.gateway_replicas = Gauge("fairshare_gateway_replicas", "Gateway replicas alive (registered in Redis) "
                                      "as last seen, floored at --replicas: what degraded buckets divide by",
                                      registry=r)
        self.routing_spills = Counter("fairshare_gateway_routing_spills", "Requests the fair routing policy sent "
                                      "beyond their prefix-affine worker because their tenant queued there "
                                      "(to spare capacity, or to where its pool-wide counter is first in line)", ["tenant"], registry=r)
        self.worker_retries = Counter("fairshare_gateway_worker_retries", "Generations retried on another worker "
                                      "after failing before the first token", ["worker"], registry=r)
        self.hand_backs = Counter("fairshare_gateway_hand_backs", "Requests a worker handed back before their first "
                                  "token (queued there with no room) and the gateway routed to another worker",
                                  ["worker"], registry=r)
        self.disconnects = Counter("fairshare_gateway_client_disconnects", "Clients that went away before the end",
                                   ["tenant"], registry=r)
        self.redis_errors = Counter("fairshare_gateway_redis_errors", "Redis calls that failed", registry=r)
        self.rate_limited = Counter("fairshare_gateway_rate_limited", "Requests answered 429, by the limit that "
                                    "refused them (requests, tokens, inflight_tokens, concurrent_requests)",
                                    ["tenant", "reason"], registry=r)
        self.admission_latency = Histogram("fairshare_gateway_admission_seconds", "Duration of the admission "
                                           "call (one Redis round trip), by outcome (admitted, rejected, error)",
                                           ["tenant", "outcome"], buckets=_ADMISSION_BUCKETS, registry=r)
        self.redis_up = Gauge("fairshare_gateway_redis_up", "1 while admission runs on Redis, 0 during an outage "
                              "(requests then follow their tier's outage policy)", registry=r)
        self.degraded_admissions = Counter("fairshare_gateway_degraded_admissions", "Requests admitted by this "
                                           "replica's local buckets while Redis was unreachable", ["tenant"],
                                           registry=r)
        self.leases_reinstated = Counter("fairshare_gateway_leases_reinstated", "Leases of running requests that "
                                         "Redis had lost (restart, expiry during an outage) and that were re-created",
                                         registry=r)
        self.leases_moved = Counter("fairshare_gateway_leases_moved", "Leases held locally during a Redis outage "
                                    "and moved into Redis when it returned", registry=r)
        self.inflight_tokens = Gauge("fairshare_gateway_inflight_tokens", "Tokens reserved by this gateway's "
                                     "admitted, unfinished requests (prompt + n * max_tokens)", ["tenant"],
                                     registry=r)

    def track(self, directory=None, rates=None) -> None:
        """Also export, read at scrape time, each configured tenant's weight and tier (`directory`: a
        `gateway.auth.TenantDirectory`) and the measured per-stream output rate of each model (`rates`:
        a `gateway.progress.OutputRates`). `fairshare top` reads both. Calling it again re-targets
        the same collector (an app whose lifespan runs twice does not register it twice)."""
        if getattr(self, "_config", None) is None:
            self._config = _ConfigCollector(directory, rates)
            self.registry.register(self._config)
        self._config.directory, self._config.rates = directory, rates

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)


class _ConfigCollector:
    """``fairshare_gateway_tenant_weight{tenant,tier}`` and ``fairshare_gateway_output_tokens_per_second{model}``."""

    def __init__(self, directory, rates) -> None:
        self.directory, self.rates = directory, rates

    def describe(self):
        return []  # collected lazily

    def collect(self):
        if self.directory is not None:
            fam = GaugeMetricFamily("fairshare_gateway_tenant_weight", "Configured weight of each tenant (label: its "
                                    "tier), from the tenants file in force", labels=["tenant", "tier"])
            for t in self.directory.tenants().values():
                fam.add_metric([t.id, t.tier.value], float(t.weight))
            yield fam
        if self.rates is not None:
            fam = GaugeMetricFamily("fairshare_gateway_output_tokens_per_second", "Measured output rate of one "
                                    "stream (tokens/s, moving mean over finished requests), per model; the basis "
                                    "of the retry hints of concurrency and in-flight 429s", labels=["model"])
            for model, r in sorted(self.rates.rates().items()):
                fam.add_metric([model], r)
            yield fam
