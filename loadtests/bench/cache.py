"""Prefix-cache hit-rate benchmark: what tenant isolation costs, and what public prefixes win back.

    python -m loadtests.bench.cache [--workload shared-system-prompts] [--capacity 2048,8192,0]
                                 [--block-size 16] [--seed 0] [--engine [--stretch 25]]
    fairshare bench cache [same options]

A multi-tenant trace (`fairshare/workloads/shared_prefix.py`: an operator-wide public system
prompt, each tenant's own system prompts, private user turns) is replayed through the real
`worker.cache.radix.RadixCache` three times, with the same capacity (a pool of `capacity` KV
blocks shared by the cache and the request being served; 0 = unbounded):

- `global (unsafe)`: one namespace for everybody (what `--unsafe-global-cache` does; leaks);
- `namespaced`: one namespace per tenant (`derive_namespace`), the default;
- `namespaced+public`: namespaces plus the public system prompt listed as a public prefix.

Replay, per request in arrival order (each finishes before the next starts; decode is not
modelled, only prompts are cached): `acquire` the cached prefix, take blocks for the rest from the
free pool (evicting with `evict` when it is short), `insert` the whole prompt, `release`.

Figures, as shares of all prompt tokens looked up:
- `hit`: prompt tokens served from the cache;
- `same-tenant`: hit tokens inside the longest block-aligned prefix that the *same* tenant had
  already sent: reuse a cache of the tenant's own would give. With enough capacity it is equal in
  all three modes (isolation takes nothing from a tenant's own reuse); under pressure the
  namespaced modes hold duplicate copies and may lose a little of it;
- `other`: hit − same-tenant: reuse that exists only because another tenant sent the prefix;
- `public`: hit tokens served from the public tree;
- `x-tenant`: hit tokens on private blocks that another tenant inserted: a cross-tenant hit, i.e.
  what a timing side channel could reveal. 0 whenever namespaces are on.
`promoted/global` is the hit rate of namespaced+public divided by the global one.

`--engine` runs the same trace through the real engine on the simulator instead (`run_engine`:
each mode runs the real `Engine` (scheduler, paged KV pool, prefix cache with its namespaces and
eviction) on the simulated runner and a virtual clock, as `fairshare sim` does: requests arrive at
their trace times, run concurrently, decode their output tokens, and share one KV pool of
`num_kv_blocks` blocks with the cache. A request's hit is the `cached_tokens` the engine reports for
it; `same-tenant` is counted as in the replay. Which tenant inserted a hit block is not visible from
outside the engine, so `x-tenant` is not measured there).

Pure Python (no torch, no grpc); deterministic per seed.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from loadtests.profiles import DEFAULT_PROFILE
from worker.cache.namespace import GLOBAL_NAMESPACE, derive_namespace
from worker.cache.radix import PrefixHits, RadixCache
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams
from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock


MODES = ("global", "namespaced", "namespaced+public")
MODE_LABELS = {"global": "global (unsafe)", "namespaced": "namespaced", "namespaced+public": "namespaced+public"}
BENCH_SECRET = b"fairshare cache bench secret (fixed for reproducibility)"


@dataclass
class ReplayHits(PrefixHits):
    """`PrefixHits` plus `same_tenant_tokens`: of the hit tokens, those inside the longest prefix
    the same tenant had already sent (see the module docstring)."""

    same_tenant_tokens: int = 0

    def add(self, lookup_tokens: int, hit_tokens: int, same_tenant_tokens: int = 0) -> None:
        """Count a lookup: `lookup_tokens` prompt tokens, `hit_tokens` cached, `same_tenant_tokens` of
        those the tenant's own reuse."""
        super().add(lookup_tokens, hit_tokens)
        self.same_tenant_tokens += same_tenant_tokens


@dataclass
class ReplayResult:
    """One mode at one capacity. Token counts are prompt tokens; blocks are KV blocks.

    capacity_blocks: pool size (0 = unbounded). requests: requests counted. total: prompt tokens
    looked up, served from the cache and of those the tenant's own reuse (`ReplayHits`), over all
    requests; by_tenant: the same per tenant. public_tokens / cross_tenant_tokens: see the module
    docstring. evicted_blocks: blocks the cache gave back under pressure.
    """

    mode: str
    capacity_blocks: int
    requests: int = 0
    total: ReplayHits = field(default_factory=ReplayHits)
    public_tokens: int = 0
    cross_tenant_tokens: int = 0
    evicted_blocks: int = 0
    by_tenant: dict[str, ReplayHits] = field(default_factory=dict)

    def count(self, tenant: str, lookup_tokens: int, hit_tokens: int, same_tenant_tokens: int) -> None:
        """One request of `tenant` (token counts as in `ReplayHits.add`): into `total` and `by_tenant`."""
        self.requests += 1
        for tally in (self.total, self.by_tenant.setdefault(tenant, ReplayHits())):
            tally.add(lookup_tokens, hit_tokens, same_tenant_tokens)

    def rate(self, tokens: int) -> float:
        """`tokens` as a share of the tokens looked up (0 when nothing was)."""
        return tokens / self.total.lookup_tokens if self.total.lookup_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.rate(self.total.hit_tokens)

    @property
    def same_tenant_rate(self) -> float:
        return self.rate(self.total.same_tenant_tokens)


def _block_chain(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the whole blocks of `tokens`: entry i names the prefix of i + 1 blocks."""
    out, h = [], 0
    for i in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


def replay(requests: Iterable[tuple[str, Sequence[int]]], mode: str, capacity_blocks: int = 0,
           block_size: int = 16, public_prefixes: Sequence[Sequence[int]] = (),
           secret: bytes = BENCH_SECRET) -> ReplayResult:
    """Replay `(tenant_id, prompt token ids)` pairs, in order, through a `RadixCache` in `mode`
    (one of MODES) with a pool of `capacity_blocks` KV blocks (0: unbounded). `public_prefixes`
    are used in the `namespaced+public` mode only. Returns the `ReplayResult`.

    Raises ValueError for an unknown mode or a prompt that needs more blocks than the pool has.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    publics = [tuple(p) for p in public_prefixes] if mode == "namespaced+public" else []
    cache = RadixCache(block_size, publics)
    result = ReplayResult(mode, capacity_blocks)
    free: list[int] = []
    next_block = 0
    inserter: dict[int, str] = {}            # cached private block -> tenant whose request inserted it
    history: dict[str, set[int]] = {}        # tenant -> block-chain hashes of prefixes it has sent
    public_chains = [_block_chain(p, block_size) for p in publics]
    namespaces: dict[str, str] = {}
    for tenant, prompt in requests:
        tokens = tuple(prompt)
        if mode == "global":
            ns = GLOBAL_NAMESPACE
        else:
            ns = namespaces.get(tenant) or namespaces.setdefault(tenant, derive_namespace(secret, tenant, ""))
        chain = _block_chain(tokens, block_size)
        public_blocks = 0
        for p, pc in zip(publics, public_chains):
            if len(pc) > public_blocks and len(pc) <= len(chain) and chain[len(pc) - 1] == pc[-1]:
                public_blocks = len(pc)
        blocks, hit = cache.acquire(ns, tokens, tenant)
        hit_blocks = len(blocks)
        seen = history.setdefault(tenant, set())
        own = 0
        while own < len(chain) and chain[own] in seen:
            own += 1
        same = min(hit_blocks, own)
        public = min(hit_blocks, public_blocks)
        cross = sum(1 for i, b in enumerate(blocks) if i >= public_blocks and inserter.get(b, tenant) != tenant)
        # blocks for the rest of the prompt (the last, partial block included)
        need = math.ceil(len(tokens) / block_size) - hit_blocks
        if capacity_blocks:
            if need > capacity_blocks - (cache.num_blocks - cache.num_evictable):
                cache.release(blocks)
                raise ValueError(f"a {len(tokens)}-token prompt does not fit a pool of {capacity_blocks} blocks")
            short = need - (len(free) + capacity_blocks - next_block)
            if short > 0:
                freed = cache.evict(short)
                for b in freed:
                    inserter.pop(b, None)
                free.extend(freed)
                result.evicted_blocks += len(freed)
        new = []
        for _ in range(need):
            if free:
                new.append(free.pop())
            else:
                new.append(next_block)
                next_block += 1
        adopted = cache.insert(ns, tokens, blocks + new, tenant)
        for b in adopted:
            inserter[b] = tenant
        cache.release(blocks + adopted)
        kept = set(adopted)
        free.extend(b for b in new if b not in kept)
        seen.update(chain)
        result.count(tenant, len(tokens), hit, same * block_size)
        result.public_tokens += public * block_size
        result.cross_tenant_tokens += cross * block_size
    return result


def run_all(requests: Sequence[tuple[str, Sequence[int]]], capacity_blocks: int, block_size: int = 16,
            public_prefixes: Sequence[Sequence[int]] = ()) -> dict[str, ReplayResult]:
    """`replay` in every mode at one capacity; mode -> result."""
    return {m: replay(requests, m, capacity_blocks, block_size, public_prefixes) for m in MODES}


def format_table(results: dict[str, ReplayResult]) -> str:
    """One capacity's table (columns: module docstring) and the two checks of issue #7."""
    first = next(iter(results.values()))
    cap = first.capacity_blocks or "unbounded"
    lines = [f"capacity {cap} blocks; {first.requests} requests, {first.total.lookup_tokens} prompt tokens",
             f"  {'cache':<20} {'hit':>7} {'same-tenant':>12} {'other':>7} {'public':>7} {'x-tenant':>9} "
             f"{'evicted':>8}"]
    for mode, r in results.items():
        lines.append(f"  {MODE_LABELS[mode]:<20} {r.hit_rate:>7.1%} {r.same_tenant_rate:>12.1%} "
                     f"{r.rate(r.total.hit_tokens - r.total.same_tenant_tokens):>7.1%} {r.rate(r.public_tokens):>7.1%} "
                     f"{'-' if r.cross_tenant_tokens < 0 else format(r.rate(r.cross_tenant_tokens), '.1%'):>9} "
                     f"{r.evicted_blocks:>8}")
    g, n, p = results["global"], results["namespaced"], results["namespaced+public"]
    ratio = p.hit_rate / g.hit_rate if g.hit_rate else float("nan")
    same = [r.total.same_tenant_tokens for r in (g, n, p)]
    lines.append(f"  same-tenant hit tokens: global {same[0]}, namespaced {same[1]}, namespaced+public {same[2]} "
                 f"({'equal' if len(set(same)) == 1 else 'differ'})")
    lines.append(f"  promoted/global hit rate: {ratio:.2f} ({'>=' if ratio >= 0.7 else '<'} 0.70); "
                 f"namespaced/global: {n.hit_rate / g.hit_rate if g.hit_rate else float('nan'):.2f}")
    return "\n".join(lines)


def run_engine(requests: Sequence, mode: str, num_kv_blocks: int, block_size: int = 16,
               public_prefixes: Sequence[Sequence[int]] = (), time_model: IterationTimeModel | None = None,
               policy: str = "vtc", max_num_batched_tokens: int = 512, drain_s: float = 600.0) -> ReplayResult:
    """Run `requests` (`fairshare.workloads.shared_prefix.PromptedRequest`, arrival order) through
    the engine in `mode` (one of `loadtests.bench.cache.MODES`) with a pool of `num_kv_blocks` blocks.

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
        result.count(tenant, n_tokens, hit, same)
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


def main(argv: list[str] | None = None) -> int:
    """Entry point (`python -m loadtests.bench.cache`, `fairshare bench cache`); prints the tables."""
    from fairshare.workloads.shared_prefix import WORKLOADS

    p = argparse.ArgumentParser(prog="python -m loadtests.bench.cache", description="prefix-cache hit rates by isolation mode")
    p.add_argument("--workload", default="shared-system-prompts", choices=sorted(WORKLOADS))
    p.add_argument("--capacity", default="2048,8192,0",
                   help="comma list of KV pool sizes in blocks (0 = unbounded); default 2048,8192,0")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", action="store_true",
                   help="run the real engine on the simulator (virtual clock, concurrent requests, decode) "
                        "instead of replaying through the cache alone; 0 capacity is not allowed")
    p.add_argument("--stretch", type=float, default=25.0,
                   help="with --engine: play the workload this many times slower (rates / K, duration x K) so "
                        "that the simulated server is not overloaded (default 25)")
    args = p.parse_args(argv)
    w = WORKLOADS[args.workload]
    reqs = w.requests(args.seed)
    trace = [(r.tenant_id, r.token_ids) for r in reqs]
    print(f"workload {w.name}: {w.base.description}; seed {args.seed}, block size {args.block_size}")
    caps = [int(c) for c in args.capacity.split(",") if c.strip()]
    public = [w.public_prompt(args.seed)]
    if args.engine:
        caps = [c for c in caps if c > 0]
        if not caps:
            p.error("--engine needs a finite --capacity")
        slow = w.stretched(args.stretch)
        reqs = slow.requests(args.seed)
        print(f"real engine on the simulated runner (time model {DEFAULT_PROFILE.name}, policy vtc, virtual clock); "
              f"arrivals stretched x{args.stretch:g} ({len(reqs)} requests over {slow.base.duration_s:g} s); "
              "figures over finished requests")
        for cap in caps:
            res = {m: run_engine(reqs, m, cap, args.block_size, public) for m in MODES}
            print(format_table(res), flush=True)
        return 0
    print("replayed through worker.cache.radix.RadixCache (one request at a time, prompts only)")
    for cap in caps:
        print(format_table(run_all(trace, cap, args.block_size, public)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
