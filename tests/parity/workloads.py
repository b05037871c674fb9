"""Scripted workloads for executor parity: plain data, arrivals by iteration, lengths in tokens.

One definition drives both executors: the reference scheduler (`tests/parity/reference_driver.py`:
`worker/engine/scheduler.py` with a fake runner) and SGLang 0.5.23's own scheduler on CPU
(`tests/sglang/sglang_driver.py`). Unlike the simulator's workloads (`fairshare/workloads`: Poisson
arrivals in seconds, run against a time model), these are scripts on the iteration axis: request
`r` arrives at the start of iteration `r.arrival_iter`, so the two executors see the same arrivals
at the same step and any difference in what they admit is a scheduling difference, not a timing one.

The shapes follow the simulator's workloads of the same names (Sheng et al., OSDI 2024 §5.2 for
overload / weighted / on-off; `fairshare/workloads/memory.py` for memory-flood), scaled down to a
few hundred iterations of a small engine (`EngineShape`), plus a tiers workload (DESIGN.md "Priority
tiers": interactive > batch > background, each lower tier keeping a minimum share).

Prompt token ids are distinct per request (no prefix is shared, so the prefix caches change nothing)
unless `ScriptedRequest.prefix_group` names a group whose requests share their first
`prefix_tokens` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.scheduling.policy import TIERS


@dataclass(frozen=True)
class EngineShape:
    """The engine both executors are configured as.

    chunk_tokens: token budget of one iteration (reference `max_num_batched_tokens`; SGLang
    `chunked_prefill_size` and `max_prefill_tokens`). max_running: running requests at most
    (reference `max_running`; SGLang `max_running_requests`, the request-to-token pool's rows).
    kv_tokens: KV pool size in tokens (reference `num_kv_blocks · page_size`; SGLang's allocator
    size). page_size: tokens per KV block / page. max_context: longest prompt + output, tokens.
    """

    chunk_tokens: int = 256
    max_running: int = 8
    kv_tokens: int = 8192
    page_size: int = 1
    max_context: int = 2048

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // self.page_size


@dataclass(frozen=True)
class ScriptedTenant:
    """tenant_id, VTC weight (> 0) and tier (one of `worker.scheduling.policy.TIERS`)."""

    tenant_id: str
    weight: float = 1.0
    tier: str = "interactive"

    def __post_init__(self) -> None:
        if not self.weight > 0 or self.tier not in TIERS:
            raise ValueError(f"tenant {self.tenant_id!r}: weight must be > 0 and tier one of {TIERS}")


@dataclass(frozen=True)
class ScriptedRequest:
    """One request: arrives at the start of iteration `arrival_iter` (0-based), `prompt_tokens`
    prompt tokens, exactly `output_tokens` output tokens (no early stop)."""

    request_id: str
    tenant_id: str
    arrival_iter: int
    prompt_tokens: int
    output_tokens: int
    prefix_group: str | None = None
    prefix_tokens: int = 0


@dataclass(frozen=True)
class ScriptedWorkload:
    """A named script: tenants, requests (sorted by arrival, then as listed), the engine shape, and
    `iterations`, the steps both executors run (arrivals past it are an error).

    backlog_window: (first, last) iterations during which every tenant in `backlogged` has queued
    work by construction; service shares are compared over it (None: not a fairness workload).
    """

    name: str
    description: str
    tenants: tuple[ScriptedTenant, ...]
    requests: tuple[ScriptedRequest, ...]
    iterations: int
    engine: EngineShape = field(default_factory=EngineShape)
    backlog_window: tuple[int, int] | None = None
    backlogged: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        known = {t.tenant_id for t in self.tenants}
        ids = set()
        for r in self.requests:
            if r.tenant_id not in known:
                raise ValueError(f"{self.name}: request {r.request_id} of unknown tenant {r.tenant_id!r}")
            if r.request_id in ids:
                raise ValueError(f"{self.name}: duplicate request id {r.request_id}")
            ids.add(r.request_id)
            if not 0 <= r.arrival_iter < self.iterations:
                raise ValueError(f"{self.name}: {r.request_id} arrives outside [0, {self.iterations})")
            if r.prompt_tokens < 1 or r.output_tokens < 1 or r.prompt_tokens + r.output_tokens > self.engine.max_context:
                raise ValueError(f"{self.name}: {r.request_id} has bad lengths")

    def tenant(self, tenant_id: str) -> ScriptedTenant:
        return next(t for t in self.tenants if t.tenant_id == tenant_id)

    def arrivals(self) -> dict[int, list[ScriptedRequest]]:
        """Requests by arrival iteration, each list in script order."""
        out: dict[int, list[ScriptedRequest]] = {}
        for r in sorted(self.requests, key=lambda r: r.arrival_iter):
            out.setdefault(r.arrival_iter, []).append(r)
        return out

    def prompt(self, req: ScriptedRequest) -> list[int]:
        """The prompt token ids of `req` (deterministic; distinct per request outside a prefix group)."""
        index = [r.request_id for r in self.requests].index(req.request_id)
        body = [100 + (index * 7919 + j * 31) % 30000 for j in range(req.prompt_tokens)]
        if req.prefix_group is None or req.prefix_tokens <= 0:
            return body
        seed = sum(map(ord, req.prefix_group))
        shared = [100 + (seed * 104729 + j * 17) % 30000 for j in range(min(req.prefix_tokens, req.prompt_tokens))]
        return shared + body[len(shared):]


def _stream(tenant: str, start: int, stop: int, every: int, prompt: int, output: int,
            burst: int = 1, first: int = 0) -> list[ScriptedRequest]:
    """`burst` requests every `every` iterations in [start, stop), numbered from `first`."""
    out = []
    for k, it in enumerate(range(start, stop, every)):
        for b in range(burst):
            out.append(ScriptedRequest(f"{tenant}-{first + k * burst + b}", tenant, it, prompt, output))
    return out


def _flood(tenant: str, n: int, prompt: int, output: int) -> list[ScriptedRequest]:
    """`n` requests at iteration 0."""
    return _stream(tenant, 0, 1, 1, prompt, output, burst=n)


def _fairness(name: str, description: str, tenants: tuple[ScriptedTenant, ...],
              requests: tuple[ScriptedRequest, ...], *, iterations: int, backlog_from: int,
              backlog_to: int | None = None, backlogged: tuple[str, ...] | None = None,
              engine: EngineShape | None = None) -> ScriptedWorkload:
    """A fairness workload: every tenant in `backlogged` (default: all of them) has queued work by
    construction from iteration `backlog_from` to `backlog_to` (default: the last one), the window
    service is compared over."""
    last = iterations - 1 if backlog_to is None else backlog_to
    return ScriptedWorkload(name, description, tenants, requests, iterations, engine or EngineShape(),
                            (backlog_from, last), backlogged or tuple(t.tenant_id for t in tenants))


def _interleave(*streams: list[ScriptedRequest]) -> tuple[ScriptedRequest, ...]:
    """Requests of several tenants merged by arrival iteration, tenants in argument order within one."""
    merged = [r for s in streams for r in s]
    order = {id(r): (r.arrival_iter, i) for i, s in enumerate(streams) for r in s}
    return tuple(sorted(merged, key=lambda r: order[id(r)]))


# ---- the workloads -----------------------------------------------------------------------------
# Engine (default shape): 256-token iterations, 8 running slots, 8192 KV tokens. A 192-in / 32-out
# request holds a slot for about 33 iterations, so with 8 slots the engine finishes about one such
# request every 4 iterations: a tenant sending one every 3 iterations is above any fair share.
# Windows are chosen so that every tenant in `backlogged` keeps queued work throughout by
# construction (both drivers check it: `tests.parity.trace.Trace.backlog_end`).

OVERLOAD = _fairness(
    "overload",
    "a floods 48 requests at iteration 0, b sends one every 3 iterations (192 in / 32 out): both above "
    "their fair share; equal weights, so equal service while both are backlogged",
    (ScriptedTenant("a"), ScriptedTenant("b")),
    _interleave(_flood("a", 48, 192, 32), _stream("b", 0, 240, 3, 192, 32)),
    iterations=240, backlog_from=16)

WEIGHTED = _fairness(
    "weighted",
    "w1 (weight 1) and w3 (weight 3) flood 40 requests each at iteration 0 (192 in / 32 out): service should "
    "follow the weights, 1 : 3",
    (ScriptedTenant("w1", 1.0), ScriptedTenant("w3", 3.0)),
    _interleave(_flood("w1", 40, 192, 32), _flood("w3", 40, 192, 32)),
    iterations=180, backlog_from=8)

ON_OFF = _fairness(
    "on-off",
    "steady floods 60 requests at iteration 0; returning sends one every 2 iterations during [0, 30) and "
    "[80, 110), nothing in between (192 in / 32 out): coming back, it is lifted to the others' counter, "
    "neither starved nor paid back for its silence",
    (ScriptedTenant("steady"), ScriptedTenant("returning")),
    _interleave(_flood("steady", 60, 192, 32),
                _stream("returning", 0, 30, 2, 192, 32) + _stream("returning", 80, 110, 2, 192, 32, first=15)),
    iterations=200, backlog_from=84)

TIERS_WORKLOAD = _fairness(
    "tiers",
    "inter (interactive) sends one 128/16 request every 6 iterations, about 30 % of capacity; batch (batch) and "
    "bg (background) flood 32 requests of 192/32 each at iteration 0. DESIGN: strict priority interactive > "
    "batch > background, background keeping its minimum share (5 %)",
    (ScriptedTenant("inter", 1.0, "interactive"), ScriptedTenant("batch", 1.0, "batch"),
     ScriptedTenant("bg", 1.0, "background")),
    _interleave(_flood("batch", 32, 192, 32), _flood("bg", 32, 192, 32),
                _stream("inter", 2, 200, 6, 128, 16)),
    # with SGLang's batching the batch tenant runs out of queued work at iteration 198
    iterations=200, backlog_from=8, backlog_to=197, backlogged=("batch", "bg"))

MEMORY_FLOOD = _fairness(
    "memory-flood",
    "flood sends a 1024-in / 128-out request every 6 iterations into a 4096-token KV pool (three of them fill "
    "it); victim sends 128/32 every iteration: KV, not running slots, is short, so admission is memory-bound "
    "and decodes can run out of KV (reference: recompute preemption; SGLang: retraction)",
    (ScriptedTenant("flood"), ScriptedTenant("victim")),
    _interleave(_stream("flood", 0, 300, 6, 1024, 128), _stream("victim", 0, 300, 1, 128, 32)),
    iterations=300, engine=EngineShape(chunk_tokens=256, max_running=8, kv_tokens=4096, page_size=1),
    backlog_from=16)

DRAIN = ScriptedWorkload(
    "drain",
    "a short script run to completion (driver checks: every request finishes, no KV leaked, every token charged "
    "once): a sends 600/96 (prompts longer than a chunk) every 4 iterations, b (weight 2) 64/160 every 3, into a "
    "2048-token pool small enough for decode preemption / retraction",
    (ScriptedTenant("a"), ScriptedTenant("b", 2.0)),
    _interleave(_stream("a", 0, 20, 4, 600, 96), _stream("b", 1, 20, 3, 64, 160)),
    iterations=420, engine=EngineShape(chunk_tokens=256, max_running=6, kv_tokens=2048, page_size=1))

WORKLOADS: dict[str, ScriptedWorkload] = {w.name: w for w in (OVERLOAD, WEIGHTED, ON_OFF, TIERS_WORKLOAD, MEMORY_FLOOD)}
