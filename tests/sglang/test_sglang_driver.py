"""The CPU driver of SGLang 0.5.23's scheduler (tests/sglang/sglang_driver.py) steps SGLang's own
code with the plugin's hooks firing from SGLang's call sites, and what it records is what happened."""

from __future__ import annotations

import inspect

from tests.parity.workloads import DRAIN, WORKLOADS
from tests.sglang.sglang_driver import Scheduler, SGLangDriver, ensure_plugin, run_sglang

from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402  (after the driver's prepare())
from worker.sglang_plugin import hooks


def _expected_service(workload, tenant, alpha=1.0, beta=2.0):
    return sum(alpha * r.prompt_tokens + beta * r.output_tokens for r in workload.requests if r.tenant_id == tenant)


def test_driver_runs_sglangs_own_methods_with_the_plugin_hooks():
    ensure_plugin()
    for name in ("get_next_batch_to_run", "update_running_batch", "_get_new_batch_prefill_raw"):
        assert inspect.getmodule(getattr(Scheduler, name)).__name__ == "sglang.srt.managers.scheduler"
    # the driver's Scheduler shadows none of the class's methods: it only holds what __init__ would set
    with SGLangDriver(WORKLOADS["overload"]) as driver:
        shadowed = [k for k in vars(driver.scheduler) if callable(getattr(Scheduler, k, None))]
        assert type(driver.scheduler) is Scheduler and not shadowed, shadowed
    assert inspect.getclosurevars(Scheduler.get_new_batch_prefill).nonlocals["hook"] is hooks.after_get_new_batch_prefill


def test_drain_every_request_finishes_no_kv_leaked_each_token_charged_once():
    """DRAIN: prompts longer than a chunk (chunked prefill over several passes), a pool small enough
    that decode runs out of KV (conservativeness 0.3 lowers SGLang's decode reserve), two weights."""
    calls = []
    original = ScheduleBatch.__dict__["_get_decode_retraction_order"]
    with SGLangDriver(DRAIN, conservativeness=0.3) as driver:
        state = driver.state
        real = state.retraction_order

        def spy(reqs):
            calls.append([r.rid for r in reqs])
            return real(reqs)

        state.retraction_order = spy
        trace = driver.run()
        assert all(r.finished() for r in driver.reqs.values()), [r.rid for r in driver.reqs.values() if not r.finished()]
        assert driver.leaked_tokens() == 0
        snapshot = state.snapshot()
    assert ScheduleBatch.__dict__["_get_decode_retraction_order"] is original
    assert sorted(trace.finished()) == sorted(r.request_id for r in DRAIN.requests)
    # with the core deciding admissions (its ledger), SGLang's own decode retraction is not needed
    # here; any request sent back (retracted, or a planned admission SGLang's decode reserve
    # refused) came back, was admitted again and finished
    assert state.plan_refusals + len(trace.retractions()) > 0
    for rid in trace.retractions():
        assert trace.admission_order().count(rid) >= 2
    assert sum(v["retractions"] for v in snapshot.values()) == len(trace.retractions())
    # recomputation after a retraction is not charged again: service = α·P + β·O per tenant
    for tenant in ("a", "b"):
        assert snapshot[tenant]["charged_service"] == _expected_service(DRAIN, tenant)
        assert trace.records[-1].service[tenant] == _expected_service(DRAIN, tenant)
    # tokens computed cover at least every prompt and output token once
    computed = {t: sum(rec.tokens.get(t, 0) for rec in trace.records) for t in ("a", "b")}
    for tenant in ("a", "b"):
        need = sum(r.prompt_tokens + r.output_tokens - 1 for r in DRAIN.requests if r.tenant_id == tenant)
        assert computed[tenant] >= need


def test_driver_restores_plugin_state_and_is_deterministic():
    before = hooks.get_state()
    w = WORKLOADS["overload"]
    one, two = run_sglang(w), run_sglang(w)
    assert hooks.get_state() is before
    assert [r.admitted for r in one.records] == [r.admitted for r in two.records]
    assert one.records[-1].service == two.records[-1].service


def test_vtc_order_reaches_the_prefill_adder():
    """The plugin's order decides admissions: in `weighted` (weights 1 and 3, both flooding),
    SGLang admits about three of w3's requests per one of w1's once both are backlogged, where its
    own FCFS order would admit all 40 of w1's first (they arrived first)."""
    t = run_sglang(WORKLOADS["weighted"], "vtc")
    first = t.first_admissions()[:24]
    assert 15 <= sum(r.startswith("w3-") for r in first) <= 20, first
    fcfs = run_sglang(WORKLOADS["weighted"], "fcfs")
    assert all(r.startswith("w1-") for r in fcfs.first_admissions()[:40])


def test_sglangs_admission_room_is_the_cores_room_now():
    """With the core's plan, SGLang's prefill budget holds back no estimate of future decode tokens
    (docs/sglang-backend.md "cannot" 4, done): at each `FairSharePrefillAdder.__init__` the
    budget's `total_offset` equals its `current_offset`, the decodes riding along with mixed chunked
    prefill, and the free room the plugin told the core for the pass is that budget's
    `remaining_total` less one token (SGLang admits while a request's tokens are strictly below
    it). Checked pass by pass on memory-flood, which is KV-bound (SGLang's reserve would be tens of
    tokens per running request there)."""
    seen = []
    with SGLangDriver(WORKLOADS["memory-flood"]) as driver:
        state = driver.state
        adder_class = hooks.prefill_adder_class()
        real_init, real_begin = adder_class.__init__, state.begin_pass

        def begin(scheduler, running_batch):
            plan = real_begin(scheduler, running_batch)
            state._batch = running_batch  # the room after the core's preemptions, if any
            try:
                seen.append([(state.free_blocks(), state.mixed_decode_tokens())])
            finally:
                state._batch = None
            return plan

        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            if seen and len(seen[-1]) == 1:
                b = self.memory_budget
                seen[-1].append((b.total_offset, b.current_offset, b.remaining_total))

        state.begin_pass = begin
        adder_class.__init__ = init
        try:
            for _ in range(160):
                driver.step()
        finally:
            adder_class.__init__ = real_init
    pairs = [p for p in seen if len(p) == 2]
    assert len(pairs) >= 40 and any(mixed > 0 for (_, mixed), _ in pairs)
    bad = [p for p in pairs if not (p[1][0] == p[1][1] == p[0][1])]
    assert not bad, bad[:5]
    assert all(free == max(0, remaining - 1) for (free, _), (_, _, remaining) in pairs), \
        [p for p in pairs if p[0][0] != max(0, p[1][2] - 1)][:5]
    assert sum(driver.state.retractions.values()) > 0  # decodes ran short: SGLang retracted


def test_kv_hard_cap_is_enforced_in_sglangs_admissions():
    """The worker's KV quotas reach SGLang's admissions through the core's plan: with flood's hard
    cap at 30 % of the 4096-token pool, SGLang never runs two of flood's 1024-token requests at once
    (without quotas it runs up to three), the victim tenant keeps being served, and nothing leaks."""
    from worker.scheduling.quota import KVQuotaConfig

    def most_flood_running(**options):
        most = 0
        with SGLangDriver(WORKLOADS["memory-flood"], **options) as driver:
            s = driver.scheduler
            for _ in range(160):
                rec = driver.step()
                live = list(s.running_batch.reqs) + ([s.chunked_req] if s.chunked_req is not None else [])
                most = max(most, sum(1 for r in live if r.fairshare_tag.tenant_id == "flood" and not r.finished()))
            victim_service = rec.service.get("victim", 0.0)
        return most, victim_service

    capped, served = most_flood_running(kv_quota=KVQuotaConfig(enabled=True, hard={"flood": 0.3}))
    free, _ = most_flood_running()
    assert capped == 1 and free >= 2 and served > 0, (capped, free, served)


def test_get_internal_state_carries_the_schedulers_fairshare_figures():
    """AFTER `Scheduler.get_internal_state` adds the core's figures in the reference engine's snapshot
    shape, msgpack-native as SGLang sends them. The driver's Scheduler has no `internal_state`
    component (built in `Scheduler.__init__`), so the hook is applied to the output that component
    returns, built with SGLang's own class; that SGLang's method carries the hook is checked too."""
    import msgspec

    from sglang.srt.managers.io_struct import GetInternalStateReq, GetInternalStateReqOutput

    ensure_plugin()
    assert inspect.getclosurevars(Scheduler.get_internal_state).nonlocals["hook"] is hooks.after_get_internal_state
    with SGLangDriver(WORKLOADS["tiers"]) as driver:
        for _ in range(12):
            driver.step()
        out = GetInternalStateReqOutput(internal_state={"max_running_requests": 8})
        assert hooks.after_get_internal_state(out, driver.scheduler, GetInternalStateReq()) is None
        snap = out.internal_state["fairshare"]
        core = driver.state.core
        assert snap["running"] == len(core.running) > 0 and snap["waiting"] == core.num_waiting() > 0
        by_tenant = {t["tenant_id"]: t for t in snap["tenants"]}
        assert by_tenant["bg"]["tier"] == "background" and by_tenant["batch"]["charged_service"] > 0
        assert by_tenant["inter"]["virtual_counter"] == driver.state.policy.accounts["inter"].virtual_counter
        assert snap["tiers"]["background"]["min_share"] == 0.05 and snap["kv_blocks_total"] == WORKLOADS["tiers"].engine.kv_tokens
        assert sum(t["kv_blocks"] for t in snap["tenants"]) > 0
        msgspec.msgpack.decode(msgspec.msgpack.encode(out.internal_state))
