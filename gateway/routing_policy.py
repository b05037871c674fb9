"""Which worker a request goes to: the routing policies, pure and framework-free.

Imports nothing but the standard library (no grpc, no fastapi), so the live gateway
(`gateway.routing.WorkerPool`) and the pool simulator (`loadtests.sim.pool`) run the same code.

Three policies (`--routing`):

- ``least-loaded``: the worker with the fewest in-flight tokens (prompt + max_tokens of the requests
  it holds); ties in turn (round robin).
- ``prefix``: tenant- and prefix-affine. A request's *route key* is its tenant's cache namespace
  plus the first `prefix_tokens` tokens of its prompt (`route_key`); the workers are ranked by
  rendezvous hashing of that key (highest random weight, Thaler & Ravishankar, "Using Name-Based
  Mappings to Increase Hit Rates", IEEE/ACM ToN 1998) and the request goes to the first one in that
  ranking whose load stays within a bound (consistent hashing with bounded loads, Mirrokni, Thorup
  & Zadimoghaddam, SODA 2018): ``load + cost <= max(load_factor * (total load + cost) / n, cost)
  + slack``.
  So every request of one namespace and prompt head lands on the same worker, which is the one
  whose radix cache holds that namespace's blocks (caches are per tenant namespace, so nothing is
  lost by keeping tenants apart); when that worker is over the bound the request goes to the
  key's next worker in the ranking (its second home, which then caches the prefix too), and when
  every ranked worker is over it, to the least-loaded one. Rendezvous hashing needs no shared
  state: every gateway replica ranks the same way, and adding or removing a worker moves only the
  keys whose first choice it is (or was). SGLang's model gateway (its cache-aware router) and
  llm-d's prefix scorer keep per-worker approximate prefix indexes instead; a hash is what stateless
  replicas can agree on without talking to each other.
- ``fair``: ``prefix``, plus *spill* for tenants that would queue at their affine worker while the
  pool could serve them sooner (`FairRouting`): workers publish, per tenant, the pool-wide virtual
  counter they order by and whether the tenant is backlogged there (`PoolBoard`, fed from Redis in
  the gateway and from the simulated workers in the simulator). From the first queued request on, a
  request of a tenant backlogged at its affine worker goes to a worker where nobody queues and that
  holds at least `slack_tokens` fewer in-flight tokens (spare capacity: a work-conserving pool must
  not keep free slots for the tenants homed there while another tenant queues); else, when its
  affine worker has a queue or it is backlogged somewhere, a request goes to a worker where its
  pool-wide counter is below every backlogged same-tier rival's by more than `spill_units` (first
  in line there). This is the router half of FairShare's pool fairness (the worker half:
  `worker.scheduling.pool`); the structure follows D²LPM (Cao et al., "Locality-aware Fair
  Scheduling in LLM Serving", arXiv 2501.14312: locality-first dispatch that a fairness deficit
  overrides, within a load bound), with VTC's pool-wide counters as the deficit (docs/fairness.md,
  "Fair shares over a pool").

Loads and costs are in tokens (prompt + max_tokens); counters in weighted service units.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

ROUTING_POLICIES = ("least-loaded", "prefix", "fair")


@dataclass(frozen=True)
class RouteRequest:
    """What routing knows of a request.

    tenant_id / tier: the authenticated tenant. namespace: whatever separates its prefix cache from
    others' (the gateway's per-tenant cache namespace plus the client's cache_salt). prompt: token
    ids. cost: tokens it holds while in flight (prompt + max_tokens). handed_back: times a worker
    handed it back before its first token (`worker.scheduling.handback`); the worker that did is
    left out of the candidates by the caller.
    """

    tenant_id: str
    namespace: str
    prompt: Sequence[int]
    cost: int
    tier: str = "interactive"
    handed_back: int = 0


class Candidate(Protocol):
    """A worker routing may choose: a stable identity and its load (in-flight tokens)."""

    @property
    def route_id(self) -> str: ...

    def load_score(self) -> float: ...


def route_key(namespace: str, prompt: Sequence[int], prefix_tokens: int) -> bytes:
    """The bytes rendezvous hashing ranks workers by: `namespace`, then the first `prefix_tokens`
    prompt tokens (all of them when the prompt is shorter). Raises ValueError for prefix_tokens < 0."""
    if prefix_tokens < 0:
        raise ValueError("prefix_tokens must be >= 0")
    head = ",".join(str(int(t)) for t in prompt[:prefix_tokens])
    return namespace.encode() + b"\x00" + head.encode()


def _weight(key: bytes, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x01" + worker_id.encode(), digest_size=8).digest(), "big")


def rendezvous_rank(key: bytes, worker_ids: Iterable[str]) -> list[str]:
    """Worker ids from the key's first choice to its last (highest random weight first; ties by id)."""
    return sorted(worker_ids, key=lambda w: (-_weight(key, w), w))


@dataclass
class TenantOnWorker:
    """One tenant as one worker last published it: its pool-wide virtual counter (weighted service
    units), whether it is backlogged there (queued work or prefill left), its tier and its requests
    running there."""

    counter: float
    backlogged: bool
    tier: str = "interactive"
    running: int = 0
    weight: float = 1.0

    @property
    def active(self) -> bool:
        """Backlogged or running there: it holds a share of that worker."""
        return self.backlogged or self.running > 0


@dataclass
class PoolBoard:
    """What workers last published (worker id -> tenant id -> `TenantOnWorker`). Empty: no pool
    counters (the `fair` policy then routes as `prefix`)."""

    workers: dict[str, dict[str, TenantOnWorker]] = field(default_factory=dict)

    @classmethod
    def from_reports(cls, reports) -> "PoolBoard":
        """A board from workers' reports (`fairshare.pool_board.WorkerReport`s: ``worker_id`` and
        ``tenants``, tenant id -> object with ``counter``, ``backlogged``, ``tier``)."""
        return cls({r.worker_id: {t: TenantOnWorker(x.counter, x.backlogged, x.tier, getattr(x, "running", 0),
                                                     getattr(x, "weight", 1.0))
                                  for t, x in r.tenants.items()} for r in reports})

    def counter(self, tenant_id: str) -> float | None:
        """The tenant's pool-wide counter: the largest any worker reports (the freshest view moves
        up only), or None when no worker knows the tenant."""
        vals = [ts[tenant_id].counter for ts in self.workers.values() if tenant_id in ts]
        return max(vals) if vals else None

    def backlogged(self, tenant_id: str) -> bool:
        """Whether some worker reports the tenant backlogged."""
        return any(ts[tenant_id].backlogged for ts in self.workers.values() if tenant_id in ts)


class RoutingPolicy:
    """Base class. `choose(request, candidates)` returns one of `candidates` (non-empty)."""

    name = "base"

    def __init__(self) -> None:
        self._rr = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]):
        """The worker for `request`. Raises ValueError when `candidates` is empty."""
        raise NotImplementedError

    def least_loaded(self, candidates: Sequence[Candidate]):
        """The candidate with the fewest in-flight tokens; ties in turn. Raises ValueError when empty."""
        if not candidates:
            raise ValueError("no candidate workers")
        best = min(c.load_score() for c in candidates)
        tied = [c for c in candidates if c.load_score() == best]
        return tied[next(self._rr) % len(tied)]

    def describe(self) -> str:
        """One line naming the policy and its parameters."""
        return self.name


class LeastLoaded(RoutingPolicy):
    """The worker with the fewest in-flight tokens (ties in turn)."""

    name = "least-loaded"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]):
        return self.least_loaded(candidates)


class PrefixAffinity(RoutingPolicy):
    """Rendezvous hashing of the route key with bounded loads (module docstring).

    prefix_tokens: prompt tokens in the route key (>= 0; 0: the namespace alone, i.e. tenant
    affinity). load_factor: c >= 1 of the bound. slack_tokens: tokens a worker may hold above the
    bound's average share (so that a lightly loaded pool keeps affinity). Raises ValueError on bad
    parameters.
    """

    name = "prefix"

    def __init__(self, prefix_tokens: int = 32, load_factor: float = 1.25, slack_tokens: int = 4096) -> None:
        super().__init__()
        if prefix_tokens < 0 or not load_factor >= 1.0 or slack_tokens < 0:
            raise ValueError("prefix_tokens >= 0, load_factor >= 1 and slack_tokens >= 0 are required")
        self.prefix_tokens = int(prefix_tokens)
        self.load_factor = float(load_factor)
        self.slack_tokens = int(slack_tokens)

    def bound(self, request: RouteRequest, candidates: Sequence[Candidate]) -> float:
        """Most tokens a worker may hold after taking `request` and still count as within the bound:
        ``max(load_factor * (total + cost) / n, cost) + slack`` (at least the request itself, as the
        ceiling in the bounded-loads capacity ``ceil(c * m / n)`` guarantees one item)."""
        total = sum(c.load_score() for c in candidates) + request.cost
        return max(self.load_factor * total / len(candidates), request.cost) + self.slack_tokens

    def ranked(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list:
        """`candidates` in the request's rendezvous order (its home first)."""
        by_id = {c.route_id: c for c in candidates}
        key = route_key(request.namespace, request.prompt, self.prefix_tokens)
        return [by_id[w] for w in rendezvous_rank(key, by_id)]

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]):
        if not candidates:
            raise ValueError("no candidate workers")
        limit = self.bound(request, candidates)
        for c in self.ranked(request, candidates):
            if c.load_score() + request.cost <= limit:
                return c
        return self.least_loaded(candidates)

    def describe(self) -> str:
        return (f"prefix (rendezvous hash of namespace + first {self.prefix_tokens} prompt tokens; load bound "
                f"{self.load_factor:g} x mean + {self.slack_tokens} tokens)")


class FairRouting(PrefixAffinity):
    """`PrefixAffinity` plus spill by pool-wide deficit (module docstring).

    Both rules read the workers' reports (`PoolBoard`) and apply only where somebody queues, so an
    uncontended pool keeps its affinity:

    - spare capacity (`spare_target`), for a tenant the board shows backlogged at the request's
      affine worker (its request would queue there behind its own): some worker has no backlogged
      same-tier tenant (no queue: it has free slots) and holds at least `slack_tokens` fewer
      in-flight tokens than the affine worker after taking the request; the request goes to the
      least-loaded such worker, where it starts at once. This acts from the first queued request, before any service difference builds
      up: without it a worker whose own tenants leave slots free serves them alone while a tenant
      queues elsewhere, and they run ahead of the pool (`slack_tokens` is the locality bound: as in
      `PrefixAffinity.bound`, affinity is kept unless it costs more imbalance than that).
    - first in line (`lag_target`), when the affine worker has a queue or the tenant is backlogged
      somewhere: on some other worker where the tenant is not backlogged, its pool-wide virtual
      counter is more than `spill_units` below the counter of every backlogged same-tier tenant; the
      request goes to the worker where that margin is largest: the pool-wide counters put it first in
      that worker's queue, ahead of the tenants that lead it (VTC's choice, made pool-wide; tenants
      that only run there do not compete for its next slot).

    board: a callable returning the current `PoolBoard`. spill_units: the counter margin (weighted
    service units, >= 0; 0: first in line by any margin). Raises ValueError on bad parameters.
    """

    name = "fair"

    def __init__(self, board=None, *, spill_units: float = 0.0, **options) -> None:
        super().__init__(**options)
        if not spill_units >= 0:
            raise ValueError("spill_units must be >= 0")
        self.board = board or PoolBoard
        self.spill_units = float(spill_units)
        self.spills = 0
        self.on_spill = None  # callable(request): told of each spill (the gateway counts them per tenant)

    @staticmethod
    def _queued(board: PoolBoard, worker_id: str, request: RouteRequest) -> dict[str, TenantOnWorker]:
        """Same-tier tenants backlogged on a worker (queued work or prefill left), the request's included."""
        return {tid: x for tid, x in board.workers.get(worker_id, {}).items()
                if x.backlogged and x.tier == request.tier}

    def spare_target(self, request: RouteRequest, candidates: Sequence[Candidate], home: Candidate,
                     board: PoolBoard | None = None):
        """The least-loaded worker with no backlogged same-tier tenant that holds more than
        `slack_tokens` fewer in-flight tokens than `home` after taking the request, or None."""
        board = board if board is not None else self.board()
        limit = home.load_score() - request.cost - self.slack_tokens
        spare = [c for c in candidates if c is not home and c.load_score() <= limit
                 and not self._queued(board, c.route_id, request)]
        return min(spare, key=lambda c: (c.load_score(), c.route_id)) if spare else None

    def lag_target(self, request: RouteRequest, candidates: Sequence[Candidate], board: PoolBoard | None = None):
        """The worker where the request's tenant is not backlogged and every backlogged same-tier
        tenant leads its pool-wide counter by the largest margin above `spill_units`, or None."""
        board = board if board is not None else self.board()
        mine = board.counter(request.tenant_id)
        if mine is None:
            return None
        best, best_margin = None, self.spill_units
        for c in candidates:
            queued = self._queued(board, c.route_id, request)
            if request.tenant_id in queued or not queued:
                continue  # it would queue behind its own requests there / nobody to be ahead of
            margin = min(x.counter for x in queued.values()) - mine
            if margin > best_margin or (margin == best_margin and best is not None
                                        and c.load_score() < best.load_score()):
                best, best_margin = c, margin
        return best

    def handed_back_target(self, request: RouteRequest, candidates: Sequence[Candidate], board: PoolBoard):
        """Where a handed-back request goes (the worker that handed it back is not among
        `candidates`): the least-loaded worker where nobody of its tier queues (it starts at once),
        else the worker where it is first in line (`lag_target`), else None (route as any request).
        The worker-side twin of this test is `worker.scheduling.pool.PoolCounters.room_elsewhere`:
        a worker hands back only when the board shows such a worker."""
        spare = [c for c in candidates if not self._queued(board, c.route_id, request)]
        if spare:
            return min(spare, key=lambda c: (c.load_score(), c.route_id))
        return self.lag_target(request, candidates, board)

    def spill_target(self, request: RouteRequest, candidates: Sequence[Candidate]):
        """Where the request spills to (spare capacity first, then first in line), or None: route by
        affinity."""
        board = self.board()
        if not board.workers:
            return None
        if request.handed_back:
            return self.handed_back_target(request, candidates, board)
        home = super().choose(request, candidates)
        queued = self._queued(board, home.route_id, request)
        if request.tenant_id in queued:
            target = self.spare_target(request, candidates, home, board)
            if target is not None:
                return target
        if queued or board.backlogged(request.tenant_id):
            target = self.lag_target(request, candidates, board)
            return None if target is home else target  # first in line at home: no spill
        return None

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]):
        target = self.spill_target(request, candidates)
        if target is not None:
            self.spills += 1
            if self.on_spill is not None:
                self.on_spill(request)
            return target
        return super().choose(request, candidates)

    def describe(self) -> str:
        return (super().describe().replace("prefix (", "fair (", 1)
                + f"; a tenant queued at home spills to spare capacity beyond {self.slack_tokens} tokens or to where "
                  f"it is first in line by more than {self.spill_units:g} units")


def make_routing(name: str, board=None, **options) -> RoutingPolicy:
    """A routing policy by name (`ROUTING_POLICIES`). options: `PrefixAffinity` / `FairRouting`
    parameters (None values are ignored). Raises ValueError for an unknown name or bad options."""
    options = {k: v for k, v in options.items() if v is not None}
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix":
        options.pop("spill_units", None)
        return PrefixAffinity(**options)
    if name == "fair":
        return FairRouting(board, **options)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTING_POLICIES)}")


__all__ = ["ROUTING_POLICIES", "Candidate", "FairRouting", "LeastLoaded", "PoolBoard", "PrefixAffinity",
           "RouteRequest", "RoutingPolicy", "TenantOnWorker", "make_routing", "rendezvous_rank", "route_key"]
