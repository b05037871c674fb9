"""Case SC2 (../shared/cases/scheduling.md) on the real engine.

One tenant submits prompts many times longer than the prefill chunk, continuously. Right value:
that tenant cannot take every prefill chunk; the other tenants' prefill progresses every iteration
in proportion to their weights.

Real engine (random-tiny Llama, real forward passes, `Engine.step()` driven synchronously), chunk
128 tokens. Tenant `long` (weight 1) keeps 3 prompts of 8 chunks queued; tenants `b` (weight 1)
and `c` (weight 3) keep 2 prompts of 2 chunks queued; every request asks for 1 output token, so
the service is (almost) all prefill. For each iteration the test reads the prefill tokens each
tenant got (the engine's `EventLog`) and which tenants had prefill pending before it
(`Scheduler.prefill_backlog()`). FCFS, run the same way, is shown to hand whole chunks to one tenant.
"""

from __future__ import annotations

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams
from worker.scheduling.metrics import EventLog

CHUNK = 128
WEIGHTS = {"long": 1.0, "b": 1.0, "c": 3.0}
PROMPT = {"long": 8 * CHUNK, "b": 2 * CHUNK, "c": 2 * CHUNK}
QUEUED = {"long": 3, "b": 2, "c": 2}
ITERATIONS = 30


@pytest.fixture(scope="module")
def tiny():
    from worker.models import load_model

    return load_model("random-tiny", progress=False)


def run_case(model, policy: str, iterations: int = ITERATIONS):
    from worker.engine.model_runner import ModelRunner

    log = EventLog()
    runner = ModelRunner(model, num_kv_blocks=1024, block_size=16)
    engine = Engine(model, EngineConfig(policy=policy, max_num_batched_tokens=CHUNK, max_running=64), runner,
                    recorder=log)
    added: dict[str, list[str]] = {t: [] for t in WEIGHTS}
    pending_before = []

    def top_up():
        for t, n in QUEUED.items():  # keep n requests of each tenant not yet through prefill
            while sum(1 for r in added[t] if r not in log.requests or log.requests[r].prefill_done is None) < n:
                rid = f"{t}{len(added[t])}"
                prompt = [(31 * len(added[t]) + 7 * j + len(t)) % 30000 + 100 for j in range(PROMPT[t])]
                engine.add_request(rid, t, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                   lambda out: None, weight=WEIGHTS[t])
                added[t].append(rid)

    for _ in range(iterations):
        top_up()
        pending_before.append(set(engine.scheduler.prefill_backlog()))
        assert engine.step()
    return log, pending_before


def test_case_sc2_long_prompts_cannot_take_every_prefill_chunk(tiny):
    log, pending = run_case(tiny, "vtc")
    steps = log.steps[-ITERATIONS:]
    totals = {t: 0 for t in WEIGHTS}
    for i, (st, before) in enumerate(zip(steps, pending)):
        got = {t: st.prefill_tokens.get(t, 0) for t in WEIGHTS}
        print(i, got)
        assert sum(got.values()) <= CHUNK
        if i > 0:  # (the very first requests are still in the engine's inbox before step 0)
            assert before == set(WEIGHTS)  # everyone always has prefill pending (the workload keeps it so)
        # every tenant's prefill progresses in every iteration; the long-prompt tenant never takes the chunk
        assert all(got[t] > 0 for t in WEIGHTS), f"iteration {i}: {got}"
        assert got["long"] < CHUNK
        if i >= 2:  # past the first arrivals, each iteration's split follows the weights within two slices
            per_weight = {t: got[t] / WEIGHTS[t] for t in WEIGHTS}
            assert max(per_weight.values()) - min(per_weight.values()) <= 2 * 16 + 1, f"iteration {i}: {got}"
        for t in WEIGHTS:
            totals[t] += got[t]
    # over the run, prefill service is in proportion to the weights (1 : 1 : 3)
    per_weight = {t: totals[t] / WEIGHTS[t] for t in WEIGHTS}
    print("prefill tokens per unit weight:", per_weight)
    assert max(per_weight.values()) / min(per_weight.values()) < 1.1


def test_case_sc2_fcfs_baseline_hands_whole_chunks_to_one_tenant(tiny):
    log, _ = run_case(tiny, "fcfs", iterations=10)
    single = sum(1 for st in log.steps if len([t for t, n in st.prefill_tokens.items() if n > 0]) == 1)
    assert single >= 8
