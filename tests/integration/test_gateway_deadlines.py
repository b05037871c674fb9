"""Request deadlines (gateway/deadlines.py): the server's per tier / per tenant, the client's own.

A request still queued at the worker when its deadline passes is aborted there (the gRPC deadline
travels with the call; it is never admitted, its KV blocks are freed) and settled at the gateway
(lease released, the whole reservation refunded: nothing was computed). The answer: 504 ``timeout``
for the server's deadline, 408 ``request_timeout`` for the client's. The queue wait is by
construction (the test worker's engine is held), so the deadline passes while the request is queued
on any machine.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.support.waits import join_all, wait_for

MODEL = "random-tiny"
TPM = 6000
SEED = 4000.0
TENANTS = [{"id": "dl-tenant", "request_timeout_s": 1.5, "limits": {"tpm": TPM}},
           {"id": "dl-client", "limits": {"tpm": TPM}}, {"id": "dl-bad", "limits": {"tpm": TPM}}]
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory(TENANTS, keepalive_interval_s=0.25)


def post(gw, tenant: str, headers: dict | None = None, **extra) -> httpx.Response:
    return httpx.post(gw.base_url + "/v1/chat/completions", json={**BODY, **extra}, timeout=60,
                      headers={"authorization": f"Bearer {gw.keys[tenant]}", **(headers or {})})


def assert_queued_then_aborted(control, tenant: str) -> None:
    (r,) = control.requests(tenant=tenant).values()
    assert r.arrival is not None and r.admit is None, r                   # queued, never scheduled
    assert r.abort_requested is not None and r.reason == "abort", r        # aborted at the worker


def assert_settled_untouched(gw, tenant: str, ts0_ms: float) -> None:
    wait_for(lambda: gw.leases(tenant) == {}, f"{tenant}'s lease released")
    t, ts = gw.bucket(tenant)
    assert t == pytest.approx(SEED + (ts - ts0_ms) * TPM / 60000.0, abs=1e-3)  # the reservation came back


def test_server_deadline_of_a_queued_request_is_504_aborted_at_the_worker_and_settled(gw, control):
    ts0 = gw.seed_bucket("dl-tenant", "tpm", SEED)
    with control.held():
        r = post(gw, "dl-tenant")
        wait_for(lambda: (control.tenant_load("dl-tenant") or {}).get("waiting") == 0,
                 "the aborted request gone from the worker's queue (while the engine is still held)")
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("server_error", "timeout", None)
    assert "1.5 s" in err["message"] and "tenant dl-tenant" in err["message"]
    assert_queued_then_aborted(control, "dl-tenant")
    assert_settled_untouched(gw, "dl-tenant", ts0)


@pytest.mark.parametrize("header", ["x-request-timeout", "x-stainless-read-timeout"])
def test_client_deadline_of_a_queued_request_is_408(gw, control, header):
    """The client's own budget: x-request-timeout, or for a non-streamed request the timeout the
    official SDKs send (x-stainless-read-timeout)."""
    ts0 = gw.seed_bucket("dl-client", "tpm", SEED)
    with control.held():
        r = post(gw, "dl-client", {header: "1.5"})
    assert r.status_code == 408, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "request_timeout") and "1.5 s" in err["message"]
    assert_queued_then_aborted(control, "dl-client")
    assert_settled_untouched(gw, "dl-client", ts0)


def test_sdk_read_timeout_does_not_cut_a_stream_kept_alive(gw, control):
    """For a stream, x-stainless-read-timeout bounds the gap between chunks, which keep-alives fill:
    held past it (six keep-alives at 0.25 s: 1.5 s > 1 s), the stream still gets its answer."""
    lines: list[str] = []
    http = httpx.Client(timeout=60)

    def read() -> None:
        req = http.build_request("POST", gw.base_url + "/v1/chat/completions", json={**BODY, "stream": True,
                                 "max_tokens": 4}, headers={"authorization": f"Bearer {gw.keys['dl-client']}",
                                                            "x-stainless-read-timeout": "1"})
        resp = http.send(req, stream=True)
        try:
            lines.extend(resp.iter_lines())
        finally:
            resp.close()

    t = threading.Thread(target=read)
    with control.held():
        t.start()
        wait_for(lambda: lines.count(": keep-alive") >= 6, "six keep-alives while held")
    join_all([t], "the stream finished")
    http.close()
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""], lines[-3:]
    assert not any('"error"' in ln for ln in lines)


def test_malformed_client_timeout_is_400_and_not_admitted(gw):
    for bad in ("soon", "-1", "0", "inf", "nan"):
        r = post(gw, "dl-bad", {"x-request-timeout": bad})
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "x-request-timeout" in err["message"]
    assert gw.bucket("dl-bad") is None  # refused before admission: never charged
