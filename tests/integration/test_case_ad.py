"""Rate-limit and admission cases AD1-AD5 (shared/cases/admission.md) against the real gateway, worker
and Redis, through the official `openai` client."""

from __future__ import annotations

import math
import re
import threading

import httpx
import openai
import pytest

from tests.support.waits import join_all

MODEL = "random-tiny"
# a system message replaces the template's default one: ~20 prompt tokens in all
SHORT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours please."}]

TENANTS = [
    {"id": "ad1", "limits": {"tpm": 100}},
    {"id": "ad2", "limits": {"tpm": 1000}},
    {"id": "ad3", "limits": {"max_concurrent_requests": 1}},
    {"id": "ad4", "limits": {"tpm": 60000}},
    {"id": "ad5-tokens", "limits": {"tpm": 600, "rpm": 1000}},
    {"id": "ad5-requests", "limits": {"rpm": 2, "tpm": 100000}},
    {"id": "ad5-inflight", "limits": {"max_inflight_tokens": 300, "rpm": 100}},
]

DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(TENANTS)


def prompt_tokens(gw, messages) -> int:
    """Prompt size as the gateway counts it (measured on an unlimited-by-TPM tenant)."""
    return gw.client("ad3").chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens


def assert_429(err: openai.RateLimitError, type_: str):
    body = err.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_ and body["error"]["code"] == "rate_limit_exceeded"
    ra = err.response.headers["retry-after"]
    assert ra.isdigit() and int(ra) > 0
    return err.response.headers


def test_case_ad1_simultaneous_requests_respect_tpm(gw):
    p = prompt_tokens(gw, SHORT)
    assert 15 <= p <= 30  # "~20 prompt tokens": each request reserves p + 50 ~ 70 of 100
    client = gw.client("ad1")
    barrier = threading.Barrier(5)
    results: list = [None] * 5

    def send(i):
        barrier.wait()
        try:
            results[i] = client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=50, temperature=0)
        except openai.RateLimitError as e:
            results[i] = e

    threads = [threading.Thread(target=send, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    join_all(threads, "five simultaneous requests")
    ok = [r for r in results if not isinstance(r, Exception)]
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) == 1 and len(limited) == 4, results
    for e in limited:
        assert e.status_code == 429
        assert_429(e, "tokens")
    assert sum(r.usage.total_tokens for r in ok) <= 100
    assert gw.leases("ad1") == {}


def test_case_ad2_request_larger_than_tpm_is_rejected_up_front(gw):
    p = prompt_tokens(gw, SHORT)
    client = gw.client("ad2")
    with pytest.raises(openai.BadRequestError) as e:  # can never fit: 400, not 429
        client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=1001 - p)
    assert e.value.code == "request_too_large" and e.value.param == "max_tokens"
    assert "Limit 1000, Requested 1001" in e.value.message
    assert e.value.response.headers["x-ratelimit-limit-tokens"] == "1000"
    assert gw.bucket("ad2") is None and gw.leases("ad2") == {}  # nothing charged, nothing held
    # one token less fits: admitted (we stop reading after the first chunk; only what was used is kept)
    s = client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=1000 - p, temperature=0, stream=True)
    assert next(iter(s)).choices[0].delta.role == "assistant"
    s.close()
    # streamed: the same up-front 400, as JSON
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=5000, stream=True)
    # prompts that alone exceed the limit (one output token each would not fit): the prompt is named
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[[7] * 300] * 4, max_tokens=1)
    assert e.value.code == "request_too_large" and e.value.param == "prompt", e.value.body


def test_case_ad3_failed_request_releases_what_it_held(gw):
    client = gw.client("ad3")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert e.value.param == "messages.[0].role"
    r = client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=3)
    assert r.usage.completion_tokens <= 3
    # a request refused after tokenizing (too long for the context), then a valid one
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 3000}])
    assert client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=2).choices
    # a streamed request, then another: the first released its slot when it ended
    list(client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=3, stream=True))
    list(client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=3, stream=True))
    assert gw.leases("ad3") == {}


def charge_of(gw, tenant: str, run) -> tuple[float, object]:
    """Tokens the TPM bucket lost to `run()` (refill accounted for exactly from the stored timestamps)."""
    rate = 60000 / 60000.0  # tokens per ms for a 60000 TPM limit
    start = 10_000.0
    t_seed = gw.seed_bucket(tenant, "tpm", start)
    result = run()
    tokens, ts = gw.bucket(tenant, "tpm")
    assert tokens < 60000  # never clamped at capacity during the measurement
    return start + (ts - t_seed) * rate - tokens, result


def test_case_ad4_streamed_usage_charged_like_non_streamed(gw):
    client = gw.client("ad4")
    kw = dict(model=MODEL, messages=SHORT, max_tokens=12, temperature=0, seed=7)
    charge_plain, r = charge_of(gw, "ad4", lambda: client.chat.completions.create(**kw))
    assert charge_plain == pytest.approx(r.usage.prompt_tokens + r.usage.completion_tokens, abs=1e-3)

    def streamed():
        return list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))

    charge_stream, chunks = charge_of(gw, "ad4", streamed)
    u = chunks[-1].usage
    assert charge_stream == pytest.approx(u.prompt_tokens + u.completion_tokens, abs=1e-3)
    assert u.prompt_tokens == r.usage.prompt_tokens and u.completion_tokens == r.usage.completion_tokens
    assert charge_stream == pytest.approx(charge_plain, abs=1e-3)

    # streamed without include_usage: the same charge
    charge_nousage, chunks = charge_of(gw, "ad4", lambda: list(client.chat.completions.create(**kw, stream=True)))
    assert charge_nousage == pytest.approx(charge_plain, abs=1e-3)
    assert gw.leases("ad4") == {}


def test_case_ad5_429_headers_and_retry_after_from_refill(gw, control):
    # tokens: 600 TPM = 10 tokens/s = 0.01 tokens/ms; leave the bucket 35 tokens short of the request.
    # The bucket refills between the seed and the admission: `late` ms (Redis time) bound that gap.
    client = gw.client("ad5-tokens")
    p = prompt_tokens(gw, SHORT)
    cost = p + 50
    t_seed = gw.seed_bucket("ad5-tokens", "tpm", cost - 35)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=50)
    late = gw.redis_time_ms() - t_seed
    h = assert_429(e.value, "tokens")
    retry_ms = int(h["retry-after-ms"])
    assert 3500 - late - 1 <= retry_ms <= 3500          # (35 tokens - the refill since the seed) / 0.01 per ms
    assert int(h["retry-after"]) == math.ceil(retry_ms / 1000)  # ceil(3.5 s) = 4 when admitted at once
    assert h["x-ratelimit-limit-tokens"] == "600"
    assert cost - 35 <= int(h["x-ratelimit-remaining-tokens"]) <= cost - 35 + int(late * 0.01)
    assert DURATION.match(h["x-ratelimit-reset-tokens"]) and h["x-ratelimit-reset-tokens"].startswith("5")
    assert h["x-ratelimit-limit-requests"] == "1000" and DURATION.match(h["x-ratelimit-reset-requests"])
    assert f"Requested {cost}" in e.value.message

    # requests: 2 RPM = one request per 30 s
    # The bucket (capacity 2) refills from the first request on: the refused one waits for the token the
    # first request took, i.e. 30 s minus the time since the first request's admission (not the second's).
    client = gw.client("ad5-requests")
    t_first = gw.redis_time_ms()  # (before the first of the two requests that empty the bucket)
    for _ in range(2):
        r = client.chat.completions.with_raw_response.create(model=MODEL, messages=SHORT, max_tokens=1)
        assert DURATION.match(r.headers["x-ratelimit-reset-requests"])
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=1)
    since_s = (gw.redis_time_ms() - t_first) / 1000
    h = assert_429(e.value, "requests")
    assert math.ceil(30 - since_s) <= int(h["retry-after"]) <= 30  # 30 s minus the time since the first admission
    assert h["x-ratelimit-remaining-requests"] == "0" and h["x-ratelimit-limit-requests"] == "2"

    # in-flight tokens: the 429 names tokens, and retry-after is bounded by the lease TTL
    client = gw.client("ad5-inflight")
    control.hold_when("token", tenant="ad5-inflight", count=1)  # the stream stays in flight, on any machine
    s = client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=250, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(s))
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=100)
    h = assert_429(e.value, "tokens")
    assert 1 <= int(h["retry-after"]) <= 15
    s.close()


def test_headers_on_every_response_including_streams_and_errors(gw):
    key = gw.keys["ad4"]
    h = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", gw.base_url + "/v1/chat/completions", headers=h, timeout=60,
                      json={"model": MODEL, "messages": SHORT, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-ratelimit-limit-tokens"] == "60000"
        assert r.headers["x-ratelimit-remaining-tokens"].isdigit()
        assert DURATION.match(r.headers["x-ratelimit-reset-tokens"])
        r.read()
    bad = httpx.post(gw.base_url + "/v1/chat/completions", headers=h, json={"model": MODEL, "messages": []})
    assert bad.status_code == 400 and bad.headers["x-ratelimit-limit-tokens"] == "60000"
    models = httpx.get(gw.base_url + "/v1/models", headers=h)
    assert models.status_code == 200 and models.headers["x-ratelimit-limit-tokens"] == "60000"
