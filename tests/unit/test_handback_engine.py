"""Hand-back inside the real engine (random-tiny Llama, real forward passes, a virtual clock): a
queued request the gateway lets go, on a full worker, ends before any token with
FinishReason.HANDED_BACK and leaves nothing behind (no KV block, no charge, no queue entry, not
counted as finished), while the running request is untouched; the pool board has its say."""

from __future__ import annotations

import pytest

from fairshare.pool_board import TenantReport, WorkerReport
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sequence import FinishReason, SamplingParams

PROMPT = [(5 * j) % 400 + 3 for j in range(40)]


@pytest.fixture(scope="module")
def tiny():
    from worker.models import load_model

    return load_model("random-tiny", progress=False)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def full_engine(tiny, after_s=1.0):
    """An engine with one running slot, taken by tenant r's long request (decoding), and tenant a's
    request queued behind it (the gateway lets it be handed back). Returns (engine, clock, outputs)."""
    clock = Clock()
    engine = Engine(tiny, EngineConfig(max_running=1, num_kv_blocks=64, returning_preemption=False,
                                       hand_back_after_s=after_s), clock=clock)
    outs: dict[str, list] = {}
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("r1", "r", PROMPT, params, lambda o: outs.setdefault("r1", []).append(o))
    assert engine.step()  # r1's prefill: it runs, holding the slot
    engine.add_request("a1", "a", PROMPT[::-1], params, lambda o: outs.setdefault("a1", []).append(o),
                       may_hand_back=True)
    assert engine.step()  # r1 decodes; a1 is queued (no slot)
    assert [s.request_id for s in engine.scheduler.running] == ["r1"]
    assert [s.request_id for s in engine.scheduler.waiting["a"]] == ["a1"]
    return engine, clock, outs


def test_a_handed_back_request_ends_before_any_token_and_frees_everything(tiny):
    engine, clock, outs = full_engine(tiny)
    blocks = engine.block_manager.num_used
    r1_tokens = len(engine.scheduler.by_id["r1"].output_token_ids)
    clock.t += 0.5
    assert engine.step()
    assert "a1" not in outs  # not due yet
    clock.t += 0.5  # a1 has waited 1 s with no room here
    assert engine.step()
    (out,) = outs["a1"]
    assert out.finish_reason is FinishReason.HANDED_BACK and out.token_ids == [] and out.text_delta == ""
    assert out.completion_tokens == 0 and out.timings.queued_s is None
    assert "a1" not in engine.scheduler.by_id and "a1" not in engine.scheduler.core.entries
    assert engine.scheduler.num_waiting() == 0
    assert engine.block_manager.num_used == blocks  # only r1's blocks (a1 never held one)
    acct = engine.policy.accounts["a"]
    assert acct.charged_service == 0 and not acct.backlogged
    snap = {t["tenant_id"]: t for t in engine.snapshot()["tenants"]}
    assert snap["a"]["handed_back"] == 1 and snap["a"]["finished"] == 0 and snap["a"]["waiting"] == 0
    assert len(engine.scheduler.by_id["r1"].output_token_ids) == r1_tokens + 2  # r1 went on, one token a step
    while engine.step():
        pass
    assert outs["r1"][-1].finish_reason is FinishReason.LENGTH
    assert engine.block_manager.num_used == 0  # r1's blocks back too (cached ones are evictable)
    assert engine.abort("a1") is False  # gone: nothing to abort


def test_never_without_the_gateways_leave_and_never_when_off(tiny):
    engine, clock, outs = full_engine(tiny)
    engine.scheduler.by_id["a1"].may_hand_back = False  # the gateway did not let it go (no other worker)
    clock.t += 5.0
    engine.step()
    assert "a1" not in outs and "a1" in engine.scheduler.by_id
    off, clock, outs = full_engine(tiny, after_s=0.0)  # --hand-back-after-s 0
    clock.t += 5.0
    off.step()
    assert "a1" not in outs and "a1" in off.scheduler.by_id


def board(worker: str, **tenants) -> WorkerReport:
    return WorkerReport(worker, "e1", {t: TenantReport(0.0, backlogged=b, counter=c) for t, (b, c) in tenants.items()})


def test_with_a_board_it_waits_unless_another_worker_is_likely_to_start_it_sooner(tiny):
    engine, clock, outs = full_engine(tiny)
    # the only other worker has a queue, led by a tenant whose counter is below a's: a would wait there too
    engine.pool_apply([board("w2", b=(True, -1.0))])
    clock.t += 5.0
    engine.step()
    assert "a1" not in outs  # nowhere better: it stays
    engine.pool_apply([board("w2", b=(False, -1.0))])  # nobody queues at w2 now
    engine.step()
    assert outs["a1"][0].finish_reason is FinishReason.HANDED_BACK
