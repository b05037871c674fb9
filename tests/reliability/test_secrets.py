"""Secrets: API keys never appear in logs, traces or metrics, and the public port's /metrics does not
let a tenant read anyone's figures.

A `fairshare gateway` subprocess runs with debug logging (uvicorn's access log on) and traces printed
to stdout (``--otel-exporter console``), its metrics on an admin listener. Two tenants send
streamed and plain requests; clients also send wrong keys that look real, a key in the URL's query
string, a key in an ``x-api-key`` header and a revoked-looking key. Everything the system wrote is
then captured and searched for every key (whole, and any 12-character piece of its secret part) and
for the server secret: the gateway's stdout/stderr (logs and spans), both workers' logs, the
metrics of the admin listener, and every key and value the gateway stored in Redis.
"""

from __future__ import annotations

import time

import httpx
import redis

from fairshare.ports import free_port
from tests.reliability.conftest import HELLO, MODEL, SECRET, GatewayProcess, assert_error_response


def pieces(key: str, n: int = 12) -> list[str]:
    """The key and every n-character piece of its secret part (after ``sk-fs-``)."""
    secret = key.split("sk-fs-", 1)[-1]
    return [key] + [secret[i:i + n] for i in range(0, max(1, len(secret) - n + 1))]


def test_keys_never_in_logs_traces_metrics_or_redis(workers, redis_url, tmp_path):
    mport = free_port()
    prefix = "fs-rel-secrets"
    g = GatewayProcess(tmp_path, [{"id": "sec-a", "limits": {"tpm": 10**6}}, {"id": "sec-b", "tier": "batch"}],
                       workers.addrs, redis_url, "--log-level", "debug", "--otel-exporter", "console",
                       "--metrics-port", str(mport), env={"FAIRSHARE_KEY_PREFIX": prefix}).wait_ready()
    fake = ["sk-fs-" + "Q" * 30 + "LEAKCHECK1", "sk-fs-totallyplausiblebutwrongkey0001", "sk-proj-notours0123456789"]
    try:
        for tenant in ("sec-a", "sec-b"):
            c = g.client(tenant)
            c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
            list(c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, stream=True))
            c.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            c.models.list()
            # a 400 after authentication, with the key still in the header
            assert_error_response(httpx.post(g.base_url + "/v1/chat/completions", headers=g.headers(tenant),
                                             json={"model": MODEL, "messages": []}), 400)
            # the key in places a careless client puts it
            httpx.get(g.base_url + f"/v1/models?api_key={g.keys[tenant]}")
            httpx.get(g.base_url + "/v1/models", headers={"x-api-key": g.keys[tenant]})
            httpx.post(g.base_url + f"/v1/chat/completions?key={g.keys[tenant]}", headers=g.headers(tenant),
                       json={"model": MODEL, "messages": HELLO, "max_tokens": 1})
        for k in fake:
            r = httpx.post(g.base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {k}"},
                           json={"model": MODEL, "messages": HELLO})
            assert assert_error_response(r, 401)["code"] == "invalid_api_key"

        # /metrics: refused on the public port, with or without a tenant key; served on the admin port
        for h in ({}, g.headers("sec-a")):
            r = httpx.get(g.base_url + "/metrics", headers=h)
            err = assert_error_response(r, 403)
            assert "sec-b" not in r.text and "fairshare_gateway" not in r.text
        metrics = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
        assert 'tenant="sec-a"' in metrics and 'tenant="sec-b"' in metrics  # the operator sees both
        assert err["code"] == "metrics_forbidden"

        stored = []
        rc = redis.Redis.from_url(redis_url)
        # scan while a request is in flight: its buckets were just touched and its lease is held (bucket
        # keys expire about a second after their last use, which a loaded machine can overrun); its worker
        # stops relaying after the first message until the scan is done, so it is in flight on any machine
        for i in range(2):
            workers.control(i).inject("stall_after", tenant="sec-a", after=1, times=1)
        live = g.client("sec-a").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=64, stream=True)
        next(iter(live))
        for k in rc.scan_iter(match=f"{prefix}:*"):
            stored.append(k.decode())
            t = rc.type(k).decode()
            if t == "hash":
                stored += [f"{a.decode()}={b.decode()}" for a, b in rc.hgetall(k).items()]
            elif t == "zset":
                stored += [m.decode() for m in rc.zrange(k, 0, -1)]
        for i in range(2):
            workers.control(i).release_stalled()
        for _ in live:
            pass
    finally:
        g.stop()
    out = g.log()
    captured = {"gateway logs and traces": out, "worker logs": workers.logs(), "metrics": metrics,
                "redis": "\n".join(stored)}
    assert '"name": "gateway.request"' in out and "GET /v1/models?api_key=***" in out  # traces and access log on
    needles = [p for k in list(g.keys.values()) + fake for p in pieces(k)] + [SECRET]
    for where, text in captured.items():
        assert text, where
        leaks = sorted({n for n in needles if n in text})
        assert not leaks, f"{where} contains {leaks[:3]}"
    print(f"\nsecrets: searched {sum(len(t) for t in captured.values())} characters of logs, traces, metrics "
          f"and Redis for {len(needles)} key pieces: none found")
