"""Which worker a request goes to: the routing policies, pure and framework-free.

Imports nothing but the standard library (no grpc, no fastapi), so the live gateway
(`gateway.routing.WorkerPool`) and the pool simulator (`worker.sim.pool`) run the same code.

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
- ``fair``: ``prefix``, plus *spill* for tenants whose pool-wide share lags (`FairRouting`):
  workers publish, per tenant, the pool-wide virtual counter they order by, whether the tenant is
  backlogged there and how many of its requests run there (`PoolBoard`, fed from Redis in the
  gateway and from the simulated workers in the simulator). A contended tenant below its weighted
  share of the pool's running requests, or whose counter lags every active tenant of some worker by
  more than `spill_units`, is sent beyond its affine worker, to where it gains a slot or is first
  in line. This is the router half of FairShare's pool fairness (the worker half:
  `worker.scheduling.pool`); the structure follows D²LPM (Cao et al., "Locality-aware Fair
  Scheduling in LLM Serving", arXiv 2501.14312: locality-first dispatch that a fairness deficit
  overrides), with VTC counters and slot shares in place of its deficits (docs/fairness.md, "Fair
  shares over a pool").

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
    ids. cost: tokens it holds while in flight (prompt + max_tokens).
    """

    tenant_id: str
    namespace: str
    prompt: Sequence[int]
    cost: int
    tier: str = "interactive"


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
    """`PrefixAffinity` plus spill for tenants whose pool-wide share lags (module docstring).

    Two rules, both read from the workers' reports (`PoolBoard`), both only for a tenant that is
    backlogged somewhere or whose affine worker has queued work (so a lightly loaded pool keeps its
    affinity):

    - slot share (`slot_target`): the tenant runs fewer requests than its weighted share of the
      running requests of its tier across the pool; it goes to the worker where its local weighted
      share exceeds what it runs there by the most (at least one request): there the worker's
      returning-tenant rule (`worker.scheduling.returning`) gives it a slot at once, preempting an
      over-share tenant. This reacts at once, before any service difference builds up.
    - counter lag (`lag_target`): its pool-wide virtual counter is more than `spill_units` below the
      counter of every active (running or backlogged) same-tier tenant of some worker; it goes to
      the worker where that margin is largest: the pool-wide counters put it first there.

    board: a callable returning the current `PoolBoard`. spill_units: the counter margin (weighted
    service units, > 0). Raises ValueError on bad parameters.
    """

    name = "fair"

    def __init__(self, board=None, *, spill_units: float = 1024.0, **options) -> None:
        super().__init__(**options)
        if not spill_units > 0:
            raise ValueError("spill_units must be > 0")
        self.board = board or PoolBoard
        self.spill_units = float(spill_units)
        self.spills = 0
        self.on_spill = None  # callable(request): told of each spill (the gateway counts them per tenant)

    def _contended(self, board: PoolBoard, request: RouteRequest, candidates: Sequence[Candidate]) -> bool:
        """Whether spill may apply: the tenant is backlogged somewhere, or its affine worker has queued work."""
        if board.backlogged(request.tenant_id):
            return True
        home = super().choose(request, candidates)
        return any(x.backlogged for x in board.workers.get(home.route_id, {}).values())

    @staticmethod
    def _rivals(board: PoolBoard, worker_id: str, request: RouteRequest) -> dict[str, TenantOnWorker]:
        """Active same-tier tenants of a worker other than the request's."""
        return {tid: x for tid, x in board.workers.get(worker_id, {}).items()
                if tid != request.tenant_id and x.active and x.tier == request.tier}

    def slot_target(self, request: RouteRequest, candidates: Sequence[Candidate], board: PoolBoard | None = None):
        """The worker where the tenant gains the most running slots toward its pool-wide weighted
        share (class docstring), or None."""
        board = board if board is not None else self.board()
        me = request.tenant_id
        running: dict[str, int] = {}
        weights: dict[str, float] = {}
        for ts in board.workers.values():
            for tid, x in ts.items():
                if x.tier == request.tier and (x.active or tid == me):
                    running[tid] = running.get(tid, 0) + x.running
                    weights[tid] = x.weight
        if me not in weights:
            return None
        share = sum(running.values()) * weights[me] / sum(weights.values())
        if running[me] + 1 > share + 1e-9:
            return None  # it holds its share
        best, best_gain = None, 1.0 - 1e-9
        for c in candidates:
            rivals = self._rivals(board, c.route_id, request)
            if not rivals:
                continue  # an idle worker: the load bound already sends work there
            mine = board.workers.get(c.route_id, {}).get(me)
            here = mine.running if mine else 0
            n = sum(x.running for x in rivals.values()) + here
            gain = n * weights[me] / (weights[me] + sum(x.weight for x in rivals.values())) - here
            if gain > best_gain or (gain == best_gain and best is not None and c.load_score() < best.load_score()):
                best, best_gain = c, gain
        return best

    def lag_target(self, request: RouteRequest, candidates: Sequence[Candidate], board: PoolBoard | None = None):
        """The worker where every active same-tier tenant leads the request's tenant's pool-wide
        counter by the largest margin above `spill_units`, or None."""
        board = board if board is not None else self.board()
        mine = board.counter(request.tenant_id)
        if mine is None:
            return None
        best, best_margin = None, self.spill_units
        for c in candidates:
            rivals = self._rivals(board, c.route_id, request)
            if not rivals:
                continue
            margin = min(x.counter for x in rivals.values()) - mine
            if margin > best_margin or (margin == best_margin and best is not None
                                        and c.load_score() < best.load_score()):
                best, best_margin = c, margin
        return best

    def spill_target(self, request: RouteRequest, candidates: Sequence[Candidate]):
        """Where the request spills to (slot share first, then counter lag), or None: route by affinity."""
        board = self.board()
        if not board.workers or not self._contended(board, request, candidates):
            return None
        return self.slot_target(request, candidates, board) or self.lag_target(request, candidates, board)

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
                + f"; spill below the pool slot share or at a counter lag of {self.spill_units:g} units")


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
