"""The pool board: per-tenant service every worker publishes to Redis, read by the other workers
(pool-wide fair counters, `worker.scheduling.pool`) and by the gateways (the ``fair`` routing
policy, `gateway.routing_policy`). Shared by both tiers: no grpc, no torch, no fastapi.

Layout (one Redis hash slot, so Redis Cluster works): ``<prefix>:{pool}:board`` maps a worker id to
its latest `WorkerReport` (JSON), ``<prefix>:{pool}:seen`` maps it to the Redis time (ms) it was
written. `SYNC_SCRIPT` writes a report (or nothing, for a reader) and returns every *other* fresh
report with its age, in one round trip; reports older than the stale limit are deleted by whoever
reads them (a worker that died leaves the board within that time).

A report carries, per tenant: charged service units on that worker (cumulative since the worker
started: `epoch` changes when it restarts), weight, tier, whether it is backlogged there (queued
work or prefill left), the pool-wide virtual counter that worker orders it by and how many of its
requests run there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

STALE_MS = 5000  # a report older than this is dropped (its worker is gone)


def board_keys(prefix: str) -> list[str]:
    """``[board, seen]`` keys (hash-tagged ``{pool}``)."""
    return [f"{prefix}:{{pool}}:board", f"{prefix}:{{pool}}:seen"]


# KEYS: board, seen. ARGV: worker id ('' for a reader), report JSON ('' for a reader), stale ms.
# Returns a flat list: worker id, report JSON, age ms, ... for every other fresh report.
SYNC_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[1], now)
end
local seen = redis.call('HGETALL', KEYS[2])
local out = {}
for i = 1, #seen, 2 do
  local w, at = seen[i], tonumber(seen[i + 1])
  if now - at > tonumber(ARGV[3]) then
    redis.call('HDEL', KEYS[1], w)
    redis.call('HDEL', KEYS[2], w)
  elseif w ~= ARGV[1] then
    local r = redis.call('HGET', KEYS[1], w)
    if r then
      table.insert(out, w)
      table.insert(out, r)
      table.insert(out, now - at)
    end
  end
end
return out
"""


@dataclass
class TenantReport:
    """One tenant on one worker. charged: service units charged there since the worker started.
    counter: the pool-wide virtual counter that worker orders the tenant by (weighted units).
    running: its requests running there. lift: the part of its counter VTC's lifts added (workers
    take the largest any of them reports: the counters then agree across the pool)."""

    charged: float
    weight: float = 1.0
    tier: str = "interactive"
    backlogged: bool = False
    counter: float = 0.0
    running: int = 0
    lift: float = 0.0


@dataclass
class WorkerReport:
    """What one worker publishes. epoch: changes when the worker restarts (its counters restart at
    0). age_s: how old the report was when read (set by `decode_sync`)."""

    worker_id: str
    epoch: str
    tenants: dict[str, TenantReport] = field(default_factory=dict)
    age_s: float = 0.0

    def encode(self) -> str:
        """The JSON written to the board."""
        return json.dumps({"epoch": self.epoch, "tenants": {
            t: [r.charged, r.weight, r.tier, int(r.backlogged), r.counter, r.running, r.lift]
            for t, r in self.tenants.items()}},
            separators=(",", ":"))

    @classmethod
    def decode(cls, worker_id: str, text: str | bytes, age_s: float = 0.0) -> "WorkerReport":
        """Parse a report. Raises ValueError when it is not one."""
        try:
            data = json.loads(text)
            tenants = {str(t): TenantReport(float(v[0]), float(v[1]), str(v[2]), bool(v[3]), float(v[4]),
                                            int(v[5]) if len(v) > 5 else 0, float(v[6]) if len(v) > 6 else 0.0)
                       for t, v in data["tenants"].items()}
            return cls(worker_id, str(data["epoch"]), tenants, age_s)
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise ValueError(f"not a pool report: {e}") from None


def decode_sync(reply) -> list[WorkerReport]:
    """`SYNC_SCRIPT`'s reply -> reports (a malformed one is skipped)."""
    out = []
    items = list(reply or [])
    for i in range(0, len(items) - 2, 3):
        wid = items[i].decode() if isinstance(items[i], bytes) else str(items[i])
        try:
            out.append(WorkerReport.decode(wid, items[i + 1], float(items[i + 2]) / 1000.0))
        except ValueError:
            continue
    return out


__all__ = ["STALE_MS", "SYNC_SCRIPT", "TenantReport", "WorkerReport", "board_keys", "decode_sync"]
