"""Run a workload through the real engine loop on a simulated runner and a virtual clock.

The loop: add every request whose arrival time has come (with its true arrival time), cancel
those whose cancel time has come (`Engine.abort`), run one `Engine.step()` (the simulated runner
advances the clock by the modelled iteration time); when the engine is idle, jump the clock to the
next arrival. Arrivals stop at `workload.duration_s`; the run then continues for up to `drain_s`
seconds so that late requests can get their first token (metrics are still taken over
[0, duration_s] unless asked otherwise). Deterministic per seed: same workload, seed, policy and
time model, same events.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field

from fairshare.workloads import RequestSpec, Workload
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams
from worker.scheduling.metrics import EventLog
from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock

# Engine settings of the simulator unless a workload or the caller overrides them.
SIM_ENGINE_DEFAULTS = {"max_num_batched_tokens": 512, "max_running": 64, "block_size": 16, "num_kv_blocks": 2048}


@dataclass
class SimResult:
    """One simulated run: the event log, the engine (policy accounts, cost), and run figures.
    end_s: virtual time the run ended (s). iterations: engine steps that ran a batch."""

    workload: Workload
    policy: str
    seed: int
    rate_scale: float
    config: EngineConfig
    time_model: IterationTimeModel
    log: EventLog
    engine: Engine
    end_s: float
    iterations: int
    requests: list[RequestSpec] = field(default_factory=list)

    @property
    def window(self) -> tuple[float, float]:
        return (0.0, self.workload.duration_s)


def engine_config(policy: str, workload: Workload | None = None, **overrides) -> EngineConfig:
    """The simulator's `EngineConfig`: SIM_ENGINE_DEFAULTS, then the workload's settings, then
    `overrides` (any EngineConfig field)."""
    settings = dict(SIM_ENGINE_DEFAULTS)
    if workload is not None:
        settings.update(workload.engine)
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig(policy=policy, **settings)


def synthetic_prompt(index: int, tokens: int) -> list[int]:
    """The prompt of the `index`-th request of a workload that gives only lengths: `tokens` token
    ids whose first one is unique per request, so no two requests share a cached prefix (the prefix
    cache is on in the simulator as in the worker) unless a workload says so."""
    return [1001 + index % 30000] + [1 + (k % 1000) for k in range(1, tokens)]


def run_workload(workload: Workload, policy: str, time_model: IterationTimeModel, *, seed: int = 0,
                 rate_scale: float = 1.0, drain_s: float | None = None, keep_token_times: bool = True,
                 jitter: float = 0.0, **engine_overrides) -> SimResult:
    """Simulate `workload` under `policy` (`vtc`, `vtc-pred`, `drr`, `fcfs`).

    drain_s: seconds after the last arrival the run may continue (default: the workload duration,
    i.e. the run ends by 2 × duration). engine_overrides: EngineConfig fields (e.g. alpha, beta,
    cost, drr_quantum, num_kv_blocks). Returns a `SimResult`. Raises ValueError for an unknown
    policy or a request the engine refuses (e.g. a prompt longer than the KV pool).
    """
    config = engine_config(policy, workload, **engine_overrides)
    clock = VirtualClock()
    runner = SimulatedRunner(clock, time_model, config.num_kv_blocks, config.block_size, jitter=jitter, seed=seed)
    log = EventLog(keep_token_times=keep_token_times)
    engine = Engine(SimModel(), config, runner, clock=clock, recorder=log)
    requests = workload.generate(seed, rate_scale)
    end = workload.duration_s + (workload.duration_s if drain_s is None else drain_s)
    cancels: list[tuple[float, str]] = []
    i = 0

    def ignore(_out) -> None:
        return None

    while True:
        now = clock()
        while i < len(requests) and requests[i].arrival_s <= now:
            r = requests[i]
            engine.add_request(r.request_id, r.tenant_id, synthetic_prompt(i, r.prompt_tokens),
                               SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True), ignore,
                               weight=r.weight, tier=r.tier, arrival_time=r.arrival_s, final_only=True)
            if r.cancel_at_s is not None:
                heapq.heappush(cancels, (r.cancel_at_s, r.request_id))
            i += 1
        while cancels and cancels[0][0] <= now:
            engine.abort(heapq.heappop(cancels)[1])
        if now >= end:
            break
        if engine.step():
            continue
        upcoming = [t for t in ((requests[i].arrival_s if i < len(requests) else None),
                                (cancels[0][0] if cancels else None)) if t is not None]
        if not upcoming:
            break
        clock.advance_to(min(upcoming))
    return SimResult(workload, policy, seed, rate_scale, config, time_model, log, engine, clock(), runner.steps,
                     requests)


def estimate_capacity_rps(time_model: IterationTimeModel, prompt_tokens: int = 256, output_tokens: int = 256,
                          seconds: float = 300.0, **engine_overrides) -> float:
    """Requests/s of `prompt_tokens`/`output_tokens` requests the simulated server serves when
    saturated: service units charged per second over the second half of `seconds` (one tenant
    with a standing queue), divided by the cost of one request.

    The simulator is deterministic, so the figure is memoised per process for each set of
    arguments (a probe run is ~3 s of CPU; reports and tests ask for the same one many times);
    arguments that cannot be hashed are simulated every time."""
    overrides = tuple(sorted(engine_overrides.items()))
    try:
        hash(overrides)
    except TypeError:
        return _capacity_rps(time_model, prompt_tokens, output_tokens, seconds, overrides)
    return _capacity_rps_memo(time_model, prompt_tokens, output_tokens, seconds, overrides)


def _capacity_rps(time_model: IterationTimeModel, prompt_tokens: int, output_tokens: int, seconds: float,
                  overrides: tuple) -> float:
    from fairshare.workloads import TenantLoad

    engine_overrides = dict(overrides)
    probe = Workload("capacity-probe", "one tenant sending far above capacity",
                     (TenantLoad("probe", 20.0, prompt_tokens, output_tokens, arrival="uniform"),), duration_s=seconds)
    res = run_workload(probe, "fcfs", time_model, drain_s=0.0, keep_token_times=False, **engine_overrides)
    half = seconds / 2
    units = sum(sum(st.service.values()) for st in res.log.steps if half < st.end <= seconds)
    return units / (seconds - half) / res.engine.cost.request(prompt_tokens, output_tokens)


_capacity_rps_memo = functools.lru_cache(maxsize=64)(_capacity_rps)
