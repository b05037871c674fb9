"""`fairshare bench scheduler`: what the scheduling core's decisions cost per iteration.

The reference executor (`worker.engine.scheduler.Scheduler`, real `BlockManager`, no model) runs a
steady state: `waiting` requests queued over `tenants` tenants spread over the three tiers (tenant i
in tier i mod 3, weights 1-4), `max_running` of them running, prompts of 32-512 tokens and outputs of
8-128 tokens (deterministic per seed); every iteration the scheduled tokens are "computed", one
output token is committed (and charged) per finished prefill or decode, finished requests leave and
new ones keep the queue at `waiting`. Timed per iteration, after a warm-up:

- core: the time spent in the scheduling core's calls (`SchedulingCore.begin_iteration`,
  `plan_iteration`, `decode_victim`, `begin_prefill`, `next_prefill`, `admit`, `served`,
  `cannot_serve`, `end_prefill`, `end_iteration`, and the policy listener it installs): the
  decisions, including the calls the core makes back into the executor for KV needs;
- schedule: all of `Scheduler.schedule()` (the decisions plus block tables, prefix-cache lookups and
  charging).

Times are `time.perf_counter` intervals; the timing wrappers' own cost (measured on a no-op) is
subtracted. The median is robust to a shared machine's other processes; the p99 is not. Python's
cyclic garbage collector is paused during the timed iterations (as `timeit` does; it runs
every 50 iterations outside them), since a collection pass is charged to whatever code happens to
run. `--sc3` adds case SC3's TTFT in wall seconds on the reference engine with the random tiny model
(the test asserts it in iterations). Prints the median and p99 in milliseconds (goal: core ≤ 0.2 ms at 1,000 waiting requests over 100
tenants in 3 tiers, 1 % of a 20 ms GPU iteration) and how they grow with tenants and with waiting
requests. Wall-clock figures of this machine: run it on the machine you want figures for.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence
from worker.scheduling.cost import LinearCost
from worker.scheduling.decode_share import DEFAULT_LOWER_TIER_TOKEN_TARGET
from worker.scheduling.policy import TIERS, make_policy

CORE_CALLS = ("begin_iteration", "plan_iteration", "decode_victim", "begin_prefill", "next_prefill", "admit",
              "served", "cannot_serve", "end_prefill", "end_iteration", "_on_policy_change")


def _timed(core, acc: list[float]) -> None:
    """Wrap the core's calls so that their time adds up in acc[0] (seconds) and their number in
    acc[1] (the timer's own cost per call is subtracted by `run`)."""
    for name in CORE_CALLS:
        fn = getattr(core, name)

        def wrapper(*args, _fn=fn, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                acc[0] += time.perf_counter() - t0
                acc[1] += 1

        setattr(core, name, wrapper)
    # the policy calls the listener it was given at construction: re-subscribe the timed one
    core.policy._listeners = [core._on_policy_change if l == type(core)._on_policy_change.__get__(core) else l
                              for l in core.policy._listeners]


def run(tenants: int, waiting: int, *, iterations: int = 300, warmup: int = 100, max_running: int = 64,
        chunk: int = 512, policy: str = "vtc", seed: int = 0,
        lower_tier_token_target: int | None = DEFAULT_LOWER_TIER_TOKEN_TARGET) -> dict:
    """One steady state; returns {"core": [ms...], "schedule": [ms...], "preempted": n, "running": n}.
    lower_tier_token_target: the scheduler's (None: no limit).
    The cyclic garbage collector is paused while timing (and run every 50 iterations, untimed)."""
    rng = random.Random(seed)
    bm = BlockManager(max(4096, max_running * 48), 16)
    sched = Scheduler(make_policy(policy, LinearCost()), LinearCost(), bm, chunk, max_running,
                      lower_tier_token_target=lower_tier_token_target)
    core = sched.core
    acc = [0.0, 0]
    _timed(core, acc)
    recorded, overhead = _timer_cost()
    names = [f"t{i}" for i in range(tenants)]
    n = [0]

    def add_one():
        i = n[0] % tenants
        n[0] += 1
        out = rng.randint(8, 128)
        s = Sequence(f"r{n[0]}", names[i], [1000 + n[0] % 30000] + [1] * (rng.randint(32, 512) - 1),
                     SamplingParams(max_tokens=out, ignore_eos=True), weight=float(1 + i % 4), tier=TIERS[i % 3],
                     max_tokens=out, arrival_time=float(n[0]))
        sched.add(s)

    for _ in range(waiting):
        add_one()
    core_ms, sched_ms = [], []
    gc.collect()
    gc.disable()  # as timeit does: a cyclic-GC pass lands on whatever runs, not on the scheduler
    try:
        for it in range(warmup + iterations):
            acc[0], acc[1] = 0.0, 0
            t0 = time.perf_counter()
            chunks = sched.schedule()
            dt = time.perf_counter() - t0 - acc[1] * overhead
            _commit(sched, chunks)
            while sched.num_waiting() < waiting:
                add_one()
            if it >= warmup:
                core_ms.append(max(0.0, acc[0] - acc[1] * recorded) * 1e3)
                sched_ms.append(dt * 1e3)
            if it % 50 == 0:
                gc.collect()
    finally:
        gc.enable()
    st = core.stats
    return {"core": core_ms, "schedule": sched_ms, "preempted": sum(st.preemptions.values()),
            "running": len(core.running)}


def _timer_cost(n: int = 20000, batches: int = 50) -> tuple[float, float]:
    """Seconds per call of the timing wrapper, measured on a no-op: (what it records itself, i.e.
    the part of its own cost inside the timed interval, subtracted from the core's figure; what it
    adds to the caller's time in all, subtracted from `schedule()`'s). Subtracting the whole cost
    from the recorded intervals would take away more than they hold. Each figure is the median over
    `batches` batches of n/batches calls, so that the other processes of a shared machine (one
    descheduling inflates a batch) do not inflate it (a single 20,000-call batch once gave medians of
    0 at 10 tenants)."""
    acc = [0.0, 0]

    def noop():
        return None

    def wrapped():
        t0 = time.perf_counter()
        try:
            return noop()
        finally:
            acc[0] += time.perf_counter() - t0
            acc[1] += 1

    per = max(1, n // batches)
    recorded, whole = [], []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per):
            noop()
        bare = time.perf_counter() - t0
        acc[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(per):
            wrapped()
        w = max(0.0, (time.perf_counter() - t0 - bare) / per)
        whole.append(w)
        recorded.append(max(0.0, min((acc[0] - bare) / per, w)))  # (the call itself is the callee's)
    return statistics.median(recorded), statistics.median(whole)


def _commit(sched: Scheduler, chunks) -> None:
    """What the engine does after the forward pass, without one: tokens computed, one output token
    committed (and charged) per finished prefill or decode, requests at max_tokens finished."""
    for c in chunks:
        s = c.seq
        s.num_computed_tokens += c.num_tokens
        if s.num_computed_tokens == s.num_tokens:
            s.output_token_ids.append(7)
            sched.policy.charge(s.tenant_id, 2.0, output_tokens=1, request_id=s.request_id)
            if len(s.output_token_ids) >= s.max_tokens:
                sched.finish(s, FinishReason.LENGTH)


def sc3(repeats: int = 5) -> list[str]:
    """Case SC3 on the reference engine with the random tiny model on this machine (wall seconds):
    `chat`'s TTFT alone, then beside `bulk`'s 30 streams holding every one of 30 running slots
    (1536 output tokens each); `repeats` chat requests each way. Returns the printed lines."""
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sequence import SamplingParams
    from worker.models import load_model

    model = load_model("random-tiny", progress=False)
    engine = Engine(model, EngineConfig(max_running=30, kv_cache_mb=256))
    firsts: dict[str, tuple[float, int]] = {}

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def chat(i: int) -> tuple[float, int]:
        rid = f"chat-{i}"

        def on_output(o):
            if o.token_ids and rid not in firsts:
                firsts[rid] = (o.timings.first_token_s, o.timings.first_token_iterations)

        engine.add_request(rid, "chat", [300 + i] + list(range(1, 20)), params(16), on_output, tier="interactive")
        while rid not in firsts:
            engine.step()
        return firsts[rid]

    for _ in range(20):  # warm-up
        engine.add_request(f"warm-{_}", "warm", list(range(1, 21)), params(4), lambda o: None)
        while engine.scheduler.has_work():
            engine.step()
    idle = [chat(i) for i in range(repeats)]
    while engine.scheduler.has_work():
        engine.step()
    # long enough to outlast the tier grace (the background fills every slot only once chat has been
    # idle for `tier_grace_iterations`: worker/scheduling/decode_share.py)
    for b in range(30):
        engine.add_request(f"bulk-{b}", "bulk", [500 + b] + list(range(1, 32)), params(1536), lambda o: None,
                           tier="background")
    while len(engine.scheduler.running) < 30:
        if not engine.step():
            raise RuntimeError("bulk never held all 30 running slots")
    busy = []
    for i in range(repeats):
        busy.append(chat(100 + i))
        while any(s.tenant_id == "chat" for s in engine.scheduler.by_id.values()):
            engine.step()
    snap = engine.snapshot()
    engine.shutdown()

    def fmt(xs):
        return (f"TTFT median {statistics.median(x[0] for x in xs):.3f} s (max {max(x[0] for x in xs):.3f} s), "
                f"{max(x[1] for x in xs)} iteration(s) at most")

    return [f"SC3 on the reference engine (random-tiny, this machine, {repeats} chat requests each):",
            f"  chat alone:                          {fmt(idle)}",
            f"  chat beside 30 bulk streams (30 slots): {fmt(busy)}; tier preemptions "
            f"{snap['preemptions_by_reason']['tier']}"]


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare bench scheduler`; prints the figures."""
    p = argparse.ArgumentParser(prog="fairshare bench scheduler", description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=100)
    p.add_argument("--waiting", type=int, default=1000)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3, help="steady states per figure (seeds 0..N-1)")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--policy", default="vtc", choices=["vtc", "vtc-pred", "drr", "fcfs"])
    p.add_argument("--lower-tier-token-target", type=int, default=DEFAULT_LOWER_TIER_TOKEN_TARGET, metavar="N",
                   help=f"the worker's flag of that name (default {DEFAULT_LOWER_TIER_TOKEN_TARGET}; 0: no limit)")
    p.add_argument("--sc3", action="store_true", help="also case SC3's TTFT in seconds on the reference engine "
                   "(random-tiny): chat alone and beside 30 background streams holding every slot")
    p.add_argument("--growth", action=argparse.BooleanOptionalAction, default=True,
                   help="also print how the time grows with tenants and with waiting requests (default on)")
    args = p.parse_args(argv)
    print(f"scheduling core, policy {args.policy}, {args.max_running} running slots, chunk 512, 3 tiers, "
          f"lower-tier token target {args.lower_tier_token_target or 'off'}; "
          f"{args.repeats} x {args.iterations} iterations after 100 of warm-up each; ms per iteration (median / p99)")

    def line(tenants: int, waiting: int) -> dict:
        r = {"core": [], "schedule": []}
        for seed in range(args.repeats):  # several steady states: the median of all their iterations
            one = run(tenants, waiting, iterations=args.iterations, max_running=args.max_running, policy=args.policy,
                      seed=seed, lower_tier_token_target=args.lower_tier_token_target or None)
            r["core"] += one["core"]
            r["schedule"] += one["schedule"]
            r["running"], r["preempted"] = one["running"], one["preempted"]
        print(f"  {tenants:>5} tenants {waiting:>6} waiting: core {statistics.median(r['core']):6.3f} / "
              f"{_p(r['core'], 0.99):6.3f} ms   schedule() {statistics.median(r['schedule']):6.3f} / "
              f"{_p(r['schedule'], 0.99):6.3f} ms   ({r['running']} running, {r['preempted']} preemptions)",
              flush=True)
        return r

    r = line(args.tenants, args.waiting)
    med = statistics.median(r["core"])
    print(f"goal: core <= 0.2 ms per iteration at {args.waiting} waiting over {args.tenants} tenants: "
          f"{'MET' if med <= 0.2 else 'NOT MET'} ({med:.3f} ms median)")
    if args.growth:
        print("growth with tenants (1,000 waiting):")
        for t in (10, 100, 1000):
            line(t, 1000)
        print("growth with waiting requests (100 tenants):")
        for w in (100, 1000, 10000):
            line(100, w)
    if args.sc3:
        for text in sc3():
            print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
