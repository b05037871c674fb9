"""worker.engine.step_threads: with sleeping OpenMP waits a small forward step runs on one thread,
a large one on every thread, and the count is restored after each step; logits do not change."""

from __future__ import annotations

import pytest
import torch

from worker.engine.model_runner import ForwardItem, ModelRunner
from worker.engine.step_threads import SLEEPING_WAITS_MIN_ROWS, StepThreads, sleeping_waits
from worker.models import load_model


@pytest.mark.parametrize("env,expected", [
    ({}, False),                                     # libgomp's default spins
    ({"OMP_WAIT_POLICY": "PASSIVE"}, True),
    ({"OMP_WAIT_POLICY": " passive "}, True),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False),
    ({"GOMP_SPINCOUNT": "0"}, True),
    ({"GOMP_SPINCOUNT": "10000"}, False),
])
def test_sleeping_waits_reads_the_openmp_settings(env, expected):
    assert sleeping_waits(env) is expected


def test_auto_narrows_only_under_sleeping_waits(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert StepThreads(4).min_rows == SLEEPING_WAITS_MIN_ROWS
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert StepThreads(4).min_rows is None
    st = StepThreads(4, min_rows=16)
    assert [st.for_rows(n) for n in (1, 15, 16, 64)] == [1, 1, 4, 4]
    assert StepThreads(4, min_rows=None).for_rows(1) == 4


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_run_sets_the_count_for_the_step_and_restores_it(two_threads):
    st = StepThreads(2, min_rows=16)
    assert st.run(1, torch.get_num_threads) == 1
    assert torch.get_num_threads() == 2
    assert st.run(16, torch.get_num_threads) == 2

    def fails():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        st.run(1, fails)
    assert torch.get_num_threads() == 2  # restored on the error path too


def test_runner_runs_small_steps_on_one_thread_with_the_same_logits(two_threads):
    """A runner on 2 threads with min_rows 16: the layers of a 1-row step see 1 thread, of a 16-row
    step 2 threads; torch's count is 2 again after each; a step's logits match those of a runner
    that runs every step on 2 threads."""
    model = load_model("random-tiny", progress=False)
    narrow = ModelRunner(model, num_kv_blocks=8, block_size=16, step_threads=StepThreads(2, min_rows=16))
    wide = ModelRunner(model, num_kv_blocks=8, block_size=16, step_threads=StepThreads(2, min_rows=None))
    seen: list[int] = []
    layer = narrow.layers[0]
    qkv = layer.qkv

    def recording(x):
        seen.append(torch.get_num_threads())
        return qkv(x)

    layer.qkv = recording
    prompt = list(range(100, 116))
    for runner in (narrow, wide):
        runner_out = runner.forward([ForwardItem(prompt, 0, [0])])             # 16 rows
        decode_out = runner.forward([ForwardItem([7], 16, [0, 1])])             # 1 row
        if runner is narrow:
            first = (runner_out, decode_out)
            assert seen == [2, 1], seen
            assert torch.get_num_threads() == 2
    torch.testing.assert_close(first[0], runner_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(first[1], decode_out, atol=1e-5, rtol=0)


def test_the_engine_threads_own_count_is_what_it_narrows(two_threads):
    """The worker runs its engine loop in a thread of its own: torch's count is per calling thread
    under OpenMP, so the narrowing must show in that thread's steps (and leave it at 2 after)."""
    import threading

    st = StepThreads(2, min_rows=16)
    seen: list[int] = []

    def loop():
        seen.append(torch.get_num_threads())
        seen.append(st.run(1, torch.get_num_threads))
        seen.append(st.run(32, torch.get_num_threads))
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=loop)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the engine-like thread never finished"
    assert seen == [2, 1, 2, 2], seen


def test_a_cpu_runner_follows_the_wait_policy_by_default(monkeypatch):
    model = load_model("random-tiny", progress=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    r = ModelRunner(model, num_kv_blocks=2, block_size=16)
    assert (r.step_threads.threads, r.step_threads.min_rows) == (torch.get_num_threads(), SLEEPING_WAITS_MIN_ROWS)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert ModelRunner(model, num_kv_blocks=2, block_size=16).step_threads.min_rows is None


def test_describe_says_when_small_steps_run_on_one_thread():
    assert StepThreads(2, min_rows=16).describe() == "2 CPU threads, steps under 16 token rows on 1 (OpenMP waits sleep)"
    assert StepThreads(2, min_rows=None).describe() == "2 CPU threads"
    assert StepThreads(1, min_rows=16).describe() == "1 CPU thread"
