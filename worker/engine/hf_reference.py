"""Baseline measurements: transformers `generate` (static batch) against our `ModelRunner`.

Both are measured the same way: greedy decoding of random prompts of `prompt_len` tokens; the
wall time of every decode step after the prefill is recorded (for `generate`, through a streamer
whose `put` is called once per step). Runs alternate between the two for `rounds` rounds, and
tokens/s are reported from the median step time and from the fastest step (the latter is the
more stable figure on a shared, noisy machine). `--clock cpu` times steps in CPU seconds of the
calling thread instead of wall seconds: with `--threads 1` that measures the work a step costs,
whatever else the machine runs.

    python -m worker.engine.hf_reference --model smollm2 --batches 1,8,32 --hf-batches 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from worker.engine.model_runner import ForwardItem, ModelRunner

__all__ = ["hf_generate", "hf_decode_step_times", "runner_decode_step_times"]


def _prompts(model, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(model.config.vocab_size, 20000)
    return [[rng.randrange(100, hi) for _ in range(prompt_len)] for _ in range(batch)]


clock = time.perf_counter  # or time.thread_time (see --clock)


class _StepClock:
    """A `generate` streamer that only records when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(clock())

    def end(self) -> None:
        pass


def hf_generate(hf_model, prompts: list[list[int]], new_tokens: int, pad_token_id: int = 0,
                streamer=None) -> torch.Tensor:
    """Greedy `generate` of exactly `new_tokens` tokens for equal-length prompts; returns [B, P+N] ids."""
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        return hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id,
                                 streamer=streamer)


def hf_decode_step_times(hf_model, model, batch: int, prompt_len: int = 64, new_tokens: int = 64) -> list[float]:
    """Seconds per decode step of transformers `generate` at static `batch` (prefill excluded)."""
    prompts = _prompts(model, batch, prompt_len)
    clock = _StepClock()
    hf_generate(hf_model, prompts, new_tokens + 1, streamer=clock)
    # put #0: the prompt; put #1: first token (after the prefill); then one put per decode step
    t = clock.times[1:]
    return [b - a for a, b in zip(t, t[1:])]


def runner_decode_step_times(runner: ModelRunner, model, batch: int, prompt_len: int = 64,
                             new_tokens: int = 64) -> list[float]:
    """Seconds per decode step of `runner` with `batch` sequences decoding together (greedy)."""
    bs = runner.block_size
    per_seq = -(-(prompt_len + new_tokens + 1) // bs)
    if per_seq * batch > runner.num_kv_blocks:
        raise ValueError("the runner's KV pool is too small for this measurement")
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = _prompts(model, batch, prompt_len)
    out = runner.forward([ForwardItem(p, 0, t) for p, t in zip(prompts, tables)])
    nxt = out.argmax(-1).tolist()
    length = prompt_len
    times = []
    for _ in range(new_tokens):
        t = clock()
        out = runner.forward([ForwardItem([nxt[i]], length, tables[i]) for i in range(batch)])
        nxt = out.argmax(-1).tolist()
        times.append(clock() - t)
        length += 1
    return times


def main(argv: list[str] | None = None) -> None:
    from worker.models import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,8,32", help="runner batch sizes")
    ap.add_argument("--hf-batches", default="8", help="transformers generate batch sizes ('' for none)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args(argv)
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    batches = [int(b) for b in args.batches.split(",") if b]
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    per_seq = -(-(args.prompt_len + args.new_tokens + 1) // 16)
    runner = ModelRunner(model, num_kv_blocks=per_seq * max(batches + [1]), block_size=16, device=args.device)
    hf = model.to_hf_model() if hf_batches else None
    print(f"model {model.name}, {torch.get_num_threads()} threads, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} decode steps x {args.rounds} rounds, {args.clock} clock", flush=True)
    runs = [(f"runner batch {b}", b, lambda b=b: runner_decode_step_times(runner, model, b, args.prompt_len,
                                                                           args.new_tokens)) for b in batches]
    runs += [(f"transformers generate batch {b}", b, lambda b=b: hf_decode_step_times(hf, model, b, args.prompt_len,
                                                                                       args.new_tokens))
             for b in hf_batches]
    steps: dict[str, list[float]] = {key: [] for key, _, _ in runs}
    for _ in range(args.rounds):
        for key, _, fn in runs:
            steps[key].extend(fn())
    print(f"  {'':34s} {'median':>8s} {'best':>8s}  (tok/s, all sequences together)")
    for key, b, _ in runs:
        t = steps[key]
        print(f"  {key:34s} {b / statistics.median(t):8.1f} {b / min(t):8.1f}")


if __name__ == "__main__":
    main()
