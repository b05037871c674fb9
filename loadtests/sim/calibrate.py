"""Fit the simulator's iteration time model from the real runner on this machine.

`calibrate(model_spec, device)` times `ModelRunner.forward` over a grid of batch shapes (prefill
chunks alone, decode batches at several context lengths, and mixed steps), then fits
`t = a + b·prefill_tokens + c·batch_size + d·context_tokens` by least squares on *relative*
errors (each row weighted by 1/t, so small decode steps count as much as big prefill steps) with
non-negative coefficients (a coefficient that comes out negative is fixed at 0 and the rest are
refitted). Each shape is timed `repeats` times after a warm-up and the fastest time is used (on a machine
shared with other jobs the minimum is the least disturbed estimate).
Prints every measurement and the fit's relative error. Needs torch (the real runner).
"""

from __future__ import annotations

import statistics
import time

from loadtests.sim.runner import IterationTimeModel, batch_shape

DEFAULT_GRID = {
    "prefill": [16, 64, 128, 256, 512],
    "decode_batch": [1, 4, 16, 32, 64],
    "decode_context": [64, 512, 1024],
    "mixed": [(256, 16, 256), (128, 32, 512), (384, 8, 1024)],  # (prefill tokens, decodes, context)
}


def _fit_nonneg(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares of relative errors with coefficients clamped at >= 0 (active set by refit)."""
    import numpy as np

    y = np.array(ys, dtype=float)
    x = np.array(rows, dtype=float) / y[:, None]
    y = np.ones_like(y)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(v) for v in coef]


def calibrate(model_spec: str = "random-tiny", device: str = "cpu", repeats: int = 5, threads: int | None = None,
              grid: dict | None = None, verbose: bool = True) -> tuple[IterationTimeModel, list[dict]]:
    """Time the real runner and fit the model. Returns (model, measurements); each measurement
    is {prefill_tokens, batch_size, context_tokens, seconds}. Raises whatever loading the model does."""
    import torch

    from worker.engine.model_runner import ForwardItem, ModelRunner
    from worker.models import load_model

    if threads:
        torch.set_num_threads(threads)
    grid = grid or DEFAULT_GRID
    model = load_model(model_spec, progress=verbose)
    block = 16
    max_ctx = max(grid["decode_context"] + [m[2] for m in grid["mixed"]] + grid["prefill"]) + 16
    per_seq_blocks = -(-max_ctx // block)
    max_batch = max(grid["decode_batch"] + [m[1] + 1 for m in grid["mixed"]])
    runner = ModelRunner(model, num_kv_blocks=per_seq_blocks * (max_batch + 1), block_size=block, device=device)
    vocab = runner.vocab_size

    def table(i: int) -> list[int]:
        return list(range(i * per_seq_blocks, (i + 1) * per_seq_blocks))

    def items_for(prefill: int, decodes: int, context: int) -> list:
        items = []
        if prefill:
            items.append(ForwardItem([(7 * j) % (vocab - 1) + 1 for j in range(prefill)], 0, table(0)))
        for i in range(decodes):
            items.append(ForwardItem([(13 * i) % (vocab - 1) + 1], context, table(i + 1)))
        return items

    def sync() -> None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()

    shapes = [(p, 0, 0) for p in grid["prefill"]]
    shapes += [(0, b, c) for b in grid["decode_batch"] for c in grid["decode_context"]]
    shapes += list(grid["mixed"])
    measurements = []
    for prefill, decodes, context in shapes:
        items = items_for(prefill, decodes, context)
        runner.forward(items)  # warm-up
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(items)
            sync()
            times.append(time.perf_counter() - t0)
        p, b, c = batch_shape(items)
        m = {"prefill_tokens": p, "batch_size": b, "context_tokens": c, "seconds": min(times)}
        measurements.append(m)
        if verbose:
            print(f"  prefill={p:5d} batch={b:3d} context={c:6d}: {m['seconds'] * 1e3:8.2f} ms", flush=True)
    rows = [[1.0, m["prefill_tokens"], m["batch_size"], m["context_tokens"]] for m in measurements]
    a, b, c, d = _fit_nonneg(rows, [m["seconds"] for m in measurements])
    threads_used = torch.get_num_threads()
    source = f"calibrated: {model.name}, {device}" + (f", {threads_used} threads" if runner.device.type == "cpu" else "")
    fitted = IterationTimeModel(a, b, c, d, source)
    if verbose:
        errs = [abs(fitted.step_time(m["prefill_tokens"], m["batch_size"], m["context_tokens"]) - m["seconds"])
                / m["seconds"] for m in measurements]
        print(f"fit: {fitted.describe()}\n     mean relative error {statistics.mean(errs) * 100:.1f}%, "
              f"max {max(errs) * 100:.1f}%")
    return fitted, measurements
