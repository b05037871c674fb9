"""RadixCache (worker/cache/radix.py) and namespace derivation (worker/cache/namespace.py): match,
insert, split, reference counts, LRU eviction order, per-tenant footprint fairness, public
prefixes. Pure Python: no torch, no grpc."""

import subprocess
import sys

import pytest

from worker.cache.namespace import (GLOBAL_NAMESPACE, PUBLIC_NAMESPACE, derive_namespace, encode_fields,
                                    load_secret)
from worker.cache.radix import PUBLIC_OWNER, PrefixHits, RadixCache

BS = 4
SECRET = b"s" * 32


def toks(*blocks):
    """Token ids of whole blocks, each block given by one value: toks(1, 2) -> [1,1,1,1,2,2,2,2]."""
    return [v for b in blocks for v in [b] * BS]


def test_cache_package_imports_neither_torch_nor_grpc():
    code = ("import sys, worker.cache, worker.cache.radix, worker.cache.namespace; "
            "bad=[m for m in ('torch','grpc') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- namespaces -------------------------------------------------------------------------------------
def test_namespace_is_keyed_typed_and_split_by_salt():
    a = derive_namespace(SECRET, "tenant-a")
    assert a == derive_namespace(SECRET, "tenant-a", "")
    assert a.startswith("t") and len(a) == 65
    assert a != derive_namespace(SECRET, "tenant-b")
    assert a != derive_namespace(b"x" * 32, "tenant-a")              # keyed: another secret, another name
    assert derive_namespace(SECRET, "tenant-a", "s1") not in {a, derive_namespace(SECRET, "tenant-a", "s2")}
    # length-prefixed: moving characters between the tenant id and the salt changes the name
    assert derive_namespace(SECRET, "ab", "c") != derive_namespace(SECRET, "a", "bc")
    # a salt equal to another tenant's namespace (or id) never yields that namespace
    b = derive_namespace(SECRET, "tenant-b")
    assert derive_namespace(SECRET, "tenant-a", b) != b
    assert derive_namespace(SECRET, "tenant-a", "tenant-b") != b
    assert {PUBLIC_NAMESPACE, GLOBAL_NAMESPACE}.isdisjoint({a, b})
    assert encode_fields("ab", "c") != encode_fields("a", "bc")


def test_namespace_rejects_bad_input_and_secret_from_env():
    with pytest.raises(ValueError):
        derive_namespace(b"short", "a")
    with pytest.raises(ValueError):
        derive_namespace(SECRET, "")
    assert load_secret({"FAIRSHARE_CACHE_SECRET": "k" * 20}) == b"k" * 20
    with pytest.raises(ValueError):
        load_secret({"FAIRSHARE_CACHE_SECRET": "short"})
    r1, r2 = load_secret({}), load_secret({})
    assert len(r1) == 32 and r1 != r2


# ---- tree ---------------------------------------------------------------------------------------------
def test_match_insert_and_namespaces_are_separate():
    c = RadixCache(BS)
    assert c.match_prefix("A", toks(1, 2, 3)) == ([], 0)
    assert c.insert("A", toks(1, 2, 3) + [9], [10, 11, 12, 13], "a") == [10, 11, 12]  # partial block not cached
    assert c.match_prefix("A", toks(1, 2, 3, 4)) == ([10, 11, 12], 12)
    assert c.match_prefix("A", toks(1, 2) + [3, 3]) == ([10, 11], 8)      # a partial block never matches
    assert c.match_prefix("A", toks(2)) == ([], 0)
    assert c.match_prefix("B", toks(1, 2, 3)) == ([], 0)                  # another namespace: nothing
    assert c.num_blocks == 3 and c.footprint("a") == 3 and c.num_evictable == 0  # held by the inserter
    c.check()


def test_split_on_divergence_and_shared_upper_part():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2, 3), [0, 1, 2], "a")
    c.release([0, 1, 2])
    # a second request matched the first two blocks, then computed its own third
    blocks, n = c.acquire("A", toks(1, 2, 7), "a")
    assert (blocks, n) == ([0, 1], 8)
    assert c.insert("A", toks(1, 2, 7), [0, 1, 5], "a") == [5]
    c.check()
    assert c.match_prefix("A", toks(1, 2, 3)) == ([0, 1, 2], 12)
    assert c.match_prefix("A", toks(1, 2, 7)) == ([0, 1, 5], 12)
    assert c.refcount(0) == 1 and c.refcount(2) == 0 and c.refcount(5) == 1
    # the split keeps both branches reachable; a deeper insert under one branch extends it
    assert c.insert("A", toks(1, 2, 7, 8), [0, 1, 5, 6], "a") == [6]
    assert c.match_prefix("A", toks(1, 2, 7, 8, 9)) == ([0, 1, 5, 6], 16)
    c.check()


def test_duplicate_block_is_not_adopted_nor_anything_after_it():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2), [0, 1], "a")
    # a concurrent request computed the same prefix in its own blocks 7, 8 and went further
    assert c.insert("A", toks(1, 2, 3), [7, 8, 9], "a") == []
    assert not c.holds(7) and not c.holds(9)
    assert c.release([7, 8, 9]) == [7, 8, 9]                              # all private: the caller frees them
    c.check()


def test_refcounts_acquire_release_and_errors():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2), [0, 1], "a")
    assert c.num_evictable == 0
    c.acquire("A", toks(1, 2), "a")
    assert c.refcount(0) == 2
    assert c.release([0, 1, 5]) == [5]
    assert c.release([0, 1]) == []
    assert c.num_evictable == 2
    with pytest.raises(RuntimeError):
        c.release([0])
    with pytest.raises(ValueError):                                      # block 0 is cached already
        c.insert("B", toks(3), [0], "b")
    assert c.stats.tokens == PrefixHits(lookup_tokens=8, hit_tokens=8) and c.stats.by_tenant == {"a": c.stats.tokens}
    c.check()


def test_referenced_blocks_are_never_evicted():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2, 3), [0, 1, 2], "a")
    assert c.evict(10) == []
    c.release([2])                  # only the tail is unreferenced (the inserter keeps 0, 1)
    assert c.evict(10) == [2]
    assert c.evict(10) == []
    c.release([0, 1])
    assert sorted(c.evict(10)) == [0, 1] and c.num_blocks == 0
    c.check()


def test_eviction_is_lru_leaf_first_within_a_tenant():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2), [0, 1], "a")
    c.insert("A", toks(3, 4), [2, 3], "a")
    c.release([0, 1, 2, 3])
    c.acquire("A", toks(1, 2), "a")  # touch the first path: the second is now least recently used
    c.release([0, 1])
    assert c.evict(1) == [3]         # a leaf's tail block first
    assert c.evict(1) == [2]
    assert c.evict(2) == [1, 0]
    c.check()


def test_eviction_takes_from_the_tenant_most_over_its_share():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2), [0, 1], "a")          # tenant a: 2 blocks, older
    c.insert("B", toks(1, 2, 3, 4, 5, 6), list(range(10, 16)), "b")  # tenant b floods: 6 blocks
    c.release([0, 1] + list(range(10, 16)))
    # b is over its half share (4) by 2: it loses blocks first although a's are older
    assert c.evict(2) == [15, 14]
    assert c.footprints() == {"a": 2, "b": 4}
    assert c.evict(2) == [13, 12]                    # b still over (4 of 6, then 3 of 5)
    assert c.footprints() == {"a": 2, "b": 2}
    c.set_weight("b", 3.0)                           # weights move the shares: now a is over its 1/4
    assert c.evict(1) == [1] and c.footprints() == {"a": 1, "b": 2}
    assert c.evict(1) == [0]                         # a: 1 of 3 > 3/4
    c.check()


def test_flooding_tenant_cannot_flush_another_tenants_cache():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2, 3), [0, 1, 2], "a")
    c.release([0, 1, 2])
    nxt = 100
    for i in range(50):                              # b inserts and evicts to make room, 50 times
        c.insert("B", toks(100 + i, 200 + i), [nxt, nxt + 1], "b")
        c.release([nxt, nxt + 1])
        nxt += 2
        while c.num_blocks > 8:
            c.evict(1)
    assert c.match_prefix("A", toks(1, 2, 3)) == ([0, 1, 2], 12)
    c.check()


def test_public_prefix_shared_rest_private():
    sys_prompt = toks(5, 6) + [7, 7]                 # 2 whole blocks + 2 tokens: the blocks are public
    c = RadixCache(BS, public_prefixes=[sys_prompt])
    a_prompt = sys_prompt + [1, 1] + toks(8)         # the partial block is the tenant's
    assert c.insert("A", a_prompt, [0, 1, 2, 3], "a") == [0, 1, 2, 3]
    assert c.num_public_blocks == 2 and c.footprint("a") == 2 and c.footprint(PUBLIC_OWNER) == 2
    # another tenant with the same system prompt reuses the public blocks only
    assert c.match_prefix("B", sys_prompt + [1, 1] + toks(8)) == ([0, 1], 8)
    # the same suffix without the public prefix is a different tree (the KV depends on the prefix)
    assert c.match_prefix("A", toks(5, 6)) == ([0, 1], 8)
    assert c.match_prefix("A", toks(5) + [1, 1, 1, 1]) == ([], 0)        # only the whole public prefix is public
    c.release([0, 1, 2, 3])
    assert c.evict(2) == [3, 2]                      # private first, public last
    c.check()


def test_flush_frees_every_unreferenced_block():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2, 3), [0, 1, 2], "a")
    assert c.acquire("A", toks(1, 9), "a") == ([0], 4)
    c.insert("A", toks(1, 9), [0, 4], "a")
    c.release([0, 1, 2])
    c.release([0, 4])
    assert sorted(c.flush()) == [0, 1, 2, 4]
    assert c.num_blocks == 0 and c.num_evictable == 0 and c.footprints() == {}
    c.check()


def test_partly_matched_node_stays_evictable_after_another_lookup():
    c = RadixCache(BS)
    c.insert("A", toks(1, 2), [0, 1], "a")
    c.release([1])                       # the inserter keeps block 0; block 1 is evictable
    c.acquire("A", toks(1, 9), "a")      # a lookup that uses only block 0 of that node
    c.release([0])
    assert c.num_evictable == 1 and c.evict(5) == [1]
    c.check()


def test_sequence_growing_into_a_public_prefix_is_cached_only_once_decided():
    pub = toks(5, 6)
    c = RadixCache(BS, public_prefixes=[pub, pub + toks(7, 8)])
    assert c.insert("A", toks(5), [0], "a") == []              # could still become public: not cached
    assert c.insert("A", toks(5, 6), [0, 1], "a") == []        # still a beginning of the longer one
    assert c.insert("A", toks(5, 6, 7, 8, 9), [0, 1, 2, 3, 4], "a") == [0, 1, 2, 3, 4]
    assert c.num_public_blocks == 4 and c.footprint("a") == 1
    # a sequence that leaves the longer public prefix is public up to the shorter one only
    assert c.acquire("B", toks(5, 6, 7, 1), "b") == ([0, 1], 8)
    c.release([0, 1])
    assert c.acquire("B", toks(5, 6, 1, 1), "b") == ([0, 1], 8)
    assert c.insert("B", toks(5, 6, 1, 1), [0, 1, 9, 10], "b") == [9, 10]
    c.check()
