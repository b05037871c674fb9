"""Retry hints of concurrency and in-flight 429s (from the running requests' expected ends, not the
lease TTL), against a real redis-server; and through the gateway with the official client's retry.

Sizes are in tokens and seconds the tests choose; waits are on Redis or gateway state, never on the
clock (the hints are computed from stored expected ends, so they do not depend on machine speed).
"""

from __future__ import annotations

import threading
import uuid

import httpx
import openai
import pytest
from redis.asyncio import Redis

from fairshare.config import TenantConfig
from gateway.redis_buckets import RedisAdmission
from gateway.admission import AdmissionControl
from tests.reliability.conftest import wait_until
from tests.support.waits import join_all

MODEL = "random-tiny"
TTL_S = 15.0


def tenant(**limits) -> TenantConfig:
    return TenantConfig(id="hint-" + uuid.uuid4().hex[:10], limits=limits)


async def redis_s(adm: RedisAdmission) -> float:
    """Redis's clock (the one the stored expected ends are on), seconds."""
    sec, usec = await adm.redis.time()
    return sec + usec / 1e6


async def since(adm: RedisAdmission, t0: float) -> float:
    """Seconds of Redis time since `t0` (+ a millisecond of rounding): how much a hint computed
    meanwhile can have shrunk, however slow the machine."""
    return await redis_s(adm) - t0 + 0.001


@pytest.fixture
async def adm(redis_url):
    r = Redis.from_url(redis_url)
    a = RedisAdmission(r, lease_ttl_s=TTL_S)
    await a.load()
    yield a
    await r.aclose()


async def test_concurrency_hint_is_the_running_requests_expected_end(adm):
    t = tenant(max_concurrent_requests=1)
    t0 = await redis_s(adm)
    running = await adm.admit(t, 10, expected_s=2.0)
    assert running.admitted
    d = await adm.admit(t, 10)
    assert not d.admitted and d.reason == "concurrent_requests"
    # the running request is expected to end in 2 s (less the time since its admission), not in the TTL
    assert 2.0 - await since(adm, t0) <= d.retry_after_s <= 2.0
    # a fresher estimate from the gateway that runs it (it has 0.5 s left) wins over the stored one
    running.lease.remaining_s = lambda: 0.5
    d = await adm.admit(t, 10, running=[running.lease])
    assert not d.admitted and 0.5 <= d.retry_after_s <= 0.51
    await adm.settle(running.lease, 10)
    assert await adm.ends(t.id) == {}  # settling removes the expected end too


async def test_a_request_past_its_estimate_is_rechecked_in_a_second_and_an_unknown_one_at_expiry(adm):
    t = tenant(max_concurrent_requests=1)
    late = await adm.admit(t, 10, expected_s=0.0)  # expected to be done already: it overran
    d = await adm.admit(t, 10)
    assert not d.admitted and d.retry_after_s == pytest.approx(1.0, abs=0.01)
    await adm.settle(late.lease, 10)
    t0 = await redis_s(adm)
    unknown = await adm.admit(t, 10)  # no rate measured yet: no estimate
    d = await adm.admit(t, 10)
    assert not d.admitted and TTL_S - await since(adm, t0) <= d.retry_after_s <= TTL_S  # the lease's expiry
    await adm.settle(unknown.lease, 10)


async def test_inflight_hint_waits_for_enough_tokens_to_end(adm):
    t = tenant(max_inflight_tokens=700)
    t0 = await redis_s(adm)
    long = await adm.admit(t, 300, expected_s=3.0)
    short = await adm.admit(t, 300, expected_s=1.0)
    d = await adm.admit(t, 300)  # 600 + 300 > 700: 200 tokens must end; the 1-s lease frees 300
    assert not d.admitted and d.reason == "inflight_tokens"
    assert 1.0 - await since(adm, t0) <= d.retry_after_s <= 1.0
    d = await adm.admit(t, 500)  # 400 must end: both leases
    assert not d.admitted and 3.0 - await since(adm, t0) <= d.retry_after_s <= 3.0
    for x in (long, short):
        await adm.settle(x.lease, 300)


async def test_renewal_refreshes_the_expected_end(adm):
    t = tenant(max_concurrent_requests=1)
    d = await adm.admit(t, 10, expected_s=30.0)
    d.lease.remaining_s = lambda: 4.0
    t0 = await redis_s(adm)
    assert await adm.renew([d.lease]) == 1
    d2 = await adm.admit(t, 10)
    assert not d2.admitted and 4.0 - await since(adm, t0) <= d2.retry_after_s <= 4.0
    await adm.settle(d.lease, 10)


async def test_tpm_hint_is_still_the_refill_time(adm):
    t = tenant(tpm=600, max_concurrent_requests=5)  # 10 tokens/s
    t0 = await redis_s(adm)
    first = await adm.admit(t, 550, expected_s=0.5)
    d = await adm.admit(t, 100)  # 50 left, 50 missing at 10 tokens/s: 5 s less the refill since (not 0.5 s)
    assert not d.admitted and d.reason == "tokens" and 5.0 - await since(adm, t0) <= d.retry_after_s <= 5.0
    await adm.settle(first.lease, 550)


async def test_a_restarted_redis_gets_the_running_leases_back_before_the_next_admission(adm):
    """Redis restarted between two calls (redis-py reconnects on its own): the admission script is
    gone (NOSCRIPT), and so are the leases. The next admission restores them first, so it counts them."""
    control = AdmissionControl(adm, lambda tier: "fail_closed")
    t = tenant(max_concurrent_requests=1)
    running = await control.admit(t, 10, lease_id="running-" + uuid.uuid4().hex, expected_s=5.0)
    assert running.admitted
    # what a restart does to this tenant: scripts gone, keys gone
    await adm.redis.script_flush()
    await adm.redis.delete(*adm.keys(t.id), adm.ends_key(t.id))
    assert await adm.leases(t.id) == {}
    d = await control.admit(t, 10, lease_id="next-" + uuid.uuid4().hex)
    assert adm.scripts_lost == 1
    assert not d.admitted and d.reason == "concurrent_requests"  # the restored lease counted
    assert list(await adm.leases(t.id)) == [running.lease.lease_id]
    await control.settle(running.lease, 10)
    assert await adm.leases(t.id) == {}


# -- through the gateway, with the official client --------------------------------------------------

SHORT = [{"role": "user", "content": "Count slowly."}]


def _session(gw, tenant_id: str):
    live = [s for s in list(gw.app.state.gw.live) if s.tenant.id == tenant_id and not s.finished]  # running
    return live[0] if live else None


def test_inflight_429_says_when_the_blocking_request_ends_and_the_client_retry_succeeds(gateway_factory, control):
    """The in-flight budget is held by one stream; a second request is refused while the stream needs
    about 1 s more (its remaining tokens at the gateway's measured rate): retry-after <= 3 (not the
    15-s lease TTL), retry-after-ms precise, and the official client's own retry then succeeds.

    The test worker's engine holds the stream exactly that many tokens before its end (test control),
    so the refusal comes while it runs on any machine; the hold is let go when the client sees the 429."""
    gw = gateway_factory([{"id": "hint", "limits": {"max_inflight_tokens": 1000}}])
    state = gw.app.state.gw
    plain = gw.client("hint")
    # 1. the gateway measures the model's output rate on one finished stream
    list(plain.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=120, stream=True,
                                       extra_body={"ignore_eos": True}))
    wait_until(lambda: state.rates.rate(MODEL), "the gateway measured an output rate")
    rate = state.rates.rate(MODEL)
    one_second = max(1, int(rate))  # tokens the blocking stream makes in ~1 s at the measured rate

    # 2. the blocking stream: 600 output tokens, read to the end by a thread
    n_tokens = 600
    done = threading.Event()

    def consume():
        try:
            for _ in plain.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=n_tokens, stream=True,
                                                   extra_body={"ignore_eos": True}):
                pass
        finally:
            done.set()

    control.hold_when("token", tenant="hint", count=n_tokens - one_second)
    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    wait_until(lambda: (s := _session(gw, "hint")) is not None
               and s.jobs[0].completion_tokens == n_tokens - one_second and control.state()["held"],
               f"the blocking stream held {one_second} tokens (~1 s at {rate:.0f} tokens/s) before its end")
    assert not done.is_set()

    # 3. a request that does not fit beside it (its lease holds ~620 of 1000 tokens; this one needs ~420)
    seen: list[httpx.Response] = []

    def on_response(resp: httpx.Response) -> None:
        seen.append(resp)
        if resp.status_code == 429 and control.state()["held"]:  # refused while the stream runs: let it finish
            control.release()
            # The client's retry comes after the blocking stream has ended, on any machine: its remaining
            # tokens were sized by a rate measured earlier, and a loaded machine may make them slower.
            if not done.wait(120):
                raise AssertionError("the blocking stream never finished after its hold was let go")

    http = httpx.Client(event_hooks={"response": [on_response]}, timeout=60)
    retrying = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys["hint"], max_retries=10, http_client=http)
    r = retrying.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=400, temperature=0)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1

    first = seen[0]
    assert first.status_code == 429, [x.status_code for x in seen]
    first.read()
    assert "in-flight tokens" in first.json()["error"]["message"]
    retry_s, retry_ms = int(first.headers["retry-after"]), int(first.headers["retry-after-ms"])
    assert 1 <= retry_s <= 3, dict(first.headers)
    assert 1 <= retry_ms <= 3000 and retry_s == max(1, -(-retry_ms // 1000)), dict(first.headers)
    assert seen[-1].status_code == 200
    join_all([reader], "the blocking stream")
    http.close()
    assert done.is_set()
    wait_until(lambda: gw.leases("hint") == {}, "every lease of the tenant released")
    print(f"\nin-flight 429 while the blocking stream had <= {one_second} tokens left at {rate:.0f} tokens/s: "
          f"retry-after {retry_s} s, retry-after-ms {retry_ms}; {len(seen) - 1} retr{'y' if len(seen) == 2 else 'ies'}"
          " until 200")


def test_no_worker_503_carries_a_retry_hint(gateway_factory):
    from fairshare.ports import free_port

    gw = gateway_factory([{"id": "noworker"}], workers=[f"127.0.0.1:{free_port()}"], wait_ready_s=0)
    r = httpx.post(gw.base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {gw.keys['noworker']}"},
                   json={"model": MODEL, "messages": SHORT, "max_tokens": 2}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "service_unavailable"
    assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) >= 1
