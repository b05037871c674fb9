"""The reference engine on a GPU: throughput, the two-tenant VTC vs FCFS split, scheduler overhead.

Run by deploy/gpu/reference-check.sh (`bash deploy/gpu/reference-check.sh` in the repo root on a
node with torch + CUDA; no internet, no model files: the model is a randomly initialised Llama built
from a config in process). Also runs on CPU with `--preset tiny --device cpu` (tests do that).

What it prints:
1. tokens/s at batch 1, 16 and 64 (`--batches`): that many requests of `--prompt-len` prompt tokens
   and `--output-len` output tokens (ignore_eos), submitted together; output tokens/s and total
   (prompt + output) tokens/s over the wall time from submission to the last token;
2. the two-tenant service split under overload, for VTC and for FCFS: tenant `heavy` keeps
   `--heavy-share`x as many requests queued as tenant `light`; both stay backlogged during a window
   of `--fair-iters` engine iterations; the service each received in that window (units
   `α·P + β·O`, α=1, β=2), its share, and the max |service difference|;
3. scheduler time per iteration (ms in `Scheduler.schedule`) and the whole step time, from the
   throughput runs.

Drives `worker.engine.engine.Engine` synchronously with `Engine.step()` (no engine thread) and a
`worker.engine.model_runner.ModelRunner` on `--device` (bf16 on CUDA, fp32 on CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script

PRESETS = {
    # ~0.85B parameters: Llama-style 2048 hidden, 16 layers, GQA 32/8 heads, SwiGLU 5632, vocab 32000
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=1024),
}


def build_model(preset: str, seed: int = 0):
    """A `LoadedModel` with seeded random weights for a preset config (no tokenizer: no text)."""
    from worker.models import LoadedModel, ModelConfig, build_random_llama

    hf = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              hidden_act="silu", bos_token_id=1, eos_token_id=2, **PRESETS[preset])
    config = ModelConfig.from_hf_dict(hf)
    return LoadedModel(name=f"random-llama-{preset}", config=config, state_dict=build_random_llama(hf, seed),
                       tokenizer=None, tokenizer_json="", chat_template="", eos_token_ids=[], bos_token="",
                       eos_token="", max_context_tokens=config.max_position_embeddings, model_dir=None,
                       hf_config_dict=hf)


class Timed:
    """Wraps the engine's `scheduler.schedule` to time it."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.total = 0.0
        self.calls = 0

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.total += time.perf_counter() - t
            self.calls += 1


def make_engine(model, runner, policy: str, max_running: int, chunk: int):
    from worker.engine.engine import Engine, EngineConfig

    cfg = EngineConfig(policy=policy, max_num_batched_tokens=chunk, max_running=max_running,
                       block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks, device=str(runner.device))
    engine = Engine(model, cfg, runner=runner)
    timer = Timed(engine.scheduler.schedule)
    engine.scheduler.schedule = timer
    return engine, timer


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def throughput(model, runner, batch: int, prompt_len: int, output_len: int, chunk: int, device: str, seed: int):
    """Run `batch` requests to completion; returns a dict of figures."""
    import random

    from worker.engine.sequence import SamplingParams

    rng = random.Random(seed)
    engine, timer = make_engine(model, runner, "vtc", max(batch, 1), chunk)
    done = {"n": 0, "tokens": 0}

    def on_output(out):
        done["tokens"] += len(out.token_ids)
        if out.finish_reason is not None:
            done["n"] += 1

    vocab = model.config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", f"t{i % 2}", prompt, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                                        ignore_eos=True), on_output)
    _sync(device)
    t0 = time.perf_counter()
    steps = 0
    while done["n"] < batch:
        if not engine.step():
            raise RuntimeError("engine idle before all requests finished")
        steps += 1
    _sync(device)
    wall = time.perf_counter() - t0
    return {"batch": batch, "wall_s": wall, "steps": steps, "output_tokens": done["tokens"],
            "output_tok_s": done["tokens"] / wall, "total_tok_s": (done["tokens"] + batch * prompt_len) / wall,
            "sched_ms": 1e3 * timer.total / max(timer.calls, 1), "step_ms": 1e3 * wall / max(steps, 1)}


def fairness(model, runner, policy: str, args) -> dict:
    """Two tenants under overload; service each receives in a window of `fair_iters` iterations."""
    import random

    from worker.engine.sequence import SamplingParams

    rng = random.Random(args.seed)
    engine, _ = make_engine(model, runner, policy, args.fair_max_running, args.chunk)
    vocab = model.config.vocab_size
    counter = {"heavy": 0, "light": 0}
    live = {"heavy": 0, "light": 0}
    target = {"heavy": args.heavy_share * args.fair_queue, "light": args.fair_queue}

    def submit(tenant: str) -> None:
        def on_output(out, t=tenant):
            if out.finish_reason is not None:
                live[t] -= 1

        counter[tenant] += 1
        live[tenant] += 1
        prompt = [rng.randrange(3, vocab) for _ in range(args.fair_prompt_len)]
        engine.add_request(f"{tenant}-{counter[tenant]}", tenant, prompt,
                           SamplingParams(max_tokens=args.fair_output_len, temperature=0.0, ignore_eos=True),
                           on_output)

    def top_up() -> None:  # keep each tenant's queue at its target: both continuously backlogged
        for t in ("heavy", "light"):  # heavy first: under FCFS its requests are always ahead
            while live[t] < target[t]:
                submit(t)

    top_up()
    for _ in range(args.fair_warmup):
        engine.step()
        top_up()
    accounts = engine.policy.accounts
    start = {t: accounts[t].charged_service for t in ("heavy", "light")}
    for _ in range(args.fair_iters):
        engine.step()
        top_up()
    service = {t: accounts[t].charged_service - start[t] for t in ("heavy", "light")}
    total = sum(service.values()) or 1.0
    engine.shutdown()
    return {"policy": policy, "service": service, "share": {t: s / total for t, s in service.items()},
            "diff": abs(service["heavy"] - service["light"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (prefill chunk)")
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--fair-iters", type=int, default=300)
    p.add_argument("--fair-warmup", type=int, default=50)
    p.add_argument("--fair-queue", type=int, default=16, help="requests the light tenant keeps queued")
    p.add_argument("--heavy-share", type=int, default=4, help="heavy keeps this many times light's queue")
    p.add_argument("--fair-max-running", type=int, default=32)
    p.add_argument("--fair-prompt-len", type=int, default=256)
    p.add_argument("--fair-output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from worker.engine.model_runner import ModelRunner

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("reference-check: CUDA is not available", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = build_model(args.preset, args.seed)
    n_params = sum(t.numel() for t in model.state_dict.values())
    runner = ModelRunner(model, num_kv_blocks=args.kv_blocks, block_size=args.block_size, device=args.device)
    model.state_dict.clear()  # the runner holds its own (device) copies
    _sync(args.device)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"reference-check: {model.name} ({n_params / 1e6:.1f} M parameters), "
          f"{runner.dtype}, device {dev}; built in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"torch {torch.__version__}; KV pool {args.kv_blocks} blocks x {args.block_size} tokens; "
          f"prefill chunk {args.chunk} tokens", flush=True)

    throughput(model, runner, 2, min(args.prompt_len, 32), 4, args.chunk, args.device, args.seed)  # warm-up
    print("\n== throughput (prompt %d, output %d tokens per request, greedy) ==" % (args.prompt_len, args.output_len))
    print(f"{'batch':>5} {'output tok/s':>13} {'total tok/s':>12} {'wall s':>8} {'steps':>6} "
          f"{'step ms':>8} {'sched ms/iter':>14}")
    sched = []
    for b in [int(x) for x in args.batches.split(",") if x]:
        r = throughput(model, runner, b, args.prompt_len, args.output_len, args.chunk, args.device, args.seed)
        sched.append(r)
        print(f"{r['batch']:>5} {r['output_tok_s']:>13.1f} {r['total_tok_s']:>12.1f} {r['wall_s']:>8.2f} "
              f"{r['steps']:>6} {r['step_ms']:>8.2f} {r['sched_ms']:>14.3f}", flush=True)
    
    print(f"\n== two tenants under overload: heavy keeps {args.heavy_share}x light's queue "
          f"({args.heavy_share * args.fair_queue} vs {args.fair_queue} requests of {args.fair_prompt_len}+"
          f"{args.fair_output_len} tokens), equal weights, {args.fair_iters} iterations measured ==")
    print("service units: 1*prompt + 2*output tokens computed in the window")
    print(f"{'policy':>6} {'heavy':>10} {'light':>10} {'heavy %':>8} {'light %':>8} {'|diff|':>10}")
    for policy in ("vtc", "fcfs"):
        f = fairness(model, runner, policy, args)
        print(f"{policy:>6} {f['service']['heavy']:>10.0f} {f['service']['light']:>10.0f} "
              f"{100 * f['share']['heavy']:>7.1f}% {100 * f['share']['light']:>7.1f}% {f['diff']:>10.0f}", flush=True)
    
    total_steps = sum(r["steps"] for r in sched) or 1
    mean_sched = sum(r["sched_ms"] * r["steps"] for r in sched) / total_steps
    print(f"\n== scheduler time per iteration: {mean_sched:.3f} ms mean over {total_steps} iterations "
          f"(per batch size above) ==")
    print(f"reference-check: done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
