"""`fairshare bench grammar`: the throughput cost of grammar-constrained decoding in the reference engine.

    fairshare bench grammar [--model smollm2|random-tiny|DIR] [--batch 8] [--constrained 4]
                            [--new-tokens 64] [--prompt-len 16] [--repeats 3] [--threads N]

Runs the same batch twice per repeat, alternating: every sequence free, then `--constrained` of them
constrained by a JSON Schema (an array of at least 1000 small objects with enums, bounded strings and
numbers, so no answer can finish inside the budget and every sequence generates exactly
`--new-tokens` tokens, like the free ones with ``ignore_eos``). Prints output tokens per second of
both (median over the repeats), the relative cost, the added time per constrained token (mask fill,
the JSON control-character mask, applying it, advancing the matcher), and the grammar's compile time
(first and cached). Prompts of `--prompt-len` tokens; sampling at temperature 1 with fixed seeds.

Each figure is given per wall-clock second and per CPU second of this process (`time.process_time`):
on a machine shared with other work the CPU-second figure is the steadier one (other processes'
load stretches wall time, not this process's CPU time); with ``--threads 1`` the two agree on an idle
machine (several torch threads may spin while waiting, which CPU time counts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                         "kind": {"enum": ["alpha", "beta", "gamma"]},
                                         "label": {"type": "string", "maxLength": 12},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "kind", "label", "ok"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}


def _run(engine, batch: int, constrained: int, grammar, prompt_len: int, new_tokens: int,
         tag: str) -> tuple[float, float]:
    """(output tokens per wall second, per CPU second) of one batch run to the end."""
    from worker.engine.sequence import SamplingParams

    done: list[int] = []

    def on_output(out):
        if out.finish_reason is not None:
            done.append(out.completion_tokens)

    start, cpu = time.perf_counter(), time.process_time()
    for i in range(batch):
        prompt = [(17 * i + 3 * j) % 1000 + 100 for j in range(prompt_len)]
        sp = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, ignore_eos=True,
                            grammar=grammar if i < constrained else None)
        engine.add_request(f"{tag}-{i}", f"t{i % 2}", prompt, sp, on_output)
    while len(done) < batch:
        engine.step()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if sum(done) != batch * new_tokens:
        raise RuntimeError(f"expected {batch * new_tokens} tokens, got {sum(done)}: a sequence ended early")
    return sum(done) / elapsed, sum(done) / cpu


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare bench grammar`; returns the exit code."""
    p = argparse.ArgumentParser(prog="fairshare bench grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--constrained", type=int, default=None, help="constrained sequences (default: half the batch)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    constrained = args.batch // 2 if args.constrained is None else args.constrained
    if not 0 <= constrained <= args.batch or args.batch < 1 or args.new_tokens < 1 or args.repeats < 1:
        p.error("need batch >= 1, 0 <= constrained <= batch, new-tokens >= 1, repeats >= 1")
    from importlib.metadata import version

    import torch

    from worker.engine.engine import Engine, EngineConfig
    from worker.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    engine = Engine(model, EngineConfig(policy="vtc", max_running=max(args.batch, 1), kv_cache_mb=512))
    t0 = time.perf_counter()
    grammar = engine.compile_grammar("json_schema", json.dumps(SCHEMA))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.compile_grammar("json_schema", json.dumps(SCHEMA))
    cached = time.perf_counter() - t0
    print(f"model {model.name}; torch {torch.__version__}, {torch.get_num_threads()} threads; xgrammar "
          f"{version('xgrammar')}; batch {args.batch}, {constrained} constrained (JSON Schema), prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens per sequence, temperature 1, fp32")
    print(f"grammar compile: {first * 1000:.0f} ms the first time (vocabulary tables included), "
          f"{cached * 1000:.2f} ms cached")
    _run(engine, args.batch, constrained, grammar, args.prompt_len, 4, "warm")  # warm-up
    free, mixed = [], []
    for r in range(args.repeats):
        free.append(_run(engine, args.batch, 0, None, args.prompt_len, args.new_tokens, f"free{r}"))
        mixed.append(_run(engine, args.batch, constrained, grammar, args.prompt_len, args.new_tokens, f"mixed{r}"))
        print(f"  repeat {r + 1}: free {free[-1][0]:7.1f} tok/s ({free[-1][1]:7.1f} per CPU s)   {constrained}/"
              f"{args.batch} constrained {mixed[-1][0]:7.1f} tok/s ({mixed[-1][1]:7.1f} per CPU s)", flush=True)
    tokens = args.batch * args.new_tokens
    for unit, k in (("wall second", 0), ("CPU second", 1)):
        f, m = statistics.median(x[k] for x in free), statistics.median(x[k] for x in mixed)
        extra_ms = (tokens / m - tokens / f) * 1000 / max(1, constrained * args.new_tokens)
        print(f"per {unit:<11}: unconstrained {f:8.1f} output tok/s, {constrained}/{args.batch} constrained "
              f"{m:8.1f} (medians of {args.repeats}): cost {(1 - m / f) * 100:5.1f} % "
              f"(~{extra_ms:.2f} ms per constrained token)")
    return 0
