"""`fairshare bench weights`: what a weight means when nobody queues, and what it costs.

Two tenants of weight 1 and 3 each keep `--inflight` requests in flight (a closed loop: a new
request as soon as one ends), `--prompt`/`--output` tokens each, on an engine with `--max-running`
slots (64, the default worker's: every request runs and nothing queues). For each iteration token
target (`--targets`; `default` = the token budget, the worker's default) it prints the service split
weight-3 : weight-1 over the steady state and the output tokens per second, on

- the simulator (the real engine loop and scheduling core on the simulated runner, the CPU time
  model `loadtests/profiles/cpu-random-tiny.json`, virtual seconds), and
- with `--real`, the reference engine with the random tiny model on this machine (wall seconds;
  CPU time is no better on a shared machine: torch's OpenMP threads spin while they wait),

so the throughput cost of each target is read off against the default (docs/fairness.md, "When
nobody queues").
"""

from __future__ import annotations

import argparse
import time

from loadtests.profiles import DEFAULT_PROFILE
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams



def closed_loop(engine: Engine, clock, *, inflight: int, prompt: int, output: int, iterations: int,
                warmup: int) -> dict:
    """Run two tenants (w=1 `light`, w=3 `heavy`) with `inflight` requests each for `warmup` +
    `iterations` steps; returns service units per tenant, output tokens and seconds (on `clock`)
    over the last `iterations` steps."""
    live = {"light": 0, "heavy": 0}
    n = [0]
    counting = [False]
    out = {"light": 0.0, "heavy": 0.0, "tokens": 0}

    def add(tenant: str) -> None:
        n[0] += 1
        live[tenant] += 1

        def on_output(o, tenant=tenant):
            if counting[0]:
                out["tokens"] += len(o.token_ids)
            if o.finish_reason is not None:
                live[tenant] -= 1

        engine.add_request(f"{tenant}-{n[0]}", tenant, [1000 + n[0] % 30000] + [1] * (prompt - 1),
                           SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True), on_output,
                           weight=1.0 if tenant == "light" else 3.0)

    before = {}
    t0 = 0.0
    for step in range(warmup + iterations):
        if step == warmup:
            counting[0] = True
            before = {t: a.charged_service for t, a in engine.policy.accounts.items()}
            t0 = clock()
        for tenant in live:
            while live[tenant] < inflight:
                add(tenant)
        engine.step()
    for tenant in ("light", "heavy"):
        out[tenant] = engine.policy.accounts[tenant].charged_service - before.get(tenant, 0.0)
    out["seconds"] = clock() - t0
    return out


def _line(kind: str, target, r: dict, base: dict | None, unit: str = "output tok/s") -> str:
    ratio = r["heavy"] / max(r["light"], 1e-9)
    tps = r["tokens"] / max(r["seconds"], 1e-9)
    cost = "" if base is None else f"   throughput {tps / (base['tokens'] / base['seconds']) - 1:+.1%} vs default"
    return f"  {kind:<9} target {str(target):>7}: split heavy:light = {ratio:5.2f} : 1   {tps:7.1f} {unit}{cost}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare bench weights`; prints the figures."""
    p = argparse.ArgumentParser(prog="fairshare bench weights", description=__doc__.split("\n\n")[0])
    p.add_argument("--inflight", type=int, default=30)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--targets", default="default,48,32,16")
    p.add_argument("--iterations", type=int, default=600)
    p.add_argument("--real", action="store_true", help="also on the reference engine with the random tiny model")
    p.add_argument("--real-iterations", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3, help="interleaved real-engine runs per target")
    args = p.parse_args(argv)
    targets = [None if t == "default" else int(t) for t in args.targets.split(",")]
    print(f"two tenants, weights 1 and 3, {args.inflight} requests in flight each ({args.prompt} prompt / "
          f"{args.output} output tokens), {args.max_running} running slots (nothing queues)")
    from loadtests.sim.runner import IterationTimeModel, SimModel, SimulatedRunner, VirtualClock

    tm = IterationTimeModel.load(DEFAULT_PROFILE)
    print(f"simulator ({tm.describe()}), {args.iterations} iterations after 100 of warm-up:")
    base = None
    for target in targets:
        clock = VirtualClock()
        cfg = EngineConfig(max_running=args.max_running, num_kv_blocks=4096, iteration_token_target=target)
        engine = Engine(SimModel(), cfg, SimulatedRunner(clock, tm, 4096, 16), clock=clock)
        r = closed_loop(engine, clock, inflight=args.inflight, prompt=args.prompt, output=args.output,
                        iterations=args.iterations, warmup=100)
        print(_line("sim", target or "default", r, base), flush=True)
        base = base or r
    if args.real:
        from worker.models import load_model

        model = load_model("random-tiny", progress=False)
        print(f"reference engine, random-tiny on this machine, {args.real_iterations} iterations after 30 of warm-up, "
              f"{args.repeats} interleaved runs per target (median output tokens per wall second; on a machine "
              "shared with other jobs single runs move with its load: measure on a quiet one)")
        runs: dict = {t: [] for t in targets}
        for _ in range(args.repeats):
            for target in targets:
                cfg = EngineConfig(max_running=args.max_running, kv_cache_mb=256, iteration_token_target=target)
                engine = Engine(model, cfg)
                runs[target].append(closed_loop(engine, time.perf_counter, inflight=args.inflight, prompt=args.prompt,
                                                output=args.output, iterations=args.real_iterations, warmup=30))
        base = None
        for target in targets:
            rs = sorted(runs[target], key=lambda r: r["tokens"] / r["seconds"])
            r = rs[len(rs) // 2]
            print(_line("real", target or "default", r, base), flush=True)
            base = base or r
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
