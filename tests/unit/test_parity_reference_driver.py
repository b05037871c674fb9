"""The reference side of the parity harness (tests/parity): scripted workloads are well-formed and the
reference driver records what the scheduler did (the SGLang side lives in tests/sglang)."""

from __future__ import annotations

import pytest

from tests.parity.reference_driver import ReferenceDriver, run_reference
from tests.parity.trace import compare
from tests.parity.workloads import DRAIN, WORKLOADS, ScriptedRequest, ScriptedTenant, ScriptedWorkload


def test_drain_every_request_finishes_no_block_leaked_each_token_charged_once():
    driver = ReferenceDriver(DRAIN)
    trace = driver.run()
    assert sorted(trace.finished()) == sorted(r.request_id for r in DRAIN.requests)
    assert driver.leaked_blocks() == 0
    assert trace.retractions(), "DRAIN's pool is sized for decode preemption"
    for rid in trace.retractions():
        assert trace.admission_order().count(rid) >= 2   # preempted, admitted again
    for tenant in ("a", "b"):
        want = sum(r.prompt_tokens + 2 * r.output_tokens for r in DRAIN.requests if r.tenant_id == tenant)
        assert trace.records[-1].service[tenant] == want  # recomputation is not charged twice


def test_records_admissions_once_per_admission_and_tokens_within_budget():
    w = WORKLOADS["overload"]
    trace = run_reference(w)
    firsts = trace.first_admissions()
    assert len(firsts) == len(set(firsts))
    assert all(sum(rec.tokens.values()) <= w.engine.chunk_tokens for rec in trace.records)
    # both tenants have queued work throughout the declared window
    assert trace.backlog_end(w.backlog_window[0], w.backlogged) >= w.backlog_window[1]
    assert compare(trace, run_reference(w)).first_order_difference is None   # deterministic


def test_workload_definitions_are_checked():
    tenants = (ScriptedTenant("a"),)
    with pytest.raises(ValueError, match="unknown tenant"):
        ScriptedWorkload("x", "", tenants, (ScriptedRequest("r", "b", 0, 8, 8),), iterations=4)
    with pytest.raises(ValueError, match="outside"):
        ScriptedWorkload("x", "", tenants, (ScriptedRequest("r", "a", 4, 8, 8),), iterations=4)
    with pytest.raises(ValueError, match="weight"):
        ScriptedTenant("a", 0.0)
    w = WORKLOADS["overload"]
    prompts = [tuple(w.prompt(r)) for r in w.requests]
    assert len(set(prompts)) == len(prompts)          # no prefix shared by accident
    assert all(len(p) == r.prompt_tokens for p, r in zip(prompts, w.requests))
