"""Streams that wait long in the worker's queue (gateway/keepalive.py).

Once admitted, a stream's response starts within the keep-alive interval, and an SSE comment line
``: keep-alive`` goes out every interval until the first token, so no proxy idle timeout longer than
the interval ever sees an idle connection. The official openai client accepts the comment lines.

The wait is reached by construction: the test worker's engine is held (tests/support), so the
requests stay queued for as long as the test wants, on any machine. "A 90 s wait" is parameterised
by the interval: with the production interval (15 s) a 90 s wait is the headers at 15 s and five
keep-alives after them; here the interval is 0.25 s and the requests are held until at least six
keep-alives came through, which exercises the same code path (one timer per interval, the same
bytes) with a larger count. What a proxy does with it follows: any idle timeout longer than the interval is reset by each comment.
`test_90_s_queue_wait_with_the_production_interval` runs the wait at its real size (the default 15 s
interval, 90 s queued, a client reading with a 60 s idle timeout); it takes about 95 s.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from openai._streaming import SSEDecoder

from tests.support.waits import join_all, wait_for

MODEL = "random-tiny"
INTERVAL_S = 0.25
KEEPALIVES = 6  # more than a 90 s wait at the production interval (15 s) gives: 5 after the headers
TENANTS = [{"id": "low", "weight": 0.05, "limits": {"tpm": 100000}},
           {"id": "ka-deadline", "weight": 1.0, "limits": {"tpm": 100000}}]


def test_openai_sse_decoder_ignores_keepalive_comments():
    """openai-python's own SSE decoder (`openai._streaming.SSEDecoder`, used by every streamed call):
    comment lines and the blank line after them yield no event; the data events around them do."""
    raw = [b": keep-alive\n\n", b": keep-alive\n\n", b'data: {"a": 1}\n\n', b": keep-alive\n\n", b"data: [DONE]\n\n"]
    events = list(SSEDecoder().iter_bytes(iter(raw)))
    assert [e.data for e in events] == ['{"a": 1}', "[DONE]"]


def raw_stream(http: httpx.Client, gw, tenant: str, body: dict, lines: list[str], answer: dict,
               got_headers: threading.Event | None = None) -> None:
    """Stream `body` as `tenant` with plain httpx, appending every line (comments included) to
    `lines`; the status goes to ``answer["raw_status"]``, an exception to ``answer["raw_error"]``."""
    req = http.build_request("POST", gw.base_url + "/v1/chat/completions", json={**body, "stream": True},
                             headers={"authorization": f"Bearer {gw.keys[tenant]}"})
    try:
        resp = http.send(req, stream=True)
        try:
            answer["raw_status"] = resp.status_code
            if got_headers is not None:
                got_headers.set()
            for line in resp.iter_lines():
                lines.append(line)
        finally:
            resp.close()
    except Exception as e:  # noqa: BLE001 - reported by the caller's assertions
        answer["raw_error"] = e


def openai_stream(gw, tenant: str, body: dict, answer: dict) -> None:
    """Stream `body` as `tenant` through the official openai client: the text and the finish reasons go
    to ``answer["text"]`` / ``answer["finish"]``, an exception to ``answer["error"]``."""
    try:
        chunks = list(gw.client(tenant).chat.completions.create(
            stream=True, model=MODEL, messages=body["messages"], max_tokens=body["max_tokens"],
            extra_body={"ignore_eos": True}))
    except Exception as e:  # noqa: BLE001 - reported by the caller's assertions
        answer["error"] = e
        return
    answer["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory(TENANTS, keepalive_interval_s=INTERVAL_S)


def test_queued_stream_gets_headers_keepalives_and_then_its_answer(gw, control):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
            "ignore_eos": True}
    raw_lines: list[str] = []
    got_headers = threading.Event()
    answer: dict[str, object] = {}
    http = httpx.Client(timeout=60)
    raw = threading.Thread(target=raw_stream, args=(http, gw, "low", body, raw_lines, answer, got_headers))
    sdk = threading.Thread(target=openai_stream, args=(gw, "low", body, answer))
    threads = [raw, sdk]

    control.hold()  # the worker schedules nothing: both requests wait in its queue
    try:
        for t in threads:
            t.start()
        wait_for(lambda: (control.tenant_load("low") or {}).get("waiting") == 2, "both requests queued at the worker")
        wait_for(got_headers.is_set, "the raw stream's response headers, while its request is queued")
        assert answer["raw_status"] == 200
        keepalives = lambda: sum(1 for ln in raw_lines if ln == ": keep-alive")  # noqa: E731
        wait_for(lambda: keepalives() >= KEEPALIVES, lambda: f"{KEEPALIVES} keep-alive comments; {keepalives()} so far")
        assert not any(ln.startswith("data:") for ln in raw_lines)  # nothing but keep-alives while queued
    finally:
        control.release()
    join_all(threads, "both streams finished")
    http.close()
    first_data = next(i for i, ln in enumerate(raw_lines) if ln.startswith("data:"))
    assert all(ln in (": keep-alive", "") for ln in raw_lines[:first_data])
    assert raw_lines[-2:] == ["data: [DONE]", ""] or raw_lines[-1] == "data: [DONE]"
    assert "error" not in answer and "raw_error" not in answer, answer
    assert answer["finish"] == ["length"] and answer["text"]
    # both were queued the whole time: admitted only after the release
    events = control.events(tenant="low")
    released = max(e["seq"] for e in control.events() if e["kind"] == "released")
    admits = [e["seq"] for e in events if e["kind"] == "admit"]
    assert len(admits) == 2 and min(admits) > released


def test_deadline_after_the_headers_is_the_streams_last_event(gw, control):
    """A stream that is still queued when its own deadline passes (x-request-timeout): headers and
    keep-alives first, then OpenAI's error as the last ``data:`` event (no [DONE]); the worker aborted
    the queued request (never admitted) and the lease was released."""
    http = httpx.Client(timeout=60)
    control.hold()
    try:
        req = http.build_request("POST", gw.base_url + "/v1/chat/completions",
                                 json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 8, "stream": True},
                                 headers={"authorization": f"Bearer {gw.keys['ka-deadline']}",
                                          "x-request-timeout": "6"})
        resp = http.send(req, stream=True)
        try:
            assert resp.status_code == 200  # (the headers came within one interval, long before the deadline)
            lines = list(resp.iter_lines())
        finally:
            resp.close()
    finally:
        control.release()
        http.close()
    data = [ln for ln in lines if ln.startswith("data:")]
    assert lines[0] == ": keep-alive" and len(data) == 1, lines[:5]
    import json

    err = json.loads(data[0][5:])["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "request_timeout") and "6 s" in err["message"]
    r = control.requests(tenant="ka-deadline")
    (one,) = r.values()
    assert one.admit is None and one.abort_requested is not None and one.reason == "abort"
    wait_for(lambda: gw.leases("ka-deadline") == {}, "the lease released")


PRODUCTION_INTERVAL_S = 15.0  # GatewaySettings.keepalive_interval_s's default
PROXY_IDLE_TIMEOUT_S = 60.0  # a common load balancer idle timeout (AWS ALB, nginx proxy_read_timeout)
QUEUE_WAIT_S = 90.0


def test_90_s_queue_wait_with_the_production_interval(gateway_factory, control):
    """The must-show at its real size: a tiny-weight tenant's stream waits 90 s in the worker's queue
    (engine held: a worker that schedules nothing for 90 s) under the default keep-alive interval.
    The raw client reads with a 60 s idle timeout, as a load balancer would, and sees the headers
    at the grace (one interval) and a keep-alive every interval after; the official openai client,
    streaming the same way meanwhile, gets its whole answer without error.

    By construction: the engine is released only once five keep-alives came (15 s grace + 5 x 15 s =
    90 s on the gateway's own timers) and 90 s passed since the test saw both requests queued, so the
    wait is at least 90 s on any machine."""
    gw = gateway_factory([{"id": "slow-low", "weight": 0.01, "limits": {"tpm": 100000}}])
    assert gw.settings.keepalive_interval_s == PRODUCTION_INTERVAL_S
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8,
            "ignore_eos": True}
    raw_lines: list[str] = []
    answer: dict[str, object] = {}
    # the idle timeout of a proxy: any read that waits longer than this fails the raw stream
    http = httpx.Client(timeout=httpx.Timeout(PROXY_IDLE_TIMEOUT_S, connect=10))

    control.hold()
    threads = [threading.Thread(target=raw_stream, args=(http, gw, "slow-low", body, raw_lines, answer)),
               threading.Thread(target=openai_stream, args=(gw, "slow-low", body, answer))]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: (control.tenant_load("slow-low") or {}).get("waiting") == 2,
                 "both requests queued at the worker")
        queued_at = time.monotonic()
        keepalives = lambda: sum(1 for ln in raw_lines if ln == ": keep-alive")  # noqa: E731
        wait_for(lambda: keepalives() >= 5 or "raw_error" in answer,
                 lambda: f"five keep-alives (90 s at the 15 s interval); {keepalives()} so far",
                 timeout_s=QUEUE_WAIT_S * 4)
        assert "raw_error" not in answer, answer  # the 60 s idle timeout never fired
        assert not any(ln.startswith("data:") for ln in raw_lines)
        # and at least 90 s on the test's own clock since it saw both queued (the remainder, if any)
        time.sleep(max(0.0, QUEUE_WAIT_S - (time.monotonic() - queued_at)))
        waited_s = time.monotonic() - queued_at
        print(f"queued {waited_s:.1f} s, {keepalives()} keep-alives")  # (for the report; the bound is by construction)
    finally:
        control.release()
    join_all(threads, "both streams finished", timeout_s=120)
    http.close()
    assert answer.get("raw_status") == 200 and "raw_error" not in answer, answer
    assert raw_lines[-1] == "data: [DONE]" or raw_lines[-2:] == ["data: [DONE]", ""]
    assert "error" not in answer, answer
    assert answer["finish"] == ["length"]
    events = control.events(tenant="slow-low")
    released = max(e["seq"] for e in control.events() if e["kind"] == "released")
    assert [e["seq"] > released for e in events if e["kind"] == "admit"] == [True, True]
