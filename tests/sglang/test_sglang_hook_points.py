"""The hook points the plugin's delegation to the scheduling core will use (docs/sglang-backend.md),
checked on SGLang 0.5.23's own scheduler code with the CPU driver: each is installed here with
pytest's monkeypatch (reversible), where the plugin would register it through HookRegistry.

- Refusing a request inside the prefill adder's loop: a `PrefillAdder` subclass (served by
  `Scheduler.get_prefill_adder_class`, a REPLACE target) whose `add_one_req` returns
  `AddReqResult.CONTINUE` without admitting: `_get_new_batch_prefill_raw` goes on with the next
  waiting request (it stops only on NO_TOKEN / OTHER), so the refused tenant waits and nobody
  else is blocked (eligibility skip, quota refusal).
- Preempting before a prefill pass: in a BEFORE hook on `Scheduler.get_new_batch_prefill(self,
  running_batch)`, SGLang's own `ScheduleBatch.release_req` + `filter_batch` +
  `Scheduler._add_request_to_queue(req, is_retracted=True)`, as `update_running_batch` does after
  `retract_decode` (tier, reclaim and returning-tenant preemption).
"""

from __future__ import annotations

import functools

from tests.parity.workloads import DRAIN
from tests.sglang.sglang_driver import Scheduler, SGLangDriver
from worker.sglang_plugin import hooks
from worker.sglang_plugin.state import FairShareState

from sglang.srt.managers.schedule_policy import AddReqResult  # noqa: E402


def _expected_service(tenant):
    return sum(r.prompt_tokens + 2 * r.output_tokens for r in DRAIN.requests if r.tenant_id == tenant)


def test_prefill_adder_can_refuse_a_tenant_without_blocking_the_others(monkeypatch):
    refusing = {"b"}

    class RefusingAdder(hooks.prefill_adder_class()):   # served by the plugin's REPLACE hook
        def add_one_req(self, req, has_chunked_req, truncation_align_size):
            if req.fairshare_tag.tenant_id in refusing:
                return AddReqResult.CONTINUE
            return super().add_one_req(req, has_chunked_req, truncation_align_size)

    monkeypatch.setattr(hooks, "_adder_class", RefusingAdder)
    # SGLang's loop itself is under test here, not the core's plan: no plan, so the plugin's adder
    # is SGLang's (a refusal outside the core would leave the core planning the refused tenant)
    monkeypatch.setattr(FairShareState, "begin_pass", lambda self, scheduler, running_batch: None)
    with SGLangDriver(DRAIN) as driver:
        for i in range(DRAIN.iterations):
            if i == 120:
                refusing.clear()
            rec = driver.step()
            if i < 120:
                assert not [r for r in rec.admitted if r.startswith("b-")], (i, rec.admitted)
        trace = driver.trace
        admitted_a = [r for rec in trace.records[:120] for r in rec.admitted if r.startswith("a-")]
        assert len(admitted_a) >= 4, "a's requests behind b's refused ones were admitted"
        assert next(i for i, rec in enumerate(trace.records) if any(r.startswith("b-") for r in rec.admitted)) == 120
        while not all(r.finished() for r in driver.reqs.values()) and driver.iteration < DRAIN.iterations + 300:
            driver.step()   # b's requests started 120 iterations late: let them finish
        assert all(r.finished() for r in driver.reqs.values()) and driver.leaked_tokens() == 0


def test_retraction_before_a_prefill_pass_requeues_and_recomputes_without_charging_twice(monkeypatch):
    hooked = Scheduler.get_new_batch_prefill   # the plugin's AFTER hook stays inside
    victims: set[str] = set()
    retracted: list[str] = []

    @functools.wraps(hooked)
    def before(self, running_batch):
        idx = [i for i, r in enumerate(running_batch.reqs) if r.rid in victims and not r.finished()]
        if idx:
            gone = [running_batch.reqs[i] for i in idx]
            for k, i in enumerate(sorted(idx, reverse=True)):
                running_batch.release_req(i, len(running_batch.reqs) - 1 - k)
            running_batch.filter_batch(keep_indices=[i for i in range(len(running_batch.reqs)) if i not in idx])
            running_batch.batch_is_full = False
            for req in gone:
                victims.discard(req.rid)
                retracted.append(req.rid)
                self._add_request_to_queue(req, is_retracted=True)
        return hooked(self, running_batch)

    monkeypatch.setattr(Scheduler, "get_new_batch_prefill", before)
    with SGLangDriver(DRAIN) as driver:
        for i in range(DRAIN.iterations):
            if i == 40:
                decoding = [r.rid for r in driver.scheduler.running_batch.reqs if r.output_ids]
                assert decoding
                victims.add(decoding[0])
            driver.step()
        assert retracted and all(r.finished() for r in driver.reqs.values())
        assert driver.leaked_tokens() == 0
        trace = driver.trace
        rid = retracted[0]
        # SGLang retracts on its own too when drain's decodes run short (admission is on the room
        # there is now): each retraction is counted once and re-admitted once
        assert rid in trace.retractions()
        assert trace.admission_order().count(rid) == trace.retractions().count(rid) + 1
        snapshot = driver.state.snapshot()
        assert sum(v["retractions"] for v in snapshot.values()) == len(trace.retractions())
        for tenant in ("a", "b"):
            assert snapshot[tenant]["charged_service"] == _expected_service(tenant)
