"""A pool of simulated workers behind the gateway's own routing code, on one virtual time line.

Each worker is the real engine (`worker.engine.engine.Engine`, its scheduler and the
`worker.scheduling` policies) on a `SimulatedRunner` with its own `VirtualClock`; requests are routed
by `gateway.routing_policy` (the module the gateway runs: no copy; it imports nothing but the
standard library), seeing each worker's in-flight tokens as the gateway does (prompt + max_tokens of
the requests it sent there and that have not finished). With pool counters on (``fair`` routing, or
``pool_counters=True``) every ``board_interval_s`` of virtual time each worker publishes its report
(`Engine.pool_report`, the same call `worker.pool_service.PoolService` makes) to an in-memory board
and takes the others' (`Engine.pool_apply`), and the router reads the board: the staleness of the
real pool, modelled. With hand-back on (``fair`` routing, or ``hand_back=True``) a request the
worker's hand-back rule gives back (`worker.scheduling.handback`, asked by the engine every
iteration) is re-routed at that virtual time by the same routing policy over the other workers, as
the gateway does (at most once: the re-routed request may not be handed back again); the event log
keeps its first arrival, so its queue time counts from there.

The event loop (discrete events in time order): a board tick, then an arrival (routed at its
arrival time; a worker that sat idle is brought to that time), then the step of the busy worker
whose clock is furthest behind (one `Engine.step()`, which advances that worker's clock by the
modelled iteration time). All workers record into one `EventLog`, so `compute_metrics` gives
pool-wide figures (a tenant is backlogged while any of its requests, on any worker, is queued or
prefilling). Deterministic per seed.

`single_worker_equivalent`: one worker with the pool's total capacity (N times as fast, N times the
KV pool), the reference for hit rates and fairness "as if the pool were one big worker".
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from fairshare.pool_board import TenantReport, WorkerReport
from gateway.routing_policy import PoolBoard, RouteRequest, RoutingPolicy, make_routing
from fairshare.workloads import Workload
from worker.cache.radix import PrefixHits
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import FinishReason, SamplingParams
from worker.scheduling.metrics import EventLog
from loadtests.sim.driver import engine_config, estimate_capacity_rps, synthetic_prompt
from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock

BOARD_INTERVAL_S = 0.1


@dataclass(eq=False)
class SimWorker:
    """One simulated worker: its engine, clock and the gateway-side figures routing sees.
    prefix_hits: prompt tokens of its finished requests, looked up / served from its prefix cache."""

    index: int
    engine: Engine
    clock: VirtualClock
    runner: SimulatedRunner
    inflight_tokens: int = 0
    busy: bool = False
    requests: int = 0
    prefix_hits: PrefixHits = field(default_factory=PrefixHits)

    @property
    def route_id(self) -> str:
        return f"w{self.index}"

    def load_score(self) -> int:
        return self.inflight_tokens


@dataclass
class PoolResult:
    """One pool run. prefix_hits: prompt tokens looked up / served from the prefix cache, over the
    requests that finished (pool-wide; per worker in `workers`). spills: requests the fair policy
    sent beyond their affine worker (re-routes after a hand-back included)."""

    workload: Workload
    policy: str
    routing: str
    routing_policy: RoutingPolicy
    workers: list[SimWorker]
    config: EngineConfig
    time_model: IterationTimeModel
    log: EventLog
    end_s: float
    iterations: int
    pool_counters: bool
    prefix_hits: PrefixHits = field(default_factory=PrefixHits)
    finished: int = 0
    spills: int = 0
    routed: dict[str, int] = field(default_factory=dict)  # worker id -> requests routed there
    handed_back: int = 0  # requests a worker handed back and the router sent elsewhere

    @property
    def window(self) -> tuple[float, float]:
        return (0.0, base_workload(self.workload).duration_s)

    @property
    def hit_rate(self) -> float:
        """Pool-wide prefix hit rate: cached prompt tokens / prompt tokens (NaN without requests)."""
        return self.prefix_hits.hit_rate

    @property
    def cost(self):
        return self.workers[0].engine.cost

    def queue_times(self) -> list[float]:
        """Queue time (arrival -> first scheduled, s) of every request that arrived in the window
        and was scheduled, pool-wide."""
        t0, t1 = self.window
        return [r.admitted - r.arrival for r in self.log.requests.values()
                if r.admitted is not None and t0 <= r.arrival < t1]

    def queue_percentile(self, q: float) -> float:
        """The q-th percentile (0..100) of `queue_times` (NaN without requests)."""
        from worker.scheduling.metrics import percentile

        return percentile(self.queue_times(), q)


def _requests(workload, seed: int, rate_scale: float) -> list[tuple]:
    """(spec, prompt token ids) per request in arrival order, for a `Workload` (synthetic prompts,
    no shared prefixes) or a `SharedPrefixWorkload` (its own prompts)."""
    if hasattr(workload, "requests") and hasattr(workload, "base"):
        return [(r.spec, list(r.token_ids)) for r in workload.requests(seed, rate_scale)]
    return [(r, synthetic_prompt(i, r.prompt_tokens)) for i, r in enumerate(workload.generate(seed, rate_scale))]


def base_workload(workload) -> Workload:
    """The `Workload` (tenants, duration, engine settings) of a workload or a `SharedPrefixWorkload`."""
    return workload.base if hasattr(workload, "base") else workload


def run_pool(workload, policy: str, time_model: IterationTimeModel, *, workers: int = 4,
             routing: str | RoutingPolicy = "prefix", seed: int = 0, rate_scale: float = 1.0,
             drain_s: float | None = None, pool_counters: bool | None = None,
             board_interval_s: float = BOARD_INTERVAL_S, routing_options: dict | None = None,
             keep_token_times: bool = False, hand_back: bool | None = None, **engine_overrides) -> PoolResult:
    """Simulate `workload` (a `Workload` or `SharedPrefixWorkload`) on `workers` simulated workers
    running `policy`, routed by `routing` (a `gateway.routing_policy` name or policy).

    pool_counters: workers order by pool-wide counters through the board (default: on for ``fair``
    routing only). drain_s: seconds after the arrivals end that the run may continue (default: the
    workload's duration; math.inf: until every request finished). routing_options: options of
    `make_routing`. hand_back: workers may hand back queued, never-admitted requests to be re-routed
    (module docstring; default: on for ``fair`` routing only, and only with more than one worker).
    engine_overrides: EngineConfig fields of every worker. Returns a `PoolResult`.
    Raises ValueError for bad arguments or a request the engine refuses.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    base = base_workload(workload)
    config = engine_config(policy, base, **engine_overrides)
    name = routing if isinstance(routing, str) else routing.name
    pool_on = (name == "fair") if pool_counters is None else bool(pool_counters)
    hand_back_on = ((name == "fair") if hand_back is None else bool(hand_back)) and workers > 1
    board = PoolBoard()
    router = make_routing(routing, board=lambda: board, **(routing_options or {})) if isinstance(routing, str) \
        else routing
    log = EventLog(keep_token_times=keep_token_times)
    pool: list[SimWorker] = []
    for i in range(workers):
        clock = VirtualClock()
        runner = SimulatedRunner(clock, time_model, config.num_kv_blocks, config.block_size, seed=seed + i)
        pool.append(SimWorker(i, Engine(SimModel(), config, runner, clock=clock, recorder=log), clock, runner))
    items = _requests(workload, seed, rate_scale)
    end = base.duration_s + (base.duration_s if drain_s is None else drain_s)
    result = PoolResult(workload, policy, name, router, pool, config, time_model, log, 0.0, 0, pool_on)
    next_tick = 0.0 if (pool_on or name == "fair") else math.inf
    i = 0
    handed: list[tuple[float, int, object, list[int], SimWorker]] = []  # heap (time, seq, spec, prompt, from): re-routes due
    handed_seq = itertools.count()

    def finisher(w: SimWorker, cost: int, prompt_len: int, spec, prompt):
        def on_output(out) -> None:
            if out.finish_reason is None:
                return
            w.inflight_tokens -= cost
            if out.finish_reason is FinishReason.HANDED_BACK:
                heapq.heappush(handed, (w.clock(), next(handed_seq), spec, prompt, w))
                return
            w.prefix_hits.add(prompt_len, out.cached_tokens)
            result.prefix_hits.add(prompt_len, out.cached_tokens)
            result.finished += 1
        return on_output

    def place(w: SimWorker, spec, prompt: list[int], at: float, may_hand_back: bool) -> None:
        cost = len(prompt) + spec.output_tokens
        result.routed[w.route_id] = result.routed.get(w.route_id, 0) + 1
        w.clock.advance_to(at)
        w.inflight_tokens += cost
        w.requests += 1
        w.engine.add_request(spec.request_id, spec.tenant_id, prompt,
                             SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True),
                             finisher(w, cost, len(prompt), spec, prompt), weight=spec.weight, arrival_time=at,
                             may_hand_back=may_hand_back, final_only=True)
        w.busy = True

    while True:
        if handed:  # re-route what was handed back, at the time it was handed back, before anything later
            at, _, spec, prompt, src = heapq.heappop(handed)
            req = RouteRequest(spec.tenant_id, spec.tenant_id + "\x00", prompt, len(prompt) + spec.output_tokens,
                               handed_back=1)
            place(router.choose(req, [x for x in pool if x is not src]), spec, prompt, at, False)  # MAX_HAND_BACKS: once
            result.handed_back += 1
            continue
        t_arr = items[i][0].arrival_s if i < len(items) else math.inf
        busy = [w for w in pool if w.busy]
        t_step = min((w.clock() for w in busy), default=math.inf)
        now = min(next_tick, t_arr, t_step)
        if now == math.inf or now > end:
            break
        if next_tick <= t_arr and next_tick <= t_step:
            reports = [WorkerReport(w.route_id, "sim", {t: TenantReport(*row) for t, row in w.engine.pool_report().items()})
                       for w in pool]
            if pool_on:
                for w in pool:
                    w.engine.pool_apply([r for r in reports if r.worker_id != w.route_id])
            board = PoolBoard.from_reports(reports)
            next_tick += board_interval_s
            if not busy:  # nothing changes until the next arrival (none left: stop ticking)
                next_tick = max(next_tick, t_arr)
            continue
        if t_arr <= t_step:
            spec, prompt = items[i]
            i += 1
            req = RouteRequest(spec.tenant_id, spec.tenant_id + "\x00", prompt, len(prompt) + spec.output_tokens)
            place(router.choose(req, pool), spec, prompt, spec.arrival_s, hand_back_on)
            continue
        w = min(busy, key=lambda x: (x.clock(), x.index))
        if w.engine.step():
            result.iterations += 1
        else:
            w.busy = False
    result.end_s = max(w.clock() for w in pool)
    result.spills = getattr(router, "spills", 0)
    log.steps.sort(key=lambda st: (st.end, st.start))
    return result


def single_worker_equivalent(workers: int, time_model: IterationTimeModel, policy: str, workload,
                             **engine_overrides) -> dict:
    """`run_pool` arguments for one worker with the total capacity of `workers` workers: the time
    model `workers` times as fast and `workers` times the KV pool (each worker's, from the workload
    or the overrides). Returns {"time_model": ..., "num_kv_blocks": ...}."""
    cfg = engine_config(policy, base_workload(workload), **engine_overrides)
    return {"time_model": time_model.faster(workers), "num_kv_blocks": cfg.num_kv_blocks * workers}


def pool_shaped_worker(workers: int, time_model: IterationTimeModel, policy: str, workload,
                       **engine_overrides) -> dict:
    """`run_pool` arguments for one worker of the pool's own shape: `workers` times each worker's
    running slots, KV pool and prefill chunk, each iteration as long as one pool worker's
    (`IterationTimeModel.wider`): the pool's batches under one scheduler, where
    `single_worker_equivalent` keeps one worker's batch and runs it `workers` times as fast. Returns
    {"time_model", "num_kv_blocks", "max_running", "max_num_batched_tokens"}."""
    cfg = engine_config(policy, base_workload(workload), **engine_overrides)
    return {"time_model": time_model.wider(workers), "num_kv_blocks": cfg.num_kv_blocks * workers,
            "max_running": cfg.max_running * workers, "max_num_batched_tokens": cfg.max_num_batched_tokens * workers}


def mean_request(workload, seed: int = 0) -> tuple[int, int]:
    """(mean prompt tokens, mean output tokens) of a workload's requests at rate scale 1."""
    items = _requests(workload, seed, 1.0)
    if not items:
        return 256, 256
    return (round(sum(len(p) for _, p in items) / len(items)),
            round(sum(s.output_tokens for s, _ in items) / len(items)))


def pool_rate_scale(workload, time_model: IterationTimeModel, workers: int, load: float, seed: int = 0,
                    **engine_overrides) -> tuple[float, float]:
    """The rate scale that offers `load` (e.g. 0.8) of the pool's capacity: `workers` times one
    worker's saturated throughput for the workload's mean request (no prefix hits counted), over
    the workload's offered rate. Returns (scale, capacity of one worker in requests/s). Raises
    ValueError unless load > 0."""
    if not load > 0:
        raise ValueError("load must be > 0")
    base = base_workload(workload)
    prompt, output = mean_request(workload, seed)
    settings = dict(base.engine)
    settings.update(engine_overrides)
    cap = estimate_capacity_rps(time_model, prompt, output, seconds=120.0, **settings)
    offered = len(_requests(workload, seed, 1.0)) / base.duration_s
    return load * workers * cap / offered, cap


def route_ids(workers: int) -> list[str]:
    """The route ids of a simulated pool of `workers` workers (w0, w1, ...)."""
    return [f"w{i}" for i in range(workers)]


__all__ = ["PoolResult", "SimWorker", "mean_request", "pool_rate_scale", "pool_shaped_worker", "route_ids",
           "run_pool", "single_worker_equivalent"]

