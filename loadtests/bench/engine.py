"""`fairshare bench engine`: decode throughput of the reference engine, side by side with llama.cpp
and transformers (figures printed, never timed assertions in tests).

    fairshare bench engine  [--model smollm2] [--batches 1,8,32] [--new-tokens 32] [--prompt-len 16]
                            [--threads N] [--dtype auto] [--quantization auto] [--hf-batch 8]
                            [--repeats 3] [--step-threads auto|all] [--llama-cpp auto|off]

`engine`: decode throughput of the reference engine (continuous batching, paged KV) at each batch
size: output tokens per second (output tokens / wall seconds from submission to the last token,
prompts of --prompt-len tokens, every sequence generating exactly --new-tokens tokens, greedy;
the fastest of --repeats runs, with the share of its threads' time the process got),
the bytes of weights read per output token (the runner's linear weights and LM head, or the
screened LM head's 4-bit copy where a greedy step takes it, read once per forward
step, over the batch), the bandwidth that implies, and the engine process's resident memory
(idle after building, and its peak). In the same run, when llama-cpp-python is importable,
llama.cpp runs the same GGUF file with the same thread count through its batched low-level API
(one sequence per request, greedy sampler), so the figures sit side by side; without it the bench
says how to add it. Each engine runs in its own spawned process, so the resident figures are each
engine's own. Last, transformers' `generate` at static batch --hf-batch (0: skip) on the same
weights (fp32), with the ratio to the engine at that batch.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

LLAMA_CPP_HINT = ("llama.cpp: not installed; to compare side by side: pip install llama-cpp-python==0.3.36 "
                  "(builds from source, ~3 minutes on 2 cores)")


def _prompt(i: int, prompt_len: int) -> list[int]:
    return [(17 * i + 3 * j) % 1000 + 100 for j in range(prompt_len)]


def _rss_mb(field: str = "VmRSS") -> float:
    from worker.cli import resident_mb

    if field == "VmRSS":
        return resident_mb()
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024
    except (OSError, StopIteration, ValueError):
        return 0.0


def _best_of(run, repeats: int, threads: int) -> tuple[float, int, float]:
    """Run `run()` -> (tokens, steps) `repeats` times; the fastest as (tok/s, steps, cpu share):
    cpu share = process CPU seconds / (wall seconds x threads), ~1 on a quiet machine (busy-waiting
    thread pools included), lower when other processes took the cores."""
    best = (0.0, 0, 0.0)
    for _ in range(max(1, repeats)):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens, steps = run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if tokens / wall > best[0]:
            best = (tokens / wall, steps, cpu / (wall * threads))
    return best


def _engine_tokens(engine, batch: int, prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """(output tokens, forward steps) for `batch` greedy requests submitted at once."""
    from worker.engine.sequence import SamplingParams

    done: list[int] = []

    def on_output(out):
        if out.finish_reason is not None:
            done.append(out.completion_tokens)

    for i in range(batch):
        engine.add_request(f"bench-{batch}-{i}-{time.monotonic_ns()}", f"t{i % 2}", _prompt(i, prompt_len),
                           SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), on_output)
    steps = 0
    while len(done) < batch:
        steps += engine.step()
    return sum(done), steps


def _ours(params: dict) -> dict:
    """In a child process: build the engine as the worker does, run every batch size."""
    from worker.cli import passive_thread_wait

    passive_thread_wait()  # as `fairshare worker` does, before torch loads (llama.cpp's child keeps its own)
    import torch

    from worker.cli import release_freed_memory, resident_mb_of
    from worker.engine.engine import Engine, EngineConfig
    from worker.models import load_model

    torch.set_num_threads(params["threads"])
    model = load_model(params["model"], progress=False)
    b_max = max(params["batches"])
    engine = Engine(model, EngineConfig(policy="vtc", max_running=b_max, dtype=params["dtype"], prefix_cache=False,
                                        quantization=params["quantization"],
                                        max_model_len=params["prompt_len"] + params["new_tokens"] + 16))
    model.release_weights()
    release_freed_memory()
    runner = engine.runner
    if params.get("step_threads") == "all":
        from worker.engine.step_threads import StepThreads

        runner.step_threads = StepThreads(min_rows=None)
    out = {"format": runner.format.describe(), "weight_bytes": runner.weight_bytes,
           "resident_weight_bytes": runner.resident_weight_bytes, "kv_bytes": runner.kv_cache_bytes,
           "rss_idle_mb": _rss_mb(), "threads": torch.get_num_threads(), "results": {},
           "step_bytes": {b: runner.step_weight_bytes(b, argmax_only=True) for b in params["batches"]},
           "kv_resident_mb": resident_mb_of(runner.kv_cache), "threads_note": runner.step_threads.describe()}
    _engine_tokens(engine, 1, params["prompt_len"], 4)  # warm-up
    for b in params["batches"]:
        out["results"][b] = _best_of(lambda: _engine_tokens(engine, b, params["prompt_len"], params["new_tokens"]),
                                     params["repeats"], params["threads"])
    out["rss_peak_mb"] = _rss_mb("VmHWM")
    return out


def _llama_cpp(params: dict) -> dict:
    """In a child process: llama.cpp (llama-cpp-python's low-level API) on the same GGUF file."""
    import ctypes

    import llama_cpp as L

    from worker.models import smollm2_gguf_path

    quiet = L.llama_log_callback(lambda level, text, user_data: None)  # llama.cpp logs every load to stderr
    L.llama_log_set(quiet, ctypes.c_void_p())
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(smollm2_gguf_path()).encode(), mparams)
    out = {"version": getattr(L, "__version__", "?"), "weight_bytes": int(L.llama_model_size(model)),
           "rss_idle_mb": _rss_mb(), "results": {}}
    t = params["threads"]
    p_len, n_new = params["prompt_len"], params["new_tokens"]

    def run(batch: int, new_tokens: int) -> tuple[int, int]:
        cparams = L.llama_context_default_params()
        cparams.n_ctx = batch * (p_len + new_tokens + 8)
        cparams.n_batch = cparams.n_ubatch = max(batch * p_len, batch)
        cparams.n_seq_max = batch
        cparams.n_threads = cparams.n_threads_batch = t
        ctx = L.llama_init_from_model(model, cparams)
        sampler = L.llama_sampler_init_greedy()
        lb = L.llama_batch_init(batch * p_len, 0, 1)

        def fill(rows: list[tuple[int, int, int, bool]]) -> None:
            lb.n_tokens = len(rows)
            for j, (tok, pos, seq, want) in enumerate(rows):
                lb.token[j], lb.pos[j], lb.n_seq_id[j] = tok, pos, 1
                lb.seq_id[j][0], lb.logits[j] = seq, want

        rows = [(tok, j, i, j == p_len - 1) for i in range(batch) for j, tok in enumerate(_prompt(i, p_len))]
        fill(rows)
        if L.llama_decode(ctx, lb) != 0:
            raise RuntimeError("llama_decode failed (prefill)")
        last = [i * p_len + p_len - 1 for i in range(batch)]
        steps, generated = 1, 0
        while True:
            toks = [L.llama_sampler_sample(sampler, ctx, idx) for idx in last]
            generated += batch
            if generated >= batch * new_tokens:
                break
            pos = p_len + generated // batch - 1
            fill([(tok, pos, i, True) for i, tok in enumerate(toks)])
            if L.llama_decode(ctx, lb) != 0:
                raise RuntimeError("llama_decode failed (decode)")
            last = list(range(batch))
            steps += 1
        L.llama_batch_free(lb)
        L.llama_sampler_free(sampler)
        L.llama_free(ctx)
        return generated, steps

    run(1, 4)  # warm-up
    for b in params["batches"]:
        out["results"][b] = _best_of(lambda: run(b, n_new), params["repeats"], t)
    out["rss_peak_mb"] = _rss_mb("VmHWM")
    L.llama_model_free(model)
    return out


def _thread_wait() -> str:
    """How the engine's OpenMP threads wait at barriers, as the run's environment sets it (the engine's
    child applies `worker.cli.passive_thread_wait`: PASSIVE unless one of the two is set). Figures at
    2 threads differ by more than 2x between the two on an idle machine (docs/engine.md, "Threads")."""
    set_ = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    return "OpenMP waits: " + (", ".join(set_) if set_ else "OMP_WAIT_POLICY=PASSIVE (the worker's default)")


def _in_child(fn, params: dict) -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, (params,))


def _hf_tok_s(hf_model, batch: int, prompt_len: int, new_tokens: int) -> float:
    import torch

    ids = torch.tensor([_prompt(i, prompt_len) for i in range(batch)])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - prompt_len) * batch / elapsed


def _row(name: str, b: int, result: tuple[float, int, float], weight_bytes: int, new_tokens: int) -> str:
    """One result line: tok/s, weight MB read per output token, implied GB/s of weight reads, CPU share,
    and tok/s over the CPU share (output tokens per CPU-second per thread: what the run would reach
    with its threads' cores to itself, if other processes cost it only CPU time, not memory bandwidth
    or cache; comparable between engines measured minutes apart on a shared machine)."""
    tok_s, steps, cpu_share = result
    step_s = (b * new_tokens / tok_s) / max(steps, 1)  # seconds per forward step (wall / steps)
    per_token = weight_bytes / b
    return (f"{name:<17} batch {b:>3}: {tok_s:8.1f} output tok/s  {per_token / 1e6:7.1f} MB weights/token  "
            f"{weight_bytes / step_s / 1e9:6.1f} GB/s  (cpu share {cpu_share:.2f}; "
            f"{tok_s / max(cpu_share, 1e-9):7.1f} tok/s per full share)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare bench engine`; prints the figures, returns 0."""
    p = argparse.ArgumentParser(prog="fairshare bench engine")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--hf-batch", type=int, default=8, help="transformers generate at this static batch (0: skip)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every engine (default: torch's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--repeats", type=int, default=3, help="runs per batch size; the fastest is reported (default 3)")
    p.add_argument("--step-threads", default="auto", choices=["auto", "all"],
                   help="auto: the worker's rule (worker/engine/step_threads.py: with sleeping OpenMP waits a step "
                        "of few token rows runs on one thread); all: every step on every thread, to compare")
    p.add_argument("--llama-cpp", default="auto", choices=["auto", "off"],
                   help="run llama.cpp on the same GGUF when llama-cpp-python is installed (default auto)")
    args = p.parse_args(argv)
    import importlib.util

    import torch

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    params = {"model": args.model, "batches": [int(x) for x in args.batches.split(",")], "threads": threads,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "dtype": args.dtype,
              "quantization": args.quantization, "repeats": args.repeats, "step_threads": args.step_threads}
    print(f"model {args.model}; torch {torch.__version__}; {threads} threads; prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens per sequence, greedy; fastest of {args.repeats} runs per batch size; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {_thread_wait()}", flush=True)
    ours = _in_child(_ours, params)
    print(f"fairshare engine: {ours['format']}; {ours['resident_weight_bytes'] / 2**20:,.0f} MiB of weights held, "
          f"{ours['weight_bytes'] / 2**20:,.0f} MiB read per forward step ({min(ours['step_bytes'].values()) / 2**20:,.0f} "
          f"MiB in greedy steps that take the screened LM head); KV pool {ours['kv_bytes'] / 2**20:,.0f} "
          f"MiB (virtual, lazily resident)", flush=True)
    print(f"fairshare engine: {ours['threads_note']} (worker/engine/step_threads.py)", flush=True)
    for b, result in ours["results"].items():
        print(_row("fairshare engine", b, result, ours["step_bytes"][b], args.new_tokens), flush=True)
    kv_share = ("" if ours["kv_resident_mb"] is None else
                f" (of which the KV pool {ours['kv_resident_mb']:,.0f} MiB, "
                f"{ours['kv_resident_mb'] / max(ours['rss_idle_mb'], 1):.0%})")
    print(f"fairshare engine RSS: {ours['rss_idle_mb']:,.0f} MiB idle after building{kv_share}, "
          f"{ours['rss_peak_mb']:,.0f} MiB peak", flush=True)
    cpp = None
    if args.llama_cpp == "auto" and args.model == "smollm2":
        if importlib.util.find_spec("llama_cpp") is None:
            print(LLAMA_CPP_HINT, flush=True)
        else:
            cpp = _in_child(_llama_cpp, params)
            print(f"llama.cpp (llama-cpp-python {cpp['version']}, same GGUF, {threads} threads, batched low-level "
                  f"API): {cpp['weight_bytes'] / 2**20:,.0f} MiB of weights", flush=True)
            for b, result in cpp["results"].items():
                print(_row("llama.cpp", b, result, cpp["weight_bytes"], args.new_tokens), flush=True)
            print(f"llama.cpp RSS: {cpp['rss_idle_mb']:,.0f} MiB idle after loading, {cpp['rss_peak_mb']:,.0f} MiB "
                  f"peak", flush=True)
            for b in params["batches"]:
                (a, _, sa), (c, _, sc) = ours["results"][b], cpp["results"][b]
                print(f"ratio fairshare/llama.cpp at batch {b:>3}: {a / c:.2f}x wall, "
                      f"{(a / max(sa, 1e-9)) / (c / max(sc, 1e-9)):.2f}x per full CPU share", flush=True)
    if args.hf_batch:
        from worker.models import load_model

        hf = load_model(args.model, progress=False).to_hf_model().eval()
        _hf_tok_s(hf, 1, args.prompt_len, 4)  # warm-up
        hf_tps = _hf_tok_s(hf, args.hf_batch, args.prompt_len, args.new_tokens)
        print(f"transformers generate (fp32), static batch {args.hf_batch}: {hf_tps:8.1f} output tok/s")
        if args.hf_batch in ours["results"]:
            print(f"ratio engine/transformers at batch {args.hf_batch}: "
                  f"{ours['results'][args.hf_batch][0] / hf_tps:.2f}x")
    return 0
