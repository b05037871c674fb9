"""Case SC1 (../shared/cases/scheduling.md) on the real engine.

Tenant A sends 8 concurrent requests with 1500-token prompts (max_tokens 64); 200 ms later tenant
B sends a 20-token prompt (max_tokens 8). Right value: B is not queued behind A's backlog: B
finishes before A's fourth request, and B's TTFT stays within 3× its idle TTFT plus one prefill
chunk.

The engine is the real one (random-tiny Llama, real forward passes, `Engine.step()` driven
synchronously). Its clock is virtual: every step advances it by the iteration time model below
for the batch it ran (`ClockedRunner`), so the latencies compared are deterministic (tests never
assert wall-clock timings). FCFS, run the same way, is shown to fail the same checks.
"""

from __future__ import annotations

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import SamplingParams
from worker.scheduling.metrics import EventLog
from loadtests.sim.runner import ClockedRunner, IterationTimeModel, VirtualClock

# Shape of this machine's calibration (loadtests/profiles/cpu-random-tiny.json), fixed here so the
# test does not move when the profile is re-measured.
TIME_MODEL = IterationTimeModel(a=0.045, b=0.0002, c=0.0013, d=1.6e-5, source="test")
CHUNK = 512


@pytest.fixture(scope="module")
def tiny():
    from worker.models import load_model

    return load_model("random-tiny", progress=False)


def make_engine(model, policy: str):
    from worker.engine.model_runner import ModelRunner

    clock = VirtualClock()
    runner = ClockedRunner(ModelRunner(model, num_kv_blocks=1024, block_size=16), clock, TIME_MODEL)
    log = EventLog()
    engine = Engine(model, EngineConfig(policy=policy, max_num_batched_tokens=CHUNK, max_running=64), runner,
                    clock=clock, recorder=log)
    return engine, clock, log


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def idle_ttft(model) -> float:
    engine, clock, log = make_engine(model, "vtc")
    engine.add_request("b-idle", "B", list(range(300, 320)), params(8), lambda out: None)
    while engine.step():
        pass
    rec = log.requests["b-idle"]
    return rec.first_token - rec.arrival


def run_case(model, policy: str, a_finished_needed: int):
    """Run until B finished and `a_finished_needed` of A's requests finished (or all work is done)."""
    engine, clock, log = make_engine(model, policy)
    for i in range(8):
        prompt = [(37 * i + 11 * j) % 30000 + 100 for j in range(1500)]
        engine.add_request(f"a{i}", "A", prompt, params(64), lambda out: None, arrival_time=0.0)
    b_added = False
    while True:
        if not b_added and clock() >= 0.2:
            engine.add_request("b", "B", list(range(300, 320)), params(8), lambda out: None, arrival_time=0.2)
            b_added = True
        if not engine.step() and b_added:
            break
        done_a = sum(1 for i in range(8) if log.requests[f"a{i}"].finish is not None)
        if b_added and log.requests["b"].finish is not None and done_a >= a_finished_needed:
            break
    return log


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_case_sc1_short_request_is_not_queued_behind_long_prompts(tiny, policy):
    ttft_idle = idle_ttft(tiny)
    chunk_s = TIME_MODEL.step_time(CHUNK, 1, CHUNK)
    log = run_case(tiny, policy, a_finished_needed=4 if policy == "vtc" else 0)
    b = log.requests["b"]
    ttft_b = b.first_token - b.arrival
    limit = 3 * ttft_idle + chunk_s
    print(f"{policy}: B TTFT {ttft_b:.3f} s (idle {ttft_idle:.3f} s, limit {limit:.3f} s); "
          f"B finished at {b.finish:.2f} s (virtual clock)")
    assert b.output_tokens == 8 and b.reason == "length"
    if policy == "vtc":
        a_finishes = sorted(log.requests[f"a{i}"].finish for i in range(8) if log.requests[f"a{i}"].finish)
        print(f"A's 4th request finished at {a_finishes[3]:.2f} s")
        assert b.finish < a_finishes[3]
        assert ttft_b <= limit
    else:  # the baseline queues B behind A's whole backlog of prefill
        assert ttft_b > limit
