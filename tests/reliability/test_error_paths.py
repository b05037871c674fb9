"""Every error path after admission settles: the lease is released and exactly the unused part of the
TPM reservation is refunded.

Paths, each streamed and not: an upstream error in the middle of the generation (the worker fails the
call with INTERNAL after 3 messages), the model's forward pass failing in the middle of the generation
(the engine's real failure path), the gateway's request timeout (504 / error event), the client going
away (a stream closed after two chunks, a plain request whose client times out) and a validation
failure after admission (the worker refuses the request with INVALID_ARGUMENT: 400). The faults are
the test workers' (tests/support/worker_control.py). Where the path needs a generation that is still
going (timeouts, the client leaving), the worker stops relaying after a few messages (`stall_after`),
so the request cannot finish first on a fast machine.

The check is exact: with the TPM bucket seeded at 2000 tokens, after the request the stored bucket is
``2000 + refill - used`` where ``used`` is what the gateway settled (prompt + completion tokens it
received) and ``refill`` is the bucket's continuous refill between the two stored timestamps: the
reservation (prompt + 1500) is charged at admission and everything not used comes back.
"""

from __future__ import annotations


import httpx
import pytest
import redis

from tests.reliability.conftest import (HELLO, MODEL, InProcessGateway, assert_error_object, assert_error_response,
                                        idle, lease_state, open_stream, read_stream, wait_until)

TPM = 3000
SEED = 2000.0
RATE = TPM / 60000.0  # tokens per ms
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def gw(two_workers, redis_url, tmp_path_factory):
    two_workers.ensure_alive()
    # only the gateway-timeout path runs under a short deadline (its tenant's own); the others have none
    # that a loaded machine could reach before the fault they test
    tenants = [{"id": "ep", "limits": {"tpm": TPM}}, {"id": "ept", "limits": {"tpm": TPM}, "request_timeout_s": 2.0}]
    g = InProcessGateway(tmp_path_factory.mktemp("gw"), tenants, two_workers.addrs, redis_url).wait_ready()
    yield g
    g.stop()


def tenant_of(path: str) -> str:
    """The tenant a path's request is sent as: the one with a 2 s deadline for the gateway timeout."""
    return "ept" if path == "gateway_timeout" else "ep"


def used_tokens(gw: InProcessGateway, tenant: str) -> float:
    total = 0.0
    for fam in gw.gw.metrics.registry.collect():
        if fam.name == "fairshare_gateway_tokens":
            total += sum(s.value for s in fam.samples if s.name.endswith("_total")
                         and s.labels.get("tenant") == tenant and s.labels.get("kind") in ("prompt", "completion"))
    return total


BODY = {"model": MODEL, "messages": HELLO, "max_tokens": MAX_TOKENS, "ignore_eos": True}


FAULTS = {  # path -> the fault armed on both workers for the tenant's next request
    "upstream_error": dict(kind="error_after", after=3, times=1),
    "model_forward_failure": dict(kind="forward_error", after=2),
    "rejected_after_admission": dict(kind="reject", times=1),
    "gateway_timeout": dict(kind="stall_after", after=1),
    "client_cancel": dict(kind="stall_after", after=4),
}


def run_path(gw: InProcessGateway, path: str, stream: bool) -> str:
    """Send one request that fails on `path`; return what the client saw (for the report)."""
    http = httpx.Client(timeout=60)
    url = gw.base_url + "/v1/chat/completions"
    body = dict(BODY)
    tenant = tenant_of(path)
    try:
        if path == "client_cancel":  # (streams: in the test itself)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, headers=gw.headers(tenant), json=body, timeout=0.5)
            return "client timed out after 0.5 s"
        if stream:
            s = open_stream(http, gw.base_url, gw.keys[tenant], body)
            if s.status_code != 200:
                s.read()
                err = assert_error_response(s)
                return f"{s.status_code} {err['code']}"
            events, done = read_stream(s)
            assert not done and events, events
            err = assert_error_object(events[-1])
            return f"200, then error event {err['code']}"
        resp = http.post(url, headers=gw.headers(tenant), json=body)
        err = assert_error_response(resp)
        return f"{resp.status_code} {err['code']}"
    finally:
        http.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
@pytest.mark.parametrize("path", ["upstream_error", "model_forward_failure", "gateway_timeout", "client_cancel",
                                  "rejected_after_admission"])
def test_error_path_releases_lease_and_refunds_unused(gw, workers, path, stream):
    r = redis.Redis.from_url(gw.redis_url)
    tenant = tenant_of(path)
    tpm_key = f"{gw.prefix}:{{{tenant}}}:tpm"
    wait_until(lambda: not gw.gw.live, "previous requests settled")
    for i in range(2):  # the request may go to either worker
        workers.control(i).inject(tenant=tenant, **FAULTS[path])
    before_used = used_tokens(gw, tenant)
    s, us = r.time()
    ts0 = s * 1000 + us / 1000
    r.hset(tpm_key, mapping={"t": repr(SEED), "ts": repr(ts0)})

    if path == "client_cancel" and stream:  # read two chunks, then go away
        http = httpx.Client(timeout=60)
        st = open_stream(http, gw.base_url, gw.keys[tenant], BODY)
        n = 0
        for line in st.iter_lines():
            n += line.startswith("data:")
            if n == 2:
                break
        st.close()
        http.close()
        seen = "read 2 chunks, closed the stream"
    else:
        seen = run_path(gw, path, stream)
    if path == "gateway_timeout":
        assert "timeout" in seen, seen
    if path == "rejected_after_admission":
        assert seen.startswith("400"), seen
    if path in ("upstream_error", "model_forward_failure"):
        assert "service_unavailable" in seen, seen

    wait_until(lambda: not gw.gw.live and not gw.gw.control.live, "settled")
    assert lease_state(r, gw.prefix, tenant) == (set(), set())
    used = used_tokens(gw, tenant) - before_used
    t, ts = (float(x) for x in r.hmget(tpm_key, ["t", "ts"]))
    expected = SEED + (ts - ts0) * RATE - used
    assert t == pytest.approx(expected, abs=1e-3), (t, expected, used)
    assert used < MAX_TOKENS  # so a missing refund could not hide
    wait_until(lambda: all(idle(a) for a in workers.addrs), "workers idle, KV blocks free")
    print(f"\n{path} ({'stream' if stream else 'plain'}): {seen}; used {used:.0f} of "
          f"{MAX_TOKENS}+prompt reserved, refunded the rest")
