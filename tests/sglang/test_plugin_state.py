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

    def __init__(self, rid, tenant, prompt_len, weight=1.0, salt=None, output=0, lora_id=None, max_new=16):
        token = tn.sign(tenant, weight, "interactive", SECRET, rid=rid) if tenant else None
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


def test_retraction_order_over_quota_first():
    s = make_state()
    # A holds 3 x 100 tokens, B 1 x 100: equal weights -> quotas 200 each; A is over.
    a = [FakeReq(f"a{i}", "A", 90, output=10) for i in range(3)]
    b = [FakeReq("b0", "B", 50, output=50)]
    reqs = [b[0], a[0], a[1], a[2]]
    for r in reqs:
        s.on_arrival(r)
    order = s.retraction_order(reqs)
    assert sorted(order) == [0, 1, 2, 3]
    # SGLang retracts from the end: A's requests go first while A is over or at its quota
    # (300/200, then 200/200 against B's 100/200); only then (tie at 100/200) is B touched.
    assert [reqs[i].rid[0] for i in order[::-1][:2]] == ["a", "a"]


def test_retraction_order_respects_weights_and_configured_quotas():
    s = make_state()
    a = FakeReq("a", "A", 100, weight=3.0)
    b = FakeReq("b", "B", 100, weight=1.0)
    c = FakeReq("c", "B", 100, weight=1.0)
    reqs = [a, b, c]
    for r in reqs:
        s.on_arrival(r)
    # weighted shares of 300 tokens: A 225, B 75: B (200/75) is the one over quota
    assert [reqs[i].rid for i in s.retraction_order(reqs)][-1] in ("b", "c")
    assert [reqs[i].rid for i in s.retraction_order(reqs)][0] == "a"
    q = make_state(kv_quotas={"A": 10.0})
    for r in (FakeReq("a", "A", 100, weight=3.0), FakeReq("b", "B", 100), FakeReq("c", "B", 100)):
        q.on_arrival(r)
    assert [reqs[i].rid for i in q.retraction_order(reqs)][-1] == "a"  # A is 10x over its configured quota


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
    s = state_from_env({"FAIRSHARE_SGLANG_POLICY": "fcfs", "FAIRSHARE_SGLANG_BETA": "3",
                        "FAIRSHARE_SGLANG_KV_QUOTAS": '{"A": 100}', tn.SECRET_ENV: "x"})
    assert s.policy.name == "fcfs" and s.cost.beta == 3.0 and s.kv_quotas == {"A": 100} and s.secret == "x"
    with pytest.raises(ValueError):
        state_from_env({"FAIRSHARE_SGLANG_KV_QUOTAS": '{"A": -1}'})


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
    monkeypatch.setenv("FAIRSHARE_SGLANG_KV_QUOTAS", "[1, 2]")
    with pytest.raises(SystemExit, match="bad configuration"):
        plugin.register(force=True)
    monkeypatch.setenv("FAIRSHARE_SGLANG_POLICY", "off")
    assert plugin.register(force=True) is False
