"""Case CI3 (shared/cases/cache-isolation.md) on the real system (gateway, Redis, a random-tiny
worker, the official `openai` client): the same prompt under different salts and tenants is never
reused across namespaces, at every cache tier the worker has.

The reference worker has one KV tier (the paged pool, whose blocks the radix cache keeps) and two
kinds of trees in it: each namespace's private tree and the public tree of operator-listed
prefixes. The worker here lists a public prefix, so both are exercised: a prompt that does not
start with it is reused only within its own (tenant, salt) namespace; one that does is reused
across namespaces for exactly the public prefix's whole blocks and not one token more.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.cache_helpers import cache_worker, cached_tokens, get_load, prompt_tokens

TENANTS = [{"id": f"ci3-{t}", "limits": {"rpm": 10000, "tpm": 10_000_000}} for t in ("a", "b", "c")]
PUBLIC = prompt_tokens(100, seed=9)        # 6 whole blocks (96 tokens) are public
SALTS = [None, "s1", "s2", "S1", "s1 ", "ci3-b"]


@pytest.fixture(scope="module")
def gw(gateway_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("ci3")
    (d / "public.json").write_text(json.dumps([PUBLIC]))
    with cache_worker(d, "--public-prefix-file", str(d / "public.json")) as addr:
        yield gateway_factory(TENANTS, workers=[addr]), addr


def test_case_ci3_private_prompt_reused_only_in_its_own_namespace(gw):
    g, addr = gw
    p = prompt_tokens(512, seed=3)
    for tenant in ("ci3-a", "ci3-b", "ci3-c"):
        client = g.client(tenant)
        for salt in SALTS:                    # each (tenant, salt) is a fresh namespace: nothing reused
            assert cached_tokens(client, p, salt) == 0, (tenant, salt)
    for tenant in ("ci3-a", "ci3-b", "ci3-c"):  # ... and each one did cache P for itself
        for salt in SALTS:
            assert cached_tokens(g.client(tenant), p, salt) == 496, (tenant, salt)
    load = get_load(addr)
    assert load.cache_public_blocks == 0


def test_case_ci3_public_prefix_shared_but_nothing_after_it(gw):
    g, addr = gw
    tail = prompt_tokens(300, seed=4)
    p = PUBLIC + tail                         # 400 tokens: 96 public, the rest private
    assert cached_tokens(g.client("ci3-a"), p, "pub") == 0
    assert cached_tokens(g.client("ci3-a"), p, "pub") == 384          # A's own namespace: 24 blocks
    for tenant in ("ci3-b", "ci3-c"):
        for salt in ("pub", None):
            assert cached_tokens(g.client(tenant), p, salt) == 96, (tenant, salt)  # the public blocks only
    assert get_load(addr).cache_public_blocks == 6
