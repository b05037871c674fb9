"""The prefix-cache hit-rate benchmark (loadtests/bench/cache.py) on a small shared-prefix trace:
its invariants, not its figures."""

from __future__ import annotations

import pytest

from fairshare.workloads.shared_prefix import SMALL, WORKLOADS
from loadtests.bench.cache import MODES, format_table, replay, run_all

BS = 16


@pytest.fixture(scope="module")
def trace():
    reqs = SMALL.requests(seed=3)
    assert len({r.tenant_id for r in reqs}) == 4 and len(reqs) > 30
    return [(r.tenant_id, r.token_ids) for r in reqs], [SMALL.public_prompt(seed=3)]


def test_unbounded_cache_isolation_costs_no_same_tenant_reuse(trace):
    reqs, public = trace
    res = run_all(reqs, 0, BS, public)
    g, n, p = res["global"], res["namespaced"], res["namespaced+public"]
    assert g.total.lookup_tokens == n.total.lookup_tokens == p.total.lookup_tokens > 0
    # a tenant's reuse of its own prefixes is the same with or without namespaces ...
    assert g.total.same_tenant_tokens == n.total.same_tenant_tokens == p.total.same_tenant_tokens > 0
    assert g.by_tenant.keys() == n.by_tenant.keys()
    for t in g.by_tenant:
        assert g.by_tenant[t].same_tenant_tokens == n.by_tenant[t].same_tenant_tokens
    # ... in namespaced mode every hit is the tenant's own reuse, never a block another tenant inserted
    assert n.total.hit_tokens == n.total.same_tenant_tokens and n.cross_tenant_tokens == 0 and n.public_tokens == 0
    # with public prefixes the only cross-tenant reuse is the public tree's
    assert p.cross_tenant_tokens == 0 and p.public_tokens > 0
    assert p.total.hit_tokens - p.total.same_tenant_tokens <= p.public_tokens
    # the global cache does share other tenants' blocks (the public prompt): the check can see a leak
    assert g.cross_tenant_tokens > 0 and g.total.hit_tokens > n.total.hit_tokens
    # here only the public prompt is common to tenants, so promoting it wins all of it back
    assert p.total.hit_tokens == g.total.hit_tokens


def test_isolation_holds_under_eviction(trace):
    reqs, public = trace
    longest = max(len(t) for _, t in reqs)
    cap = -(-longest // BS) + 4     # barely more than one prompt: evicts nearly every time
    res = run_all(reqs, cap, BS, public)
    for mode in ("namespaced", "namespaced+public"):
        assert res[mode].evicted_blocks > 0 and res[mode].cross_tenant_tokens == 0
    assert res["namespaced"].total.hit_tokens == res["namespaced"].total.same_tenant_tokens
    assert all(r.total.hit_tokens <= r.total.lookup_tokens for r in res.values())
    text = format_table(res)
    assert f"capacity {cap} blocks" in text and "namespaced+public" in text


def test_replay_refuses_bad_arguments(trace):
    reqs, _ = trace
    with pytest.raises(ValueError, match="unknown mode"):
        replay(reqs, "shared")
    with pytest.raises(ValueError, match="does not fit"):
        replay(reqs, "namespaced", capacity_blocks=2)


def test_workloads_are_deterministic_and_share_only_the_public_prompt():
    a, b = SMALL.requests(seed=1), SMALL.requests(seed=1)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    pub = SMALL.public_prompt(seed=1)
    assert all(r.token_ids[:len(pub)] == pub for r in a)
    sys_of = {}
    for r in a:
        sys_of.setdefault(r.tenant_id, set()).add(r.token_ids[len(pub):len(pub) + SMALL.system_tokens])
    assert all(1 <= len(s) <= SMALL.system_prompts for s in sys_of.values())
    tenants = list(sys_of)
    assert not sys_of[tenants[0]] & sys_of[tenants[1]]
    assert set(MODES) == {"global", "namespaced", "namespaced+public"} and "shared-system-prompts" in WORKLOADS


def test_engine_mode_keeps_the_invariants():
    """The same trace through the real engine on the simulator (concurrent requests, decode)."""
    from loadtests.bench.cache import run_engine

    reqs = SMALL.requests(seed=3)
    public = [SMALL.public_prompt(seed=3)]
    res = {m: run_engine(reqs, m, 1024, BS, public) for m in MODES}
    g, n, p = res["global"], res["namespaced"], res["namespaced+public"]
    assert g.requests == n.requests == p.requests == len(reqs)
    assert n.total.hit_tokens == n.total.same_tenant_tokens > 0 and n.public_tokens == 0
    assert g.total.hit_tokens > n.total.hit_tokens and p.total.hit_tokens > n.total.hit_tokens and p.public_tokens > 0
    assert p.total.hit_tokens - p.total.same_tenant_tokens <= p.public_tokens
    assert "-" in format_table(res)       # cross-tenant hits are not measured on the engine
