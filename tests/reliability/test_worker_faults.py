"""Worker faults with two real workers: one killed (SIGKILL) in the middle of streamed and non-streamed
requests, one drained (SIGTERM) with work in flight, one stopped (SIGSTOP: a node cut off, its
connections open and silent) mid-stream.

Killed: the clients on that worker get an OpenAI-shaped error (an SSE ``data:`` error event for a
stream, a 5xx JSON body otherwise), the requests on the other worker finish normally, the tenant's
leases are released and its unused TPM reservations refunded, the dead worker is marked unhealthy
at once (the gateway polls health only every 30 s here) and new requests go to the survivor.

Drained: the worker stops taking new requests (they go to the other worker), finishes what it runs
until its drain deadline, aborts the rest (an OpenAI error event for that stream), then exits 0.

The states are reached by construction with the test workers' engine hold (tests/support): the
requests are held at the workers until they are all there, then run together to their first token
and held again, so at the kill every one of them is mid-generation on any machine; in the drain, the
worker is held as soon as its short request has finished, so the long one is still running at the
deadline however fast the machine.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import httpx

from tests.reliability.conftest import (HELLO, MODEL, InProcessGateway, assert_error_object, assert_error_response,
                                        get_load, idle, live_leases, open_stream, read_stream, tenant_load, tpm_bucket,
                                        wait_until)
from tests.support.waits import join_all

TPM = 20000
LONG = {"model": MODEL, "messages": HELLO, "max_tokens": 1500, "ignore_eos": True}


def finished(addr: str, tenant: str) -> int:
    t = tenant_load(addr, tenant)
    return 0 if t is None else t.finished


def session_ids(gw: InProcessGateway) -> dict[str, str]:
    """rid -> worker address of every running request."""
    return {s.rid: s.jobs[0].gen.worker.addr for s in list(gw.gw.live) if s.jobs[0].gen is not None
            and not s.finished}


def arrived(workers, tenant: str) -> dict[str, str]:
    """rid -> address of every request of `tenant` live at a worker (from the workers' event logs)."""
    out = {}
    for i, addr in enumerate(workers.addrs):
        if workers.alive(i):
            for rid, r in workers.control(i).requests(tenant=tenant).items():
                if r.finish is None:
                    out[rid] = addr
    return out


def open_in_thread(http: httpx.Client, gw: InProcessGateway, tenant: str, body: dict, out: list) -> threading.Thread:
    """`open_stream` in a thread (its headers come with the first token, which a held worker withholds)."""
    t = threading.Thread(target=lambda: out.append(open_stream(http, gw.base_url, gw.keys[tenant], body)))
    t.start()
    return t


def test_worker_killed_mid_stream(workers, redis_url, tmp_path):
    gw = InProcessGateway(tmp_path / "gw", [{"id": "wk", "limits": {"tpm": TPM, "max_inflight_tokens": 20000}}],
                          workers.addrs, redis_url, health_interval_s=30.0, routing="least-loaded").wait_ready()
    controls = [workers.control(i) for i in range(2)]
    http = httpx.Client(timeout=60)
    try:
        # two streams and two plain requests, spread over both workers by least-loaded routing, sent one
        # after the other to held workers; then each worker runs its two to their first token and holds
        for c in controls:
            c.hold()
        opened: list[httpx.Response] = []
        plain: dict[int, httpx.Response] = {}

        def post(i: int) -> None:
            plain[i] = http.post(gw.base_url + "/v1/chat/completions", headers=gw.headers("wk"),
                                 json={**LONG, "max_tokens": 300}, timeout=180)

        threads = []
        for n in range(4):
            if n < 2:
                threads.append(open_in_thread(http, gw, "wk", LONG, opened))
            else:
                threads.append(threading.Thread(target=post, args=(n - 2,)))
                threads[-1].start()
            wait_until(lambda n=n: len(arrived(workers, "wk")) == n + 1, f"{n + 1} requests at the workers")
        where = arrived(workers, "wk")
        assert sorted(where.values()) == sorted(workers.addrs * 2), where  # two on each worker
        for c in controls:
            c.run_until_tokens("wk", requests=2, tokens=1)
        join_all(threads[:2], "both streams opened")
        streams = sorted(opened, key=lambda r: r.headers["x-request-id"])
        assert [s.status_code for s in streams] == [200, 200]
        stream_rids = [s.headers["x-request-id"] for s in streams]
        # the workers hold all four after their first token; the gateway learns of each first token
        # (its session's generation starts then) a moment later: wait for that state, not a race with it
        wait_until(lambda: session_ids(gw) == where,
                   lambda: f"the gateway holding all four at their first token: {session_ids(gw)} vs {where}")
        assert where == arrived(workers, "wk")  # all four mid-generation, held

        def score(addr: str) -> tuple[int, int]:  # (hosts a stream, hosts a plain request)
            return (any(where[r] == addr for r in stream_rids),
                    any(a == addr and r not in stream_rids for r, a in where.items()))

        victim = max(range(2), key=lambda i: score(workers.addrs[i]))
        victim_addr, survivor_addr = workers.addrs[victim], workers.addrs[1 - victim]
        assert score(victim_addr)[0], where
        on_victim = {rid for rid, a in where.items() if a == victim_addr}
        survivor_before = finished(survivor_addr, "wk")

        t_kill = time.monotonic()
        workers.kill(victim)
        controls[1 - victim].release()  # the survivor's requests go on

        # streams: the one on the dead worker ends with an OpenAI error event (and no [DONE])
        t_error = None
        for s, rid in zip(streams, stream_rids):
            if rid in on_victim:
                events, done = read_stream(s)
                assert not done and events, events
                err = assert_error_object(events[-1])
                assert err["type"] == "server_error" and err["code"] == "service_unavailable"
                assert "127.0.0.1" not in err["message"]  # no internal address leaks to the client
                t_error = time.monotonic() - t_kill
        # plain requests: the one on the dead worker gets a 5xx OpenAI body, the other one finishes
        join_all(threads[2:], "both plain requests answered")
        assert len(plain) == 2, plain
        cut = on_victim - set(stream_rids)
        assert sum(r.status_code == 503 for r in plain.values()) == len(cut) == 1, plain
        for r in plain.values():
            if r.status_code != 200:
                assert_error_response(r, 503)
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"

        # the dead worker is marked unhealthy at once, without waiting for the 30 s health poll
        ready = gw.readyz()
        state = {w["addr"]: w["healthy"] for w in ready["workers"]}
        assert state == {victim_addr: False, survivor_addr: True}, ready
        # new requests go to the survivor
        for _ in range(3):
            r = gw.client("wk").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
            assert r.choices[0].finish_reason in ("length", "stop")
        assert finished(survivor_addr, "wk") >= survivor_before + 4  # its plain request and these three

        # close the survivor's stream: every lease is released, every unused reservation refunded
        for s in streams:
            s.close()
        wait_until(lambda: not gw.gw.live, "every request settled")
        assert live_leases(_sync(redis_url), gw.prefix, "wk") == set()
        used = sum(v for (name, labels), v in _tokens(gw, "wk").items())
        stored, _ = tpm_bucket(_sync(redis_url), gw.prefix, "wk")
        # 4 requests reserved ~5800 tokens; without refunds the bucket would sit that low (plus refill)
        assert TPM - used - 1 <= stored <= TPM, (stored, used)
        wait_until(lambda: idle(survivor_addr), "survivor idle, every KV block free")
        print(f"\nworker kill: client error event {t_error:.2f} s after the kill")
    finally:
        http.close()
        gw.stop()


def test_worker_sigterm_drains(workers, redis_url, tmp_path):
    gw = InProcessGateway(tmp_path / "gw", [{"id": "wd", "limits": {"tpm": 10**6}}], workers.addrs, redis_url,
                          health_interval_s=0.3, routing="least-loaded").wait_ready()
    controls = [workers.control(i) for i in range(2)]
    http = httpx.Client(timeout=60)
    try:
        # a long stream lands on one worker; a short one and another long one on the other (least loaded
        # by in-flight tokens), all sent one after the other to held workers
        for c in controls:
            c.hold()
        short_body = {"model": MODEL, "messages": HELLO, "max_tokens": 25, "ignore_eos": True}
        opened: dict[str, list] = {"long_a": [], "short": [], "long_b": []}
        threads = []
        for n, (name, body) in enumerate([("long_a", LONG), ("short", short_body), ("long_b", LONG)]):
            threads.append(open_in_thread(http, gw, "wd", body, opened[name]))
            wait_until(lambda n=n: len(arrived(workers, "wd")) == n + 1, f"{n + 1} requests at the workers")
        where = arrived(workers, "wd")
        by_tokens = sorted((s for s in list(gw.gw.live) if not s.finished), key=lambda s: s.jobs[0].max_tokens)  # short first
        short_addr = where[by_tokens[0].rid]
        b = workers.addrs.index(short_addr)
        a_addr, b_addr = workers.addrs[1 - b], short_addr
        assert sorted(where.values()) == sorted([a_addr, b_addr, b_addr]), where

        watch = HealthWatch(b_addr)  # a health watch of our own on the worker that will drain
        t_term = time.monotonic()
        workers.term(b)
        wait_until(lambda: get_load(b_addr).draining, "worker draining")
        # in-flight work that fits in the drain deadline finishes normally; once the short one has
        # finished, worker b is held, so the long one is still running at the deadline
        controls[b].hold_when("finish", tenant="wd", count=1)
        controls[b].release()
        controls[1 - b].release()
        join_all(threads, "the three streams opened")
        long_a, short, long_b = (opened[k][0] for k in ("long_a", "short", "long_b"))
        assert where[long_a.headers["x-request-id"]] == a_addr and where[long_b.headers["x-request-id"]] == b_addr
        events, done = read_stream(short)
        assert done and events[-1]["choices"][0]["finish_reason"] == "length", events[-3:]
        # new requests while it drains: served by the other worker
        for _ in range(2):
            r = gw.client("wd").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
            assert r.choices[0].finish_reason in ("length", "stop")
        # the rest is aborted at the deadline (4 s): an OpenAI error event, no [DONE]
        events, done = read_stream(long_b)
        t_abort = time.monotonic() - t_term
        assert not done and "error" in events[-1], events[-2:]
        assert_error_object(events[-1])
        assert t_abort >= 3.0, t_abort  # not before the deadline (a lower bound: a slow machine only adds)
        # then the worker exits, cleanly
        rc = workers.procs[b].wait(120)
        t_exit = time.monotonic() - t_term
        assert rc == 0
        # the health watch was ended by the worker (OK) after NOT_SERVING, not cut at the server's grace
        statuses, code = watch.result()
        assert statuses[-1] == "NOT_SERVING" and code == grpc.StatusCode.OK, (statuses, code)
        long_a.close()
        wait_until(lambda: not gw.gw.live, "every request settled")
        assert live_leases(_sync(redis_url), gw.prefix, "wd") == set()
        wait_until(lambda: idle(a_addr), "the other worker idle")
        print(f"\nworker drain: aborted at {t_abort:.1f} s, exited at {t_exit:.1f} s (deadline 4 s)")
    finally:
        http.close()
        gw.stop()


class HealthWatch:
    """A ``grpc.health.v1`` Watch of the Worker service on `addr`, read by a thread: the statuses it
    got, and the code it ended with (`result`)."""

    def __init__(self, addr: str) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._channel = grpc.insecure_channel(addr)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service="fairshare.v1.Worker"))
        self._name = health_pb2.HealthCheckResponse.ServingStatus.Name
        self.statuses: list[str] = []
        self.code = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        wait_until(lambda: self.statuses, f"the first health status from {addr}")

    def _read(self) -> None:
        try:
            for resp in self._call:
                self.statuses.append(self._name(resp.status))
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code = e.code()

    def result(self, timeout_s: float = 60.0) -> tuple[list[str], object]:
        join_all([self._thread], "the health watch ended", timeout_s)
        self._channel.close()
        return self.statuses, self.code


_SYNC = {}


def _sync(url):
    import redis

    if url not in _SYNC:
        _SYNC[url] = redis.Redis.from_url(url)
    return _SYNC[url]


def _tokens(gw: InProcessGateway, tenant: str) -> dict:
    """prompt + completion tokens the gateway settled for `tenant` ({(kind, labels): value})."""
    out = {}
    for fam in gw.gw.metrics.registry.collect():
        if fam.name != "fairshare_gateway_tokens":
            continue
        for smp in fam.samples:
            if smp.name.endswith("_total") and smp.labels.get("tenant") == tenant and \
                    smp.labels.get("kind") in ("prompt", "completion"):
                out[(smp.labels["kind"], tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_a_silent_worker_is_cut_off_by_the_keepalive_and_its_stream_fails_over(workers, redis_url, tmp_path):
    """A worker stopped mid-stream (SIGSTOP: its TCP connections stay open, nothing answers on them,
    as with a node cut off) is found out by the gateway's HTTP/2 pings (``worker_keepalive_s``, 1 s
    here): the stream on it ends with an OpenAI error event, its lease is released, the worker is out
    of routing at once and the next requests go to the other worker. Without the pings nothing would
    end the stream before its deadline (the health poll, every 30 s here, only stops new routing)."""
    gw = InProcessGateway(tmp_path / "gw", [{"id": "ws", "limits": {"tpm": 10**6}}], workers.addrs, redis_url,
                          health_interval_s=30.0, routing="least-loaded", worker_keepalive_s=1.0).wait_ready()
    controls = [workers.control(i) for i in range(2)]
    http = httpx.Client(timeout=60)  # a read that waits 60 s for the error event fails the test
    stopped = None
    try:
        for c in controls:
            c.hold()
        opened: list[httpx.Response] = []
        t = open_in_thread(http, gw, "ws", LONG, opened)
        wait_until(lambda: len(arrived(workers, "ws")) == 1, "the stream's request at a worker")
        (rid, addr), = arrived(workers, "ws").items()
        victim = workers.addrs.index(addr)
        controls[victim].run_until_tokens("ws", requests=1, tokens=1)
        join_all([t], "the stream opened")
        stream = opened[0]
        assert stream.status_code == 200 and stream.headers["x-request-id"] == rid
        controls[1 - victim].release()

        stopped = workers.procs[victim].pid
        os.kill(stopped, signal.SIGSTOP)
        events, done = read_stream(stream)  # the first token, then (the worker silent) the error
        assert not done and events, events
        err = assert_error_object(events[-1])
        assert err["type"] == "server_error" and err["code"] == "service_unavailable", err
        wait_until(lambda: not gw.gw.live, "the stream settled")
        assert live_leases(_sync(redis_url), gw.prefix, "ws") == set()
        state = {w["addr"]: w["healthy"] for w in gw.readyz()["workers"]}
        assert state == {addr: False, workers.addrs[1 - victim]: True}, state
        for _ in range(2):
            r = gw.client("ws").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
            assert r.choices[0].finish_reason in ("length", "stop")
        assert finished(workers.addrs[1 - victim], "ws") >= 2
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        http.close()
        gw.stop()
