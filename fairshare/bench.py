"""`fairshare bench`: benchmarks that print figures (never timed assertions in tests).

    fairshare bench engine  [--model smollm2] [--batches 1,8,32] [--new-tokens 64] [--prompt-len 16]
    fairshare bench gateway [...]   (see gateway/bench.py)
    fairshare bench cache [...]     (prefix-cache hit rates by isolation mode; worker/cache/bench.py)
    fairshare bench sidechannel [...]  (CI2 TTFT timing side channel; loadtests/sidechannel.py)
    fairshare bench recovery [...]  (`fairshare up` healing a kill -9; fairshare/recovery_bench.py)
    fairshare bench chaos [--minutes 10] [...]  (mixed load while Redis, a worker and the gateway are
                                      killed at random; outcomes and leaks; fairshare/chaos_bench.py)
    fairshare bench grammar [...]   (cost of grammar-constrained decoding; worker/engine/grammar_bench.py)
    fairshare bench scheduler [...]    (the scheduling core's decision time per iteration; worker/sim/sched_bench.py)
    fairshare bench weights [...]      (what a weight means when nobody queues, and its cost; worker/sim/weights_bench.py)

`engine`: decode throughput of the reference engine (continuous batching, paged KV) at each batch
size, and in the same run transformers' `generate` at static batch 8 on the same weights; prints
output tokens per second (output tokens / wall seconds, prompts of --prompt-len tokens, every
sequence generating exactly --new-tokens tokens) and the ratio engine/transformers at batch 8.
"""

from __future__ import annotations

import argparse
import sys
import time


def _engine_tok_s(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sequence import SamplingParams

    engine = Engine(model, EngineConfig(policy="vtc", max_running=max(batch, 1), kv_cache_mb=512))
    done: list[int] = []

    def on_output(out):
        if out.finish_reason is not None:
            done.append(out.completion_tokens)

    start = time.perf_counter()
    for i in range(batch):
        prompt = [(17 * i + 3 * j) % 1000 + 100 for j in range(prompt_len)]
        engine.add_request(f"bench-{batch}-{i}", f"t{i % 2}", prompt,
                           SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), on_output)
    while len(done) < batch:
        engine.step()
    elapsed = time.perf_counter() - start
    return sum(done) / elapsed


def _hf_tok_s(hf_model, batch: int, prompt_len: int, new_tokens: int) -> float:
    import torch

    ids = torch.tensor([[(17 * i + 3 * j) % 1000 + 100 for j in range(prompt_len)] for i in range(batch)])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - prompt_len) * batch / elapsed


def bench_engine(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fairshare bench engine")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    import torch

    from worker.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    print(f"model {model.name}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per sequence, greedy, fp32")
    results = {}
    _engine_tok_s(model, 1, args.prompt_len, 4)  # warm-up
    for b in [int(x) for x in args.batches.split(",")]:
        results[b] = _engine_tok_s(model, b, args.prompt_len, args.new_tokens)
        print(f"fairshare engine  batch {b:>3}: {results[b]:8.1f} output tok/s", flush=True)
    hf = model.to_hf_model().eval()
    _hf_tok_s(hf, 1, args.prompt_len, 4)  # warm-up
    hf_tps = _hf_tok_s(hf, args.hf_batch, args.prompt_len, args.new_tokens)
    print(f"transformers generate, static batch {args.hf_batch}: {hf_tps:8.1f} output tok/s")
    if args.hf_batch in results:
        print(f"ratio engine/transformers at batch {args.hf_batch}: {results[args.hf_batch] / hf_tps:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare bench`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fairshare bench {engine|gateway|cache|sidechannel|recovery|grammar|chaos|scheduler|weights} [options]")
        return 0 if argv else 2
    what, rest = argv[0], argv[1:]
    if what == "engine":
        return bench_engine(rest)
    if what == "gateway":
        from gateway.bench import main as gateway_bench

        return int(gateway_bench(rest) or 0)
    if what == "cache":
        from worker.cache.bench import main as cache_bench

        return cache_bench(rest)
    if what == "weights":
        from worker.sim.weights_bench import main as weights_bench

        return weights_bench(rest)
    if what == "scheduler":
        from worker.sim.sched_bench import main as scheduler_bench

        return scheduler_bench(rest)
    if what == "sidechannel":
        from loadtests.sidechannel import main as sidechannel_bench

        return sidechannel_bench(rest)
    if what == "recovery":
        from fairshare.recovery_bench import main as recovery_bench

        return recovery_bench(rest)
    if what == "chaos":
        from fairshare.chaos_bench import main as chaos_bench

        return chaos_bench(rest)
    if what == "grammar":
        from worker.engine.grammar_bench import main as grammar_bench

        return grammar_bench(rest)
    print(f"fairshare bench: unknown benchmark {what!r}", file=sys.stderr)
    return 2
