"""Soak: 200 short requests from two tenants (8 at a time) with random client disconnects, client
timeouts, gateway timeouts, upstream errors, refusals after admission, invalid requests, and a real
worker fault: one of the two workers is killed (SIGKILL) a third of the way through and started
again later (it rejoins when it is ready).

Every answer is a success or an OpenAI-shaped error (never a 500, never a traceback); a stream ends
with ``[DONE]``, an OpenAI error event, or the client's own hang-up. At the end nothing is left:
zero leases in Redis, no lease held or owed by the gateway, and every KV block free on both workers.

The upstream errors and refusals are the test workers' faults (tests/support/worker_control.py),
for requests whose prompt carries a marker; the restarted worker has them from its start. For the
kill, the "long" responses sent from a third of the way on stop after two messages (`stall_after`)
until the kill, so one is certainly in progress on the victim when it dies, on any machine; the
survivor's are then let go.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from tests.reliability.conftest import (MODEL, InProcessGateway, assert_error_object, idle,
                                        lease_state, sse_events, wait_until)

N = 200
LONG_TOKENS = 40
CONCURRENCY = 8
KINDS = [("plain", 26), ("stream", 20), ("long", 10), ("disconnect", 10), ("client_timeout", 10),
         ("gateway_timeout", 3), ("upstream_error", 8), ("reject", 5), ("invalid", 5), ("n2", 4)]
MARK_ERROR, MARK_REJECT, MARK_LONG = "[inject:error-after-2]", "[inject:reject]", "[inject:long]"
FAULTS = [dict(kind="error_after", after=2, prompt_contains=MARK_ERROR),
          dict(kind="reject", prompt_contains=MARK_REJECT)]
TENANTS = [
    {"id": "soak-a", "tier": "interactive", "limits": {"tpm": 10**6, "max_inflight_tokens": 6000}},
    {"id": "soak-b", "tier": "batch", "limits": {"tpm": 10**6, "max_concurrent_requests": 3}},
]


def one(gw: InProcessGateway, i: int, kind: str, tenant: str, rng: random.Random) -> dict:
    url = gw.base_url + "/v1/chat/completions"
    mark = {"upstream_error": MARK_ERROR, "reject": MARK_REJECT, "long": MARK_LONG}.get(kind, "")
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"soak request {i} {mark}"}],
            "max_tokens": rng.randint(1, 8)}
    stream = kind in ("stream", "long", "disconnect") or (kind in ("gateway_timeout", "upstream_error", "reject")
                                                 and rng.random() < 0.5)
    timeout = 60.0
    if kind in ("disconnect", "client_timeout", "gateway_timeout"):
        body.update(max_tokens=300 if kind != "gateway_timeout" else 1500, ignore_eos=True)
    if kind == "client_timeout":
        timeout = rng.uniform(0.2, 0.8)
    if kind == "long":  # a response that takes a few seconds: the worker kill lands in one of these
        body.update(max_tokens=LONG_TOKENS, ignore_eos=True)
    if kind == "upstream_error":
        body["max_tokens"] = 8
        body["ignore_eos"] = True
    if kind == "invalid":
        body["max_tokens"] = rng.choice([-1, 0, "8", 10**12])
    if kind == "n2":
        body["n"] = 2
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    rec = {"i": i, "kind": kind, "tenant": tenant, "stream": stream}
    try:
        with httpx.Client(timeout=timeout) as http:
            if stream:
                with http.stream("POST", url, json=body, headers=gw.headers(tenant)) as r:
                    rec["status"] = r.status_code
                    if r.status_code != 200:
                        r.read()
                        rec["error"] = assert_error_object(r.json())
                    elif kind == "disconnect":
                        n = 0
                        for line in r.iter_lines():
                            n += line.startswith("data:")
                            if n >= rng.randint(1, 3):
                                break
                        rec["outcome"] = "client hung up"
                    else:
                        events, done = sse_events(r.iter_lines())
                        errs = [e for e in events if "error" in e]
                        if errs:
                            assert len(errs) == 1 and "error" in events[-1] and not done, events[-3:]
                            rec["error"] = assert_error_object(events[-1])
                            rec["outcome"] = "error event"
                        else:
                            assert done and events[-1]["choices"] == [] and events[-1]["usage"], events[-2:]
                            rec["outcome"] = "done"
            else:
                r = http.post(url, json=body, headers=gw.headers(tenant))
                rec["status"] = r.status_code
                if r.status_code != 200:
                    rec["error"] = assert_error_object(r.json())
                else:
                    assert r.json()["usage"]["completion_tokens"] >= 1
    except httpx.TimeoutException:
        rec["outcome"] = "client timeout"
    return rec


def streaming_from(gw: InProcessGateway, workers) -> str | None:
    """The worker a "long" response is stalled on mid-stream, if any: the worker holds it after two
    messages (`stall_after`), so it is still in progress when the worker dies, however many tokens
    the worker put in each message and however fast the machine is."""
    stalled = {e["request_id"] for i in range(len(workers.addrs)) for e in workers.control(i).events()
               if e["kind"] == "stalled"}
    for s in list(gw.gw.live):
        gen = s.jobs[0].gen
        if (s.first_token_at is not None and not s.client_gone and s.jobs[0].max_tokens == LONG_TOKENS
                and gen is not None and gen.request_id in stalled and s.jobs[0].completion_tokens < LONG_TOKENS):
            return gen.worker.addr
    return None


def test_soak_200_requests_with_faults_leaves_nothing_behind(workers, redis_url, tmp_path):
    gw = InProcessGateway(tmp_path / "gw", TENANTS, workers.addrs, redis_url, request_timeout_s=6.0,
                          health_interval_s=0.3).wait_ready()
    r = redis.Redis.from_url(redis_url)
    rng = random.Random(20261130)
    plan = [(i, rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0], rng.choice(["soak-a", "soak-b"]))
            for i in range(N)]
    done_count = [0]
    lock = threading.Lock()
    killed_at = restarted_at = None

    def task(i, kind, tenant):
        rec = one(gw, i, kind, tenant, random.Random(i))
        with lock:
            done_count[0] += 1
        return rec

    workers.inject_rules = list(FAULTS)  # for the restarted worker too
    for i in range(2):
        for rule in FAULTS:
            workers.control(i).inject(**rule)
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            futures = [pool.submit(task, *p) for p in plan]
            wait_until(lambda: done_count[0] >= N // 3, "a third done")
            for i in range(2):  # from now on "long" responses stop after two messages, until the kill
                workers.control(i).inject("stall_after", after=2, prompt_contains=MARK_LONG)
            victim = []
            wait_until(lambda: victim.append(streaming_from(gw, workers)) or victim[-1],
                       "a long response stalled mid-stream at a worker")
            k = workers.addrs.index(victim[-1])
            workers.kill(k)  # a real worker fault in the middle of the soak, with a response streaming from it
            killed_at = done_count[0]
            workers.control(1 - k).release_stalled()  # the survivor's long responses go on
            wait_until(lambda: done_count[0] >= N // 2, "half done")
            workers.start_async(k)  # it comes back while the soak goes on
            restarted_at = done_count[0]
            records = [f.result(timeout=300) for f in futures]
        elapsed = time.monotonic() - t0

        outcomes = Counter((x["kind"], x.get("status"), x.get("outcome"), (x.get("error") or {}).get("code"))
                           for x in records)
        print(f"\nsoak: {N} requests in {elapsed:.1f} s; worker {k} killed after {killed_at}, restarted after "
              f"{restarted_at}")
        for k, v in sorted(outcomes.items(), key=str):
            print("  ", k, v)
        assert len(records) == N
        for x in records:
            assert x.get("status") != 500, x
            if x["kind"] == "invalid":
                assert x["status"] == 400, x
            if x["kind"] == "reject":
                assert x["status"] in (400, 429), x  # refused by the worker after admission (or rate limited)
            if x["kind"] in ("plain", "stream", "long", "n2") and x.get("status") not in (200, 429):
                assert x["status"] == 503 or x.get("outcome") == "error event", x  # its worker was killed
        assert sum(x.get("status") == 200 for x in records) > N // 3
        hit = [x for x in records if "(UNAVAILABLE)" in (x.get("error") or {}).get("message", "")
               or "(UNKNOWN)" in (x.get("error") or {}).get("message", "")]
        print(f"   requests running on the killed worker that got an OpenAI error: {len(hit)}")
        assert hit, "the kill interrupted responses in progress"

        # nothing left behind: no lease (in Redis or the gateway), every KV block free
        wait_until(lambda: not gw.gw.live and not gw.gw.control.live, "every request settled")
        assert gw.gw.control.owed == {} and gw.gw.control.local.held() == []
        for t in TENANTS:
            assert lease_state(r, gw.prefix, t["id"]) == (set(), set()), t["id"]
        workers.ensure_alive()
        wait_until(lambda: all(idle(a) for a in workers.addrs), "every KV block free on both workers")
    finally:
        gw.stop()
