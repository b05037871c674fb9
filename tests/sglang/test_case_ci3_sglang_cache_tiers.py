"""Case CI3 (../shared/cases/cache-isolation.md) on the SGLang backend: the same prompt under
different namespaces is never reused, at every cache tier SGLang 0.5.23 has.

The namespace is the worker-derived one (`worker.cache.namespace.derive_namespace` over the
verified tenant id and the client's `cache_salt`), which the plugin puts into each request's
`extra_key` when SGLang queues it (`Scheduler._add_request_to_queue`, patched by the plugin
loaded through SGLang's own `load_plugins()`). Requests are real SGLang `Req`s; the trees are
SGLang's own classes, run on CPU without KV pools (values are stand-in index tensors):

- device tier: `UnifiedRadixCache` (0.5.23's default tree; default tree core, i.e. the Rust one
  where it is available, and the Python core) and the legacy `RadixCache`, page sizes 1 and 16;
- HiCache host tier: host copies live on the same tree nodes as device KV. A node is put into the
  state HiCache's write-back followed by device eviction leaves it in (FULL `host_value` set,
  device `value` None), then the real match walk reports what is reusable from device or host;
- HiCache storage tier: page keys are the hash chains SGLang computes for storage
  (`compute_node_hash_values`, seeded by `storage_namespace_seed(extra_key, cache_salt)`), taken
  from the real tree with `backfill_missing_hash_values`.
"""

from __future__ import annotations

from array import array

import pytest

from tests.sglang import cpu_sglang

cpu_sglang.prepare()

import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from tests.sglang.test_sglang_hooks import StubScheduler, arrive, make_req, sglang_runtime, state  # noqa: E402,F401
from worker.sglang_plugin import tenant as tn  # noqa: E402

PROMPT = list(range(1000, 1064))  # 64 tokens: 4 pages of 16


def make_tree(kind: str, page_size: int):
    if kind == "radix":
        return RadixCache.create_simulated(page_size=page_size)
    core = {"unified-default": None, "unified-python": "python"}[kind]
    return UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                             page_size=page_size, tree_components=(ComponentType.FULL,),
                                             tree_core_backend=core))


def key_of(req, tokens=PROMPT) -> RadixKey:
    return RadixKey(array("q", tokens), extra_key=req.extra_key, cache_salt=req.cache_salt)


def insert(tree, req, tokens=PROMPT):
    tree.insert(InsertParams(key=key_of(req, tokens), value=torch.arange(len(tokens))))


@pytest.fixture
def reqs(state):
    """The requests of the case, queued through SGLang's (patched) scheduler entry point."""
    r = {
        "a1": make_req("a1", "A", PROMPT), "a2": make_req("a2", "A", PROMPT),
        "b1": make_req("b1", "B", PROMPT),
        "a_salted": make_req("a3", "A", PROMPT, salt="client-salt"),
        "b_salted_as_a": make_req("b2", "B", PROMPT, salt="client-salt"),   # B with A's salt
        "b_claims_a": make_req("b3", "B", PROMPT),                          # B's request naming A's key
        "unsigned": make_req("x1", "A", PROMPT, signed=False),              # no valid tenant token
    }
    r["b_claims_a"].extra_key = r["a1"].extra_key
    r["unsigned"].extra_key = r["a1"].extra_key
    arrive(StubScheduler(), *r.values())
    return r


def test_namespace_is_the_worker_derived_one(reqs):
    secret = tn.cache_secret(tn.ensure_secret())
    from worker.cache.namespace import derive_namespace

    assert reqs["a1"].extra_key == reqs["a2"].extra_key == "fs|" + derive_namespace(secret, "A", "")
    assert reqs["a_salted"].extra_key == "fs|" + derive_namespace(secret, "A", "client-salt")
    assert reqs["b1"].extra_key == reqs["b_claims_a"].extra_key == "fs|" + derive_namespace(secret, "B", "")
    assert reqs["unsigned"].extra_key.startswith(tn.UNVERIFIED_PREFIX)
    assert len({r.extra_key for r in reqs.values()}) == 5


@pytest.mark.parametrize("kind", ["radix", "unified-default", "unified-python"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_device_tier_same_namespace_matches_other_namespaces_do_not(reqs, kind, page_size):
    tree = make_tree(kind, page_size)
    insert(tree, reqs["a1"])   # A's request computed the prompt: its KV is cached under A's namespace

    def match(name):
        return tree.match_prefix(MatchPrefixParams(key=key_of(reqs[name]))).device_prefix_len

    assert match("a2") == len(PROMPT)            # same namespace: reused
    for other in ("b1", "a_salted", "b_salted_as_a", "b_claims_a", "unsigned"):
        assert match(other) == 0, other          # the same tokens, nothing shared
    insert(tree, reqs["b1"])                     # B computes it too: two disjoint copies
    assert match("b1") == len(PROMPT) and match("a2") == len(PROMPT) and match("a_salted") == 0
    if kind == "radix":                          # SGLang's own request-side matching agrees
        reqs["b_claims_a"].init_next_round_input(RadixCache.create_simulated(page_size=page_size))
        fresh = RadixCache.create_simulated(page_size=page_size)
        insert(fresh, reqs["a1"])
        reqs["b_claims_a"].init_next_round_input(fresh)
        reqs["a2"].init_next_round_input(fresh)
        assert reqs["b_claims_a"].prefix_len == 0 and reqs["a2"].prefix_len > 0


def test_hicache_host_tier_copies_are_reachable_only_from_their_namespace(reqs):
    tree = make_tree("unified-python", 16)
    insert(tree, reqs["a1"])
    core = tree.tree_core
    host_only = 0
    for node in list(core.root_node.children.values()):   # A's prompt: written back to host, evicted from device
        stack = [node]
        while stack:
            n = stack.pop()
            data = n.component_data[ComponentType.FULL]
            data.host_value, data.value = data.value.clone(), None
            host_only += len(n.key)
            stack.extend(n.children.values())
    assert host_only == len(PROMPT)

    def match(name):
        return tree.match_prefix(MatchPrefixParams(key=key_of(reqs[name])))

    hit = match("a2")
    assert hit.device_prefix_len == 0 and hit.full_kv_hit_length == len(PROMPT)   # on host, for A
    for other in ("b1", "a_salted", "b_salted_as_a", "b_claims_a", "unsigned"):
        assert match(other).full_kv_hit_length == 0, other


def test_hicache_storage_tier_page_keys_are_disjoint_across_namespaces(reqs):
    names = ("a1", "b1", "a_salted", "b_salted_as_a", "unsigned")
    tree = make_tree("unified-python", 16)
    for name in names:
        insert(tree, reqs[name])
    assert tree.tree_core.backfill_missing_hash_values() >= len(names)
    chains = {}
    for node in tree.tree_core.root_node.children.values():
        chains[(node.key.extra_key, node.key.cache_salt)] = list(node.hash_value)
    assert len(chains) == len(names) and all(len(c) == len(PROMPT) // 16 for c in chains.values())
    keys = [set(c) for c in chains.values()]
    assert sum(map(len, keys)) == len(set().union(*keys))       # no storage page key in two namespaces
    # the keys a worker uses to look pages up (prefetch) agree with the tree's, per namespace
    for name in names:
        req = reqs[name]
        assert get_storage_hash_str(key_of(req), page_size=16) == chains[(req.extra_key, req.cache_salt)]
    # a second worker with the same secret finds A's pages under A's namespace, and only there
    other = make_tree("unified-python", 16)
    insert(other, reqs["a2"])
    other.tree_core.backfill_missing_hash_values()
    (node,) = other.tree_core.root_node.children.values()
    assert node.hash_value == chains[(reqs["a1"].extra_key, None)]


def test_namespaces_differ_under_another_cache_secret(monkeypatch):
    secret = tn.ensure_secret()
    default = tn.extra_key_for("A", None, secret)
    monkeypatch.setenv("FAIRSHARE_CACHE_SECRET", "operator-set cache secret, 32+ bytes")
    configured = tn.extra_key_for("A", None, secret)
    assert configured != default and configured == tn.extra_key_for("A", None, "another token secret")
    monkeypatch.setenv("FAIRSHARE_CACHE_SECRET", "short")
    with pytest.raises(ValueError):
        tn.extra_key_for("A", None, secret)
