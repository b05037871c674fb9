"""The prefix-cache hit-rate benchmark on the real engine (`python -m worker.cache.bench --engine`).

Same trace and the same three cache modes as `worker.cache.bench`, but each mode runs the real
`Engine` (scheduler, paged KV pool, prefix cache with its namespaces and eviction) on the
simulated runner and a virtual clock, as `fairshare sim` does: requests arrive at their trace
times, run concurrently, decode their output tokens, and share one KV pool of `num_kv_blocks`
blocks with the cache. A request's hit is the `cached_tokens` the engine reports for it;
`same-tenant` is counted as in the replay (hit tokens inside the longest block-aligned prefix the
same tenant had sent before, in arrival order). Which tenant inserted a hit block is not visible
from outside the engine, so `x-tenant` is not reported here (the replay reports it).

Deterministic per seed. No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from worker.cache.bench import BENCH_SECRET, MODES, ReplayResult, _block_chain
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams
from worker.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = ROOT / "loadtests" / "profiles" / "cpu-random-tiny.json"


def run_engine(requests: Sequence, mode: str, num_kv_blocks: int, block_size: int = 16,
               public_prefixes: Sequence[Sequence[int]] = (), time_model: IterationTimeModel | None = None,
               policy: str = "vtc", max_num_batched_tokens: int = 512, drain_s: float = 600.0) -> ReplayResult:
    """Run `requests` (`loadtests.workloads.shared_prefix.PromptedRequest`, arrival order) through
    the engine in `mode` (one of `worker.cache.bench.MODES`) with a pool of `num_kv_blocks` blocks.

    time_model: iteration time (default: loadtests/profiles/cpu-random-tiny.json). drain_s: how long
    after the last arrival the run may go on. Returns a `ReplayResult` (cross_tenant_tokens = -1:
    not measured; requests = requests that finished). Raises ValueError for an unknown mode or a
    request the engine refuses.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    tm = time_model or IterationTimeModel.load(DEFAULT_PROFILE)
    config = EngineConfig(policy=policy, max_num_batched_tokens=max_num_batched_tokens, max_running=64,
                          block_size=block_size, num_kv_blocks=num_kv_blocks, prefix_cache=True,
                          cache_isolation=mode != "global",
                          public_prefixes=[list(p) for p in public_prefixes] if mode == "namespaced+public" else [],
                          cache_secret=BENCH_SECRET)
    clock = VirtualClock()
    engine = Engine(SimModel(), config, SimulatedRunner(clock, tm, num_kv_blocks, block_size), clock=clock)
    result = ReplayResult(mode, num_kv_blocks, cross_tenant_tokens=-1)
    history: dict[str, set[int]] = {}
    # request id -> (tenant, prompt tokens, own-prefix blocks, public-prefix blocks)
    pending: dict[str, tuple[str, int, int, int]] = {}
    public_chains = [_block_chain(p, block_size) for p in public_prefixes] if mode == "namespaced+public" else []

    def on_output(out) -> None:
        if out.finish_reason is None or out.request_id not in pending:
            return
        tenant, n_tokens, own, public = pending.pop(out.request_id)
        hit = out.cached_tokens
        same = min(hit, own * block_size)
        result.requests += 1
        result.lookup_tokens += n_tokens
        result.hit_tokens += hit
        result.same_tenant_tokens += same
        row = result.by_tenant.setdefault(tenant, [0, 0, 0])
        row[0] += n_tokens
        row[1] += hit
        row[2] += same
        result.public_tokens += min(hit, public * block_size)

    end = (requests[-1].spec.arrival_s if requests else 0.0) + drain_s
    i = 0
    while True:
        now = clock()
        while i < len(requests) and requests[i].spec.arrival_s <= now:
            r = requests[i]
            chain = _block_chain(r.token_ids, block_size)
            seen = history.setdefault(r.tenant_id, set())
            own = 0
            while own < len(chain) and chain[own] in seen:
                own += 1
            seen.update(chain)
            public = max((len(c) for c in public_chains if len(c) <= len(chain) and chain[len(c) - 1] == c[-1]),
                         default=0)
            pending[r.spec.request_id] = (r.tenant_id, len(r.token_ids), own, public)
            engine.add_request(r.spec.request_id, r.tenant_id, list(r.token_ids),
                               SamplingParams(max_tokens=r.spec.output_tokens, temperature=0.0, ignore_eos=True),
                               on_output, weight=r.spec.weight, arrival_time=r.spec.arrival_s)
            i += 1
        if now >= end:
            break
        if engine.step():
            continue
        if i >= len(requests):
            break
        clock.advance_to(requests[i].spec.arrival_s)
    if engine.cache is not None:
        result.evicted_blocks = engine.cache.stats.evicted_blocks
    return result
