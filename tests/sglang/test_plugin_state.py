"""The plugin's scheduler-side state on stand-in requests (no SGLang needed).

The same behaviours are exercised on SGLang's real classes in test_sglang_hooks.py; these cover the
arithmetic and the corner cases cheaply and also run in the main environment.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker.scheduling.cost import LinearCost
from worker.sglang_plugin import state_from_env
from worker.sglang_plugin import tenant as tn
from worker.sglang_plugin.state import FairShareState

SECRET = "test-secret"


class FakeReq:
    """The fields of SGLang 0.5.23's Req that the plugin reads."""

    def __init__(self, rid, tenant, prompt_len, weight=1.0, salt=None, output=0, lora_id=None, max_new=16,
                 tier="interactive"):
        token = tn.sign(tenant, weight, tier, SECRET, rid=rid) if tenant else None
        self.rid = rid
        self.origin_input_ids = list(range(prompt_len))
        self.output_ids = list(range(output))
        self.sampling_params = SimpleNamespace(custom_params={tn.CUSTOM_PARAM_KEY: token} if token else None,
                                               max_new_tokens=max_new)
        self.extra_key = tn.extra_key_for(tenant, salt, SECRET) if tenant else None
        self.cache_salt = salt
        self.lora_id = lora_id
        self.prefix_len = 0
        self.extend_end = None
        self.is_retracted = False
        self._finished = False

    def finished(self):
        return self._finished


def make_state(policy="vtc", **kw) -> FairShareState:
    return FairShareState(policy, LinearCost(1.0, 2.0), secret=SECRET, **kw)


def counters(state):
    return {t: a.virtual_counter for t, a in state.policy.accounts.items()}


def test_order_by_counter_then_projected_interleaving():
    s = make_state()
    a1, a2, b1, b2 = FakeReq("a1", "A", 100), FakeReq("a2", "A", 100), FakeReq("b1", "B", 100), FakeReq("b2", "B", 100)
    for r in (a1, a2, b1, b2):
        s.on_arrival(r)
    s.policy.charge("A", 150.0)  # A has been served more
    q = [a1, a2, b1, b2]
    s.order_waiting(q)
    # B (counter 0) first; then projected: b2 at 100, a1 at 150, b? ... a2 at 250
    assert [r.rid for r in q] == ["b1", "b2", "a1", "a2"]
    s.policy.charge("B", 120.0)  # now B at 120 < A at 150: b1 (120), a1 (150), b2 (220), a2 (250)
    s.order_waiting(q)
    assert [r.rid for r in q] == ["b1", "a1", "b2", "a2"]


def test_weight_scales_projection_and_fcfs_keeps_sglang_order():
    s = make_state()
    heavy = [FakeReq(f"h{i}", "H", 100, weight=4.0) for i in range(3)]
    light = [FakeReq(f"l{i}", "L", 100, weight=1.0) for i in range(2)]
    q = light + heavy
    for r in q:
        s.on_arrival(r)
    s.order_waiting(q)
    # H's projected counter grows by 25 per request, L's by 100: h0 0, h1 25, h2 50, l0 0 (tie -> id), l1 100
    assert [r.rid for r in q] == ["h0", "l0", "h1", "h2", "l1"]
    f = make_state("fcfs")
    q2 = light + heavy
    for r in q2:
        f.on_arrival(r)
    f.order_waiting(q2)
    assert [r.rid for r in q2] == ["l0", "l1", "h0", "h1", "h2"]


def test_prefill_charges_uncached_prompt_once():
    s = make_state()
    r = FakeReq("r", "A", 100)
    s.on_arrival(r)
    # first chunk: 40 tokens came from the radix cache, SGLang computes [40, 72)
    r.prefix_len, r.extend_end = 40, 72
    assert s.charge_prefill([r]) == 32.0
    # second chunk: [72, 100)
    r.prefix_len, r.extend_end = 72, 100
    assert s.charge_prefill([r]) == 28.0
    # retracted and recomputed (with 3 output tokens): nothing is charged again
    r.output_ids = [1, 2, 3]
    r.prefix_len, r.extend_end = 0, 103
    assert s.charge_prefill([r]) == 0.0
    acct = s.policy.accounts["A"]
    assert acct.prompt_tokens == 60 and acct.charged_service == 60.0


def test_cached_rate_and_mixed_chunk_decodes_skipped():
    s = FairShareState("vtc", LinearCost(1.0, 2.0, cached_rate=0.5), secret=SECRET)
    r, d = FakeReq("r", "A", 100), FakeReq("d", "A", 10, output=5)
    s.on_arrival(r)
    s.on_arrival(d)
    r.prefix_len, r.extend_end = 40, 100
    d.prefix_len, d.extend_end = 14, 15
    assert s.charge_prefill([r, d], skip=[d]) == 60.0 + 0.5 * 40


def test_decode_charged_once_under_overlap_and_multi_token_steps():
    s = make_state()
    r = FakeReq("r", "A", 10)
    s.on_arrival(r)
    r.output_ids = [7]
    assert s.charge_outputs([r]) == 2.0           # first token (prefill result)
    r.output_ids = [7, 8, 9, 10]                  # 3 tokens in one step (speculative decoding)
    assert s.charge_outputs([r]) == 6.0
    assert s.charge_outputs([r]) == 0.0           # the same step processed again
    r._finished = True
    assert s.charge_outputs([r]) == 0.0
    assert s.policy.accounts["A"].output_tokens == 4
    assert "r" not in s.tracked and not s.policy.accounts["A"].backlogged


def test_reconcile_retires_requests_aborted_while_waiting():
    s = make_state()
    a, b = FakeReq("a", "A", 10), FakeReq("b", "A", 10)
    s.on_arrival(a)
    s.on_arrival(b)
    assert s.reconcile([a]) == ["b"]
    assert s.live == {"A": 1}
    assert s.reconcile([]) == ["a"]
    assert not s.policy.accounts["A"].backlogged


def admit_all(state, reqs, held_tokens=None):
    """Queue `reqs` and admit them in this order through the core (as a pass would), each then
    holding `held_tokens[rid]` (default: its prompt and output) of KV: running decodes."""
    core = state.core
    for r in reqs:
        state.on_arrival(r)
    core.begin_prefill(1 << 30, core.ledger.total_blocks, 0)
    for r in reqs:
        core.admit(core.entries[r.rid])
        n = (held_tokens or {}).get(r.rid, len(r.origin_input_ids) + len(r.output_ids))
        r.kv = SimpleNamespace(kv_allocated_len=n, kv_committed_len=n)
    core.end_prefill()


def retracted_first(state, reqs):
    """The rids of `reqs` in the order SGLang's retract_decode takes them (from the end)."""
    order = state.retraction_order(reqs)
    assert sorted(order) == list(range(len(reqs)))
    return [reqs[i].rid for i in order[::-1]]


def test_retraction_order_is_the_core_victim_order():
    """SGLang's decode retraction order is the core's victim rule (RoomMaker.victims_in_order),
    the one the reference engine's out-of-blocks preemption takes its victims from: the lowest
    tier first, then the newest admission; whatever order SGLang lists the batch in."""
    s = make_state()
    reqs = [FakeReq("i0", "I", 50, output=5), FakeReq("g0", "G", 50, tier="background"),
            FakeReq("i1", "I", 50), FakeReq("g1", "G", 50, tier="background"), FakeReq("b0", "B", 50, tier="batch")]
    admit_all(s, reqs)
    shuffled = [reqs[i] for i in (3, 0, 4, 2, 1)]
    assert retracted_first(s, shuffled) == ["g1", "g0", "b0", "i1", "i0"]
    assert retracted_first(s, shuffled) == [e.request_id for e in s.core.room.victims_in_order()]
    assert s.core.stall_victim().request_id == "g1"   # the reference's victim for nobody in particular


def bound_state(pool_tokens: int, **kw) -> FairShareState:
    """A state bound to a stand-in scheduler with a KV pool of `pool_tokens` (page size 1)."""
    s = make_state(**kw)
    s.scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(size=pool_tokens, available_size=lambda: 0),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0), page_size=1, chunked_prefill_size=256,
        max_running_requests=8)
    return s


def test_retraction_order_takes_the_tenant_furthest_over_its_soft_quota_first():
    """With the worker's KV quotas (the reference's KVQuotaConfig), the tenant over its soft quota
    loses its newest requests first, until it is back within its quota; then the newest admission.
    Without quotas the newest admission (B's) goes first."""
    from worker.scheduling.quota import KVQuotaConfig

    def order(**kw):
        s = bound_state(500, **kw)
        reqs = [FakeReq(f"a{i}", "A", 90, output=10) for i in range(4)] + [FakeReq("b0", "B", 90, output=10)]
        admit_all(s, reqs)     # A holds 400 of 500 tokens, B (the newest) 100
        return retracted_first(s, reqs[::-1])

    # soft quota: (500 - 0 headroom) / 2 = 250 each: A is over until two of its requests are gone
    assert order(kv_quota=KVQuotaConfig(enabled=True, headroom=0.0)) == ["a3", "a2", "b0", "a1", "a0"]
    assert order() == ["b0", "a3", "a2", "a1", "a0"]


def test_namespace_enforced_and_unverified_requests_isolated():
    s = make_state()
    ok = FakeReq("ok", "A", 10)
    forged = FakeReq("forged", "A", 10)
    forged.extra_key = tn.extra_key_for("B", None, SECRET)   # claims B's namespace
    salted = FakeReq("salted", "A", 10, salt="s1")
    salted.extra_key = tn.extra_key_for("A", None, SECRET)   # a salted request claiming the unsalted namespace
    s.on_arrival(ok)
    s.on_arrival(forged)
    s.on_arrival(salted)
    assert ok.extra_key == forged.extra_key == tn.extra_key_for("A", None, SECRET)
    assert salted.extra_key == tn.extra_key_for("A", "s1", SECRET) != ok.extra_key
    lora = FakeReq("lora", "A", 10, lora_id="adapter1")
    lora.extra_key += "adapter1"   # SGLang appends the LoRA id to the extra key
    s.on_arrival(lora)
    assert lora.extra_key.endswith("adapter1")
    anon = FakeReq("anon", None, 10)
    anon.extra_key = tn.extra_key_for("A", None, SECRET)     # a client that learnt A's key
    anon.sampling_params.custom_params = {tn.CUSTOM_PARAM_KEY: "v2.e30.deadbeef"}
    s.on_arrival(anon)
    assert anon.fairshare_tag.tenant_id == tn.UNVERIFIED_TENANT
    assert anon.extra_key.startswith(tn.UNVERIFIED_PREFIX)
    assert "A" in s.policy.accounts and s.live["A"] == 4 and s.live[tn.UNVERIFIED_TENANT] == 1


def test_deterministic_across_replicas():
    """Two schedulers (two TP ranks) fed the same events end in identical states."""
    def run():
        s = make_state()
        reqs = [FakeReq(f"r{i}", "ABC"[i % 3], 20 + i) for i in range(9)]
        for r in reqs:
            s.on_arrival(r)
        q = list(reqs)
        s.order_waiting(q)
        for r in q[:4]:
            r.prefix_len, r.extend_end = 0, len(r.origin_input_ids)
        s.charge_prefill(q[:4])
        for r in q[:4]:
            r.output_ids = [1, 2]
        s.charge_outputs(q[:4])
        s.order_waiting(q)
        return [r.rid for r in q], s.snapshot(), s.retraction_order(q[:4])
    assert run() == run()


def test_tenant_token_roundtrip_and_tamper():
    token = tn.sign("acme", 2.5, "batch", "k", rid="r1", now=1000.0)
    tag, expiry = tn.verify(token, "k", rid="r1", now=1000.0)
    assert tag == tn.TenantTag("acme", 2.5, "batch", verified=True) and expiry == 1000 + tn.INTERNAL_TTL_S
    assert tn.verify(token, "other-secret", rid="r1", now=1000.0) is None
    head, payload, mac = token.split(".")
    forged = tn.sign("evil", 100.0, "interactive", "attacker", rid="r1", now=1000.0)
    assert tn.verify(f"{head}.{forged.split('.')[1]}.{mac}", "k", rid="r1", now=1000.0) is None
    assert tn.verify(None, "k", rid="r1") is None and tn.verify(token, None, rid="r1") is None
    with pytest.raises(ValueError):
        tn.sign("acme", 0.0, "batch", "k", rid="r1")


def test_tenant_token_is_bound_to_its_request_and_expires():
    token = tn.sign("acme", 1.0, "interactive", "k", rid="r1", ttl_s=30, now=1000.0)
    assert tn.verify(token, "k", rid="r2", now=1000.0) is None                 # moved to another request
    assert tn.verify(token, "k", rid="r1", now=1030.0) is not None             # valid until its expiry ...
    assert tn.verify(token, "k", rid="r1", now=1031.0) is None                 # ... not after
    old_v2 = "v2." + token.split(".")[1] + "." + token.split(".")[2]           # the old, expiry-less format
    assert tn.verify(old_v2, "k", rid="r1", now=1000.0) is None


def test_replayed_tenant_token_is_accounted_unverified():
    """The same rid (with its valid token) on a second request object is a replay: unverified, in the
    unverified namespace; the first one keeps its tenant."""
    s = FairShareState(secret=SECRET)
    first, replay = FakeReq("r-1", "acme", 8), FakeReq("r-1", "acme", 8)
    replay.sampling_params.custom_params = dict(first.sampling_params.custom_params)  # the captured token
    assert s.tag_of(first).tenant_id == "acme" and s.tag_of(first).verified
    tag = s.tag_of(replay)
    assert tag.tenant_id == tn.UNVERIFIED_TENANT and not tag.verified
    assert replay.extra_key.startswith(tn.UNVERIFIED_PREFIX)


def test_state_from_env():
    from worker.sglang_plugin import QUOTA_ENV, TIERS_ENV

    s = state_from_env({"FAIRSHARE_SGLANG_POLICY": "fcfs", "FAIRSHARE_SGLANG_BETA": "3", tn.SECRET_ENV: "x",
                        QUOTA_ENV: '{"enabled": true, "watermark": 0.7, "soft": {"A": 0.5}}',
                        TIERS_ENV: '{"scheduling": true, "min_shares": {"background": 0.1}}'})
    assert s.policy.name == "fcfs" and s.cost.beta == 3.0 and s.secret == "x"
    assert s.kv_quota.watermark == 0.7 and s.kv_quota.soft == {"A": 0.5}
    assert s.core.quota is not None and s.core.tiers.min_share["background"] == 0.1
    assert state_from_env({}).core.quota is None                           # off unless configured
    for bad in ({QUOTA_ENV: '{"watermark": 2}'}, {QUOTA_ENV: '{"nope": 1}'}, {QUOTA_ENV: "[1]"},
                {TIERS_ENV: '{"min_shares": {"interactive": 0.1}}'}, {"FAIRSHARE_SGLANG_KV_QUOTAS": '{"A": 100}'}):
        with pytest.raises(ValueError):
            state_from_env(bad)


def test_plugin_env_carries_the_worker_flags():
    """`fairshare worker --engine sglang` parses the reference worker's --kv-* and --tier-* flags
    and hands them to the plugin unchanged."""
    from worker.sglang_server import build_parser, plugin_settings

    p = build_parser()
    args = p.parse_args(["--model", "m", "--kv-quota", "--kv-watermark", "0.6", "--kv-soft-quota", "A=0.4",
                         "--tier-min-share", "batch=0.1"])
    s = state_from_env(plugin_settings(p, args))
    assert s.kv_quota.watermark == 0.6 and s.kv_quota.soft == {"A": 0.4} and s.kv_quota.headroom == 0.05
    assert s.tier_min_shares["batch"] == 0.1 and s.tier_scheduling
    assert state_from_env(plugin_settings(p, p.parse_args(["--model", "m"]))).kv_quota is None
    with pytest.raises(SystemExit):
        plugin_settings(p, p.parse_args(["--model", "m", "--iteration-token-target", "64"]))


def test_register_refuses_a_bad_configuration(monkeypatch):
    """SGLang's load_plugins() swallows plugin exceptions; a misconfigured plugin must stop the
    process rather than serve without fairness."""
    import sys
    import types

    import worker.sglang_plugin as plugin

    fake_batch = types.ModuleType("sglang.srt.managers.schedule_batch")
    fake_batch.ScheduleBatch = type("ScheduleBatch", (), {"_get_decode_retraction_order": staticmethod(lambda reqs: [])})
    fake_registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    fake_registry.HookRegistry, fake_registry.HookType = object, object
    for name, mod in {"sglang": types.ModuleType("sglang"), "sglang.srt": types.ModuleType("sglang.srt"),
                      "sglang.srt.managers": types.ModuleType("sglang.srt.managers"),
                      "sglang.srt.managers.schedule_batch": fake_batch,
                      "sglang.srt.plugins": types.ModuleType("sglang.srt.plugins"),
                      "sglang.srt.plugins.hook_registry": fake_registry}.items():
        if "sglang" not in sys.modules or name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv("FAIRSHARE_SGLANG_KV_QUOTA", "[1, 2]")
    with pytest.raises(SystemExit, match="bad configuration"):
        plugin.register(force=True)
    monkeypatch.setenv("FAIRSHARE_SGLANG_POLICY", "off")
    assert plugin.register(force=True) is False
