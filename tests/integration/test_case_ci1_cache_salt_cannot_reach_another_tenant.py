"""Case CI1 (shared/cases/cache-isolation.md) on the real system: a real gateway (Redis admission),
a real worker (random-tiny, its radix prefix cache on, FAIRSHARE_CACHE_SECRET known to the test) and
the official `openai` client.

Tenant A sends a 512-token prompt P twice: the second reports
`usage.prompt_tokens_details.cached_tokens > 0`. Tenant B then sends P with `cache_salt` set to every
string A's namespace might be (A's worker-side namespace computed with the worker's real secret,
a keyed hash of A's id under the gateway's secret, A's tenant id, path tricks, the empty salt, ...): every one reports
`cached_tokens == 0`, and GetLoad shows B was never served a cached token. As a control, the same
requests against a worker started with `--unsafe-global-cache` do reuse A's prefix across tenants,
so the assertions can fail.
"""

from __future__ import annotations

import hashlib
import hmac

import pytest

from tests.conftest import GATEWAY_TEST_SECRET
from tests.integration.cache_helpers import SECRET, cache_worker, cached_tokens, get_load, prompt_tokens
from worker.cache.namespace import derive_namespace

TENANTS = [{"id": "ci1-a", "limits": {"rpm": 10000, "tpm": 10_000_000}},
           {"id": "ci1-b", "limits": {"rpm": 10000, "tpm": 10_000_000}}]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with cache_worker(tmp_path_factory.mktemp("ci1")) as addr:
        yield addr


def b_salts() -> list[str]:
    a_ns = derive_namespace(SECRET.encode(), "ci1-a")
    return [a_ns,                                            # A's real namespace on this worker
            hmac.new(GATEWAY_TEST_SECRET.encode(), b"cache-ns:ci1-a", hashlib.sha256).hexdigest(),  # the gateway's secret
            "ci1-a", "/ci1-a", "../ci1-a", a_ns[1:], "t" + "0" * 64, "public", "global", "",
            "x" * 512]


def test_case_ci1_cached_for_the_owner_never_for_another_tenant(gateway_factory, worker):
    gw = gateway_factory(TENANTS, workers=[worker])
    a, b = gw.client("ci1-a"), gw.client("ci1-b")
    p = prompt_tokens(512, seed=1)
    assert cached_tokens(a, p) == 0
    assert cached_tokens(a, p) == 496        # 31 whole blocks of 16 (the last token is always computed)
    got = {salt: cached_tokens(b, p, salt or None) for salt in b_salts()}
    assert got == {salt: 0 for salt in b_salts()}, got
    # A's own cache is still there (B's requests did not flush it) and GetLoad agrees
    assert cached_tokens(a, p) == 496
    tenants = {t.tenant_id: t for t in get_load(worker).tenants}
    assert tenants["ci1-a"].cached_prompt_tokens == 2 * 496 and tenants["ci1-a"].cache_blocks >= 31
    assert tenants["ci1-b"].cached_prompt_tokens == 0
    load = get_load(worker)
    assert load.cache_hit_tokens == 2 * 496 and load.cache_lookup_tokens >= (3 + len(b_salts())) * 511


def test_case_ci1_control_unsafe_global_cache_does_leak(gateway_factory, tmp_path):
    with cache_worker(tmp_path, "--unsafe-global-cache") as addr:
        gw = gateway_factory(TENANTS, workers=[addr])
        p = prompt_tokens(512, seed=2)
        assert cached_tokens(gw.client("ci1-a"), p) == 0
        assert cached_tokens(gw.client("ci1-b"), p, "anything") == 496
