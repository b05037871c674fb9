"""50 simultaneous requests against one tenant's limits: never more admitted than the limits allow;
afterwards no lease is left and the TPM bucket holds exactly what the admitted requests used.

The worker's engine is held (test control) until each of the 50 has its answer or holds a lease, so
the admitted requests are all in flight together on any machine: the in-flight and concurrency limits
bind for the whole burst instead of depending on how fast the first ones finish."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.support.waits import join_all, wait_for

MODEL = "random-tiny"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]
TPM = 6000          # 100 tokens/s refill
SEED_TOKENS = 600   # bucket content at the start of the burst
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory([
        {"id": "burst", "limits": {"tpm": TPM, "max_inflight_tokens": 300, "max_concurrent_requests": 8}},
        {"id": "burst-probe"},
    ])


def test_fifty_simultaneous_requests_stay_within_limits(gw, control):
    prompt = gw.client("burst-probe").chat.completions.create(model=MODEL, messages=MESSAGES,
                                                              max_tokens=1).usage.prompt_tokens
    cost = prompt + MAX_TOKENS
    client = gw.client("burst")
    t_seed = gw.seed_bucket("burst", "tpm", SEED_TOKENS)

    # watch Redis while the burst runs: leases never exceed the in-flight and concurrency limits
    watching = True
    peak = {"leases": 0, "tokens": 0}

    def watch():
        while watching:
            leases = gw.leases("burst")
            peak["leases"] = max(peak["leases"], len(leases))
            peak["tokens"] = max(peak["tokens"], sum(leases.values()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    barrier = threading.Barrier(50)
    results: list = [None] * 50

    def send(i):
        barrier.wait()
        try:
            results[i] = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                        temperature=1.0, seed=i)
        except openai.RateLimitError as e:
            results[i] = e

    threads = [threading.Thread(target=send, args=(i,)) for i in range(50)]
    with control.held():
        for t in threads:
            t.start()
        refused = lambda: sum(isinstance(r, openai.RateLimitError) for r in results)  # noqa: E731
        wait_for(lambda: refused() + len(gw.leases("burst")) == 50,
                 lambda: f"each of the 50 refused or holding a lease: {refused()} refused, {len(gw.leases('burst'))} held")
    join_all(threads, "50 simultaneous requests")
    elapsed_ms = gw.redis_time_ms() - t_seed  # bounds the TPM refill since the seed (Redis time)
    watching = False
    watcher.join()

    ok = [r for r in results if isinstance(r, openai.types.chat.ChatCompletion)]
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) + len(limited) == 50, results
    print(f"admitted {len(ok)}, limited {len(limited)}, cost {cost}, elapsed {elapsed_ms / 1000:.2f} s, peak {peak}")
    assert ok and limited
    assert len(ok) <= 300 // cost  # all in flight at once: the in-flight budget is the binding limit
    for e in limited:
        assert e.status_code == 429 and e.body["code"] == "rate_limit_exceeded"
    # admitted tokens (reserved) never exceed what the TPM bucket held plus its refill
    assert len(ok) * cost <= SEED_TOKENS + (TPM / 60000) * elapsed_ms + 1e-6
    assert peak["leases"] <= 8 and peak["tokens"] <= 300
    assert all(r.usage.prompt_tokens == prompt for r in ok)

    # after all finished: no lease, and the bucket = seed - used + refill since the seed, exactly
    assert gw.leases("burst") == {}
    raw = gw.redis.zcard(f"{gw.settings.key_prefix}:{{burst}}:leases")
    assert raw == 0
    used = sum(r.usage.total_tokens for r in ok)
    tokens, ts = gw.bucket("burst", "tpm")
    expected = SEED_TOKENS - used + (ts - t_seed) * (TPM / 60000)
    assert tokens == pytest.approx(expected, abs=1e-3)
