"""Gateway faults, with `fairshare gateway` as a real subprocess.

kill -9 with requests in flight: nothing settles them, so their leases stay in Redis until the lease
TTL (2 s here) passes; within it the tenant's whole in-flight budget is available again (a restarted
gateway admits a request that needs all of it), and the worker has aborted the orphaned generations
(their gRPC streams died with the process) and freed their KV blocks.

SIGTERM: the gateway stops accepting connections, answers 503 to requests still arriving, lets open
streams finish for its drain timeout (3 s here), ends the ones still open with an OpenAI error event,
releases their leases and exits.

States by construction (test workers, tests/support): for the kill, both streams are run to their
first token and the worker's engine is held, so they are mid-generation when the gateway dies and
the worker must abort them without another iteration; the expiry is read from the leases' stored
expiry times (Redis time), not timed. For SIGTERM the long stream's worker stops relaying after its
first message (`stall_after`), so it is still open at the drain deadline on any machine.
"""

from __future__ import annotations

import threading
import time

import httpx
import redis

from tests.reliability.conftest import (HELLO, MODEL, GatewayProcess, assert_error_object, idle, lease_state,
                                        live_leases, open_stream, read_stream, tenant_load, wait_until)
from tests.support.waits import join_all

BUDGET = 1200  # the tenant's in-flight tokens
STALL = "[inject:stall]"  # prompt marker of the stream the worker stops relaying


def test_gateway_kill9_leases_expire_within_ttl(workers, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    tenants = [{"id": "gk", "limits": {"max_inflight_tokens": BUDGET, "tpm": 10**6}}]
    prefix = "fs-rel-gk"
    args = ("--lease-ttl-s", "2", "--log-level", "warning")
    env = {"FAIRSHARE_KEY_PREFIX": prefix}
    g1 = GatewayProcess(tmp_path, tenants, [workers.addrs[0]], redis_url, *args, env=env).wait_ready()
    control = workers.control(0)
    http = httpx.Client(timeout=60)
    g2 = None
    try:
        p = g1.client("gk").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1).usage.prompt_tokens
        half = {"model": MODEL, "messages": HELLO, "max_tokens": BUDGET // 2 - p, "ignore_eos": True}
        control.hold()
        streams: list[httpx.Response] = []
        openers = [threading.Thread(target=lambda: streams.append(open_stream(http, g1.base_url, g1.keys["gk"], half)))
                   for _ in range(2)]
        for t in openers:
            t.start()
        control.run_until_tokens("gk", requests=2, tokens=1)  # both mid-generation, the engine held
        join_all(openers, "both streams opened")
        assert [s.status_code for s in streams] == [200, 200]
        full = open_stream(http, g1.base_url, g1.keys["gk"], {**half, "max_tokens": BUDGET - p})
        full.read()
        assert full.status_code == 429  # the budget is all in flight
        assert len(live_leases(r, prefix, "gk")) == 2
        assert tenant_load(workers.addrs[0], "gk").running == 2

        t_kill = time.monotonic()
        g1.kill()
        redis_s, redis_us = r.time()
        killed_at_ms = redis_s * 1000 + redis_us / 1000
        for s in streams:
            s.close()
        expiries = dict(r.zrange(f"{prefix}:{{gk}}:leases", 0, -1, withscores=True))
        assert len(expiries) == 2 and len(live_leases(r, prefix, "gk")) == 2  # nobody settled them
        # ...and nobody renews them: each expires at most one TTL (2 s) after the kill, by its stored expiry
        assert all(e <= killed_at_ms + 2000 for e in expiries.values()), (expiries, killed_at_ms)
        # the worker aborts the orphaned generations (their streams died with the gateway), with its
        # engine still held: the abort needs no further iteration
        t_abort = wait_until(lambda: tenant_load(workers.addrs[0], "gk").running == 0, "worker aborted them")
        wait_until(lambda: idle(workers.addrs[0]), "every KV block free")
        assert control.state()["held"]
        control.release()
        wait_until(lambda: not live_leases(r, prefix, "gk"), "leases expired")
        since_kill = time.monotonic() - t_kill

        # a new gateway (same port) admits a request needing the tenant's whole in-flight budget
        g2 = GatewayProcess(tmp_path, None, [workers.addrs[0]], redis_url, *args, port=g1.port, env=env,
                            tenants_file=g1.tenants_file, keys=g1.keys).wait_ready()
        s = open_stream(http, g2.base_url, g2.keys["gk"], {**half, "max_tokens": BUDGET - p})
        assert s.status_code == 200, s.read()
        s.close()
        wait_until(lambda: lease_state(r, prefix, "gk")[1] == set(), "released")
        print(f"\ngateway kill -9: worker aborted after {t_abort:.2f} s, leases expired {since_kill:.2f} s "
              f"after the kill (TTL 2 s)")
    finally:
        http.close()
        g1.stop()
        if g2 is not None:
            g2.stop()


def test_gateway_sigterm_finishes_open_streams_then_stops_the_rest(workers, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    prefix = "fs-rel-gt"
    g = GatewayProcess(tmp_path, [{"id": "gt", "limits": {"tpm": 10**6}}], [workers.addrs[1]], redis_url,
                       "--drain-timeout-s", "3", "--log-level", "info",
                       env={"FAIRSHARE_KEY_PREFIX": prefix}).wait_ready()
    http = httpx.Client(timeout=60)
    try:
        workers.control(1).inject("stall_after", after=1, prompt_contains=STALL)
        short = open_stream(http, g.base_url, g.keys["gt"], {"model": MODEL, "messages": HELLO, "max_tokens": 20,
                                                             "ignore_eos": True})
        long = open_stream(http, g.base_url, g.keys["gt"], {"model": MODEL, "max_tokens": 1500, "ignore_eos": True,
                                                            "messages": [{"role": "user", "content": f"Hi {STALL}"}]})
        assert short.status_code == long.status_code == 200
        t_term = time.monotonic()
        g.term()
        wait_until(lambda: "draining:" in g.log(), "the gateway logged the start of its drain")
        # the short stream finishes normally
        events, done = read_stream(short)
        assert done and events[-1]["choices"][0]["finish_reason"] == "length"
        # nothing new is accepted: the listener is closed (or, in the instant before it closes, 503)
        try:
            resp = httpx.post(g.base_url + "/v1/chat/completions", headers=g.headers("gt"), timeout=5,
                              json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
            assert resp.status_code == 503 and assert_error_object(resp.json())
        except httpx.ConnectError:
            pass
        # the long one is stopped at the drain deadline with an OpenAI error event
        events, done = read_stream(long)
        t_stop = time.monotonic() - t_term
        assert not done and events and "error" in events[-1], events[-2:]
        err = assert_error_object(events[-1])
        assert "shutting down" in err["message"] and err["code"] == "service_unavailable"
        assert t_stop >= 2.5, t_stop  # not before the drain deadline (a lower bound: a slow machine only adds)
        wait_until(lambda: g.proc.poll() is not None,
                   lambda: f"the gateway exited after its drain; its log ends:\n{g.log_tail()}")
        t_exit = time.monotonic() - t_term
        assert lease_state(r, prefix, "gt") == (set(), set())  # settled before exiting, not left to expire
        wait_until(lambda: idle(workers.addrs[1]), "the worker aborted the stopped stream")
        assert "drain deadline reached: stopping 1 open request(s)" in g.log()
        print(f"\ngateway SIGTERM: long stream stopped at {t_stop:.1f} s, exit at {t_exit:.1f} s (drain 3 s)")
    finally:
        http.close()
        g.stop()
