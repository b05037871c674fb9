"""The gateway's OpenAI API against a real worker and a real Redis, through the official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.waits import wait_for

MODEL = "random-tiny"

TENANTS = [
    {"id": "api-a", "weight": 2.0, "tier": "interactive", "limits": {"rpm": 1000, "tpm": 1_000_000}},
    {"id": "api-b", "weight": 1.0, "tier": "batch", "limits": {"rpm": 1000, "tpm": 1_000_000}},
    {"id": "api-nomodels", "allowed_models": ["other-model"]},
]


METRICS_TOKEN = "metrics-test-token"


@pytest.fixture(scope="module")
def gw(gateway_factory):
    return gateway_factory(TENANTS, metrics_token=METRICS_TOKEN)


def test_models_list(gw):
    models = gw.client("api-a").models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert gw.client("api-nomodels").models.list().data == []


def test_chat_completion_basic(gw):
    c = gw.client("api-a")
    r = c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                    max_tokens=5, temperature=0)
    comp = r.parse()
    assert comp.object == "chat.completion" and comp.model == MODEL
    assert comp.choices[0].message.role == "assistant" and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 5 and comp.usage.prompt_tokens > 10
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + 5
    assert comp.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.headers["x-ratelimit-limit-requests"] == "1000"
    assert r.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < 1_000_000


def test_stream_basic(gw):
    c = gw.client("api-a")
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in chunks)


def test_401_missing_or_wrong_key_openai_shaped(gw):
    for headers in ({}, {"authorization": "Bearer sk-fs-wrong"}, {"authorization": "Basic abc"},
                    {"authorization": f"Bearer {gw.keys['api-a']}x"}):
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")):
            r = httpx.request(method, gw.base_url + path, headers=headers,
                              json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 401
            body = r.json()
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["code"] in ("invalid_api_key", "missing_api_key")
    bad = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="sk-fs-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "invalid_api_key" and "sk-fs-not-a-key" not in e.value.message
    # a rejected key charges nobody
    assert gw.leases("api-a") == {} and gw.bucket("api-b") is None


def test_text_completions_and_stop(gw):
    c = gw.client("api-b")
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 6
    text = r.choices[0].text
    assert text
    # a stop string taken from the greedy output ends the completion before it, with finish_reason stop
    stop = text.strip().split()[0] if text.strip() else text
    r2 = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                              stop=[stop])
    assert stop not in r2.choices[0].text and r2.choices[0].finish_reason == "stop"
    # token-id prompts
    r3 = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=2, temperature=0)
    assert r3.usage.prompt_tokens == 4


def test_seed_and_temperature_are_honoured(gw):
    c = gw.client("api-a")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=12)
    a = c.chat.completions.create(**kw, temperature=1.0, seed=42).choices[0].message.content
    b = c.chat.completions.create(**kw, temperature=1.0, seed=42).choices[0].message.content
    g1 = c.chat.completions.create(**kw, temperature=0).choices[0].message.content
    g2 = c.chat.completions.create(**kw, temperature=0, seed=1).choices[0].message.content
    assert a == b and g1 == g2
    others = {c.chat.completions.create(**kw, temperature=1.0, seed=s).choices[0].message.content for s in range(3)}
    assert len(others) > 1


def test_stream_equals_non_stream(gw):
    c = gw.client("api-a")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Écris un poème 🌸"}], max_tokens=20,
              temperature=0)
    full = c.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True)
                       if ch.choices)
    assert streamed == full and "\ufffd" not in full


def test_health_ready_metrics(gw):
    assert httpx.get(gw.base_url + "/healthz").json() == {"status": "ok"}
    # anyone learns whether it is ready and how many workers it has; not where they are, their load
    # (other tenants' traffic) or the models: those are for the metrics token, not for a tenant's key
    for h in ({}, {"authorization": f"Bearer {gw.keys['api-a']}"}):
        ready = httpx.get(gw.base_url + "/readyz", headers=h)
        body = ready.json()
        assert ready.status_code == 200 and body["redis"] and body["ready"]
        assert (body["workers_total"], body["workers_healthy"], body["workers_usable"]) == (1, 1, 1)
        assert not {"workers", "models"} & set(body), body
        assert gw.settings.workers[0] not in ready.text
    detail = httpx.get(gw.base_url + "/readyz", headers={"authorization": f"Bearer {METRICS_TOKEN}"}).json()
    assert detail["models"] == [MODEL]
    assert [(w["addr"], w["usable"]) for w in detail["workers"]] == [(gw.settings.workers[0], True)]
    assert set(detail["workers"][0]) >= {"inflight_tokens", "worker_id", "error"}
    gw.client("api-a").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    # every tenant's figures: refused to API clients (even with a valid key), served to the metrics token
    for h in ({}, {"authorization": f"Bearer {gw.keys['api-a']}"}):
        refused = httpx.get(gw.base_url + "/metrics", headers=h)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "metrics_forbidden"
    m = httpx.get(gw.base_url + "/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    assert 'fairshare_gateway_requests_total{endpoint="chat",status="200",tenant="api-a"}' in m.text
    assert 'fairshare_gateway_tokens_total{kind="completion",model="random-tiny",tenant="api-a"}' in m.text
    assert "fairshare_gateway_worker_up" in m.text


def test_lease_renewed_while_streaming_and_released_after(gateway_factory, control):
    """The worker stops relaying after the first message (test control: `stall_after`), so the stream
    stays open however fast the machine: the lease must be renewed past several TTLs, then released
    when the stream ends."""
    ttl_s = 1.0
    gw = gateway_factory([{"id": "renew", "limits": {"max_inflight_tokens": 5000}}], lease_ttl_s=ttl_s)
    control.inject("stall_after", tenant="renew", after=1)
    c = gw.client("renew")
    t_admit = gw.redis_time_ms()  # (before the admission)
    s = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=300,
                                  stream=True, extra_body={"ignore_eos": True})
    it = iter(s)
    next(it)
    (lease,) = gw.leases("renew")
    # renewed at least once after it would have expired: its expiry now lies beyond 2.5 TTLs after admission
    wait_for(lambda: gw.lease_expiry_ms("renew").get(lease, 0) > t_admit + 2.5 * ttl_s * 1000,
             lambda: f"lease {lease} renewed past 2.5 TTLs after admission; expiries {gw.lease_expiry_ms('renew')}")
    assert list(gw.leases("renew")) == [lease]  # live, the same one
    control.release_stalled()
    chunks = list(it)
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_for(lambda: gw.leases("renew") == {}, "lease released once the stream ended")


def test_redis_down_is_503_not_a_traceback(gateway_factory):
    from fairshare.ports import free_port

    gw = gateway_factory([{"id": "noredis", "limits": {"tpm": 1000}}], redis_url=f"redis://127.0.0.1:{free_port()}/0",
                         wait_ready_s=0)
    r = httpx.post(gw.base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {gw.keys['noredis']}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert "rate limiter is unavailable" in err["message"]
    ready = httpx.get(gw.base_url + "/readyz")
    assert ready.status_code == 503 and ready.json()["redis"] is False


def test_oversized_bodies_and_too_many_choices(gw):
    h = {"authorization": f"Bearer {gw.keys['api-a']}"}
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]}
    r = httpx.post(gw.base_url + "/v1/chat/completions", headers=h, json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(gw.base_url + "/v1/completions", headers=h, timeout=60,
                   json={"model": MODEL, "prompt": ["a"] * 20, "n": 4, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # a large prompt (tokenized off the event loop) still gets its exact context error
    r = httpx.post(gw.base_url + "/v1/completions", headers=h, timeout=60,
                   json={"model": MODEL, "prompt": "word " * 20000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" not in r.json()["error"]["message"]  # short enough to bound loosely: encoded, exact count
    # one of megabytes is refused from its length before it is encoded (no seconds of gateway CPU)
    for path, body in (("/v1/completions", {"prompt": "word " * 400_000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400_000}]})):
        r = httpx.post(gw.base_url + path, headers=h, timeout=60, json={"model": MODEL, "max_tokens": 1, **body})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text[:300]
        assert "resulted in at least" in err["message"] and err["param"] == ("prompt" if "prompt" in body else "messages")
    assert gw.leases("api-a") == {}
