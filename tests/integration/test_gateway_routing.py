"""Routing: what the gateway sends to workers, retries before the first token, health and tokenizer
agreement. Fault injection uses small gRPC proxies in front of the real worker (they forward to it or
fail on purpose); generation itself always comes from the real worker."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from concurrent import futures

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fairshare.ports import free_port
from fairshare.worker_auth import METADATA_KEY
from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from tests.conftest import GATEWAY_TEST_SECRET
from tests.support.waits import wait_for

MODEL = "random-tiny"
HELLO = [{"role": "user", "content": "Hello"}]


class ProxyWorker(pb_grpc.WorkerServicer):
    """A gRPC worker that forwards to the real one; `mode` injects faults:
    ``record`` (forward, remember requests), ``unavailable`` (Generate fails with UNAVAILABLE),
    ``abort`` (Generate ends with FINISH_REASON_ABORT before any token), ``other_template`` (ModelInfo
    sends a different chat template under the original digest), ``other_template_consistent`` (a
    different template with its matching digest), ``slow_start`` (sends nothing until the caller
    cancels, as if queued behind a long backlog; records the cancellation). It serves Generate calls
    only, so its ModelInfo says so (``generate_many`` false) and the gateway calls it per request."""

    def __init__(self, target: str, mode: str = "record"):
        self.mode = mode
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20)])
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.server = grpc.server(futures.ThreadPoolExecutor(16),
                                  options=[("grpc.max_send_message_length", 256 << 20)])
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        self.health = health.HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("fairshare.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_insecure_port(self.addr)
        self.server.start()

    def Generate(self, request, context):
        self.requests.append(request)
        if self.mode == "slow_start":  # a queue that never moves: only the caller's cancel ends it
            gone = threading.Event()
            context.add_callback(gone.set)
            if gone.wait(300.0):
                self.cancelled.append(request.request_id)
            return
        if self.mode == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected failure")
        if self.mode == "abort":
            yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ABORT,
                                      usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids)))
            return
        yield from self.forward(request, context)

    def forward(self, request, context):
        """The real worker's Generate call for `request`, signed with the gateway's token (cancelled
        with the caller's call)."""
        token = [(k, v) for k, v in context.invocation_metadata() if k == METADATA_KEY]  # the gateway's
        call = self.stub.Generate(request, metadata=token)
        context.add_callback(call.cancel)
        return call

    def Abort(self, request, context):
        return self.stub.Abort(request, metadata=[(k, v) for k, v in context.invocation_metadata()
                                                  if k == METADATA_KEY])

    def GetModelInfo(self, request, context):
        info = self.stub.GetModelInfo(request)
        info.generate_many = False  # this proxy relays Generate calls only (no GenerateMany stream)
        if self.mode.startswith("other_template"):
            info.chat_template = info.chat_template.replace("helpful", "unhelpful")
        if self.mode == "other_template_consistent":
            info.tokenizer_sha256 = hashlib.sha256((info.tokenizer_json + "\0" + info.chat_template).encode()).hexdigest()
        return info

    def GetLoad(self, request, context):
        load = self.stub.GetLoad(request)
        load.inflight_tokens = 0
        return load

    def stop(self):
        self.server.stop(0)
        self.channel.close()


@pytest.fixture
def proxies(worker_addr):
    made = []

    def make(mode="record"):
        p = ProxyWorker(worker_addr, mode)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()


def test_generate_request_carries_gateway_derived_identity(gateway_factory, proxies):
    rec = proxies("record")
    gw = gateway_factory([{"id": "route-a", "weight": 2.5, "tier": "batch"},
                          {"id": "route-b", "tier": "background", "weight": 0.5}], workers=[rec.addr])
    client = gw.client("route-a")
    # the client tries to name another tenant / namespace: ignored
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                       user="route-b", extra_body={"tenant": "route-b", "cache_namespace": "evil",
                                                                   "cache_salt": "my-salt"})
    client.completions.create(model=MODEL, prompt="Once upon", temperature=0.7, top_p=0.9, seed=5, stop=["x"])
    gw.client("route-b").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    a1, a2, b = rec.requests
    assert a1.tenant.id == "route-a" and a1.tenant.weight == 2.5 and a1.tenant.tier == pb.TIER_BATCH
    assert a1.tenant.cache_namespace == "" and a1.cache_salt == "my-salt"
    assert a1.sampling.max_tokens == 3 and a1.sampling.temperature == 0
    assert len(a1.prompt_token_ids) == r.usage.prompt_tokens
    # max_tokens absent: the gateway sends an explicit number (OpenAI's default for completions)
    assert a2.sampling.max_tokens == 16
    assert a2.sampling.seed == 5 and list(a2.sampling.stop) == ["x"]
    assert a2.sampling.top_p == pytest.approx(0.9) and a2.sampling.temperature == pytest.approx(0.7)
    assert a2.tenant.cache_namespace == "" and a2.cache_salt == ""
    assert b.tenant.id == "route-b" and b.tenant.tier == pb.TIER_BACKGROUND and b.tenant.weight == 0.5
    assert b.tenant.cache_namespace == ""  # workers derive namespaces themselves (worker/cache/namespace.py)
    assert len({a1.request_id, a2.request_id, b.request_id}) == 3
    assert not any(q.may_hand_back for q in (a1, a2, b))  # one worker: nowhere to hand a request back to


def test_a_request_may_be_handed_back_only_while_another_worker_could_take_it(gateway_factory, proxies):
    """GenerateRequest.may_hand_back (worker/scheduling/handback.py): set while a worker besides the
    chosen one serves the model; on the retry after the other failed, nothing is left to hand it to."""
    one, two = proxies("record"), proxies("record")
    gw = gateway_factory([{"id": "may-hb"}], workers=[one.addr, two.addr], health_interval_s=30.0,
                         routing="least-loaded")
    client = gw.client("may-hb")
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    sent = one.requests + two.requests
    assert len(sent) == 2 and all(q.may_hand_back for q in sent)
    bad, good = proxies("unavailable"), proxies("record")
    gw = gateway_factory([{"id": "may-hb-retry"}], workers=[bad.addr, good.addr], health_interval_s=30.0,
                         routing="least-loaded")
    client = gw.client("may-hb-retry")
    for _ in range(2):  # least-loaded breaks ties in turn: the failing worker is picked first once
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert bad.requests, "the failing worker was never picked"
    assert bad.requests[0].may_hand_back  # the good worker was still there to take it
    retried = [q for q in good.requests if q.request_id.endswith(".r1")]
    assert retried and not retried[0].may_hand_back  # the failed worker is out: no other worker is left


def test_tenant_a_key_is_never_charged_to_b(gateway_factory, worker_addr):
    # What was charged is read from records that do not expire: the admission's own x-ratelimit-*
    # headers (the remainder right after the charge) and the gateway's per-tenant token counters.
    # A bucket's Redis key expires about 1 s after it refills, so reading it later races a slow machine.
    gw = gateway_factory([{"id": "iso-a", "limits": {"tpm": 100000}}, {"id": "iso-b", "limits": {"tpm": 100000}}],
                         metrics_token="iso-metrics-token")
    raw = gw.client("iso-a").chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=3, extra_body={"tenant": "iso-b"}, user="iso-b")
    r = raw.parse()
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    charged = 100000 - int(raw.headers["x-ratelimit-remaining-tokens"])
    assert charged >= r.usage.prompt_tokens + 1  # the reservation was taken from iso-a's bucket
    assert gw.bucket("iso-b") is None  # never created (a missing bucket is a full one)
    metrics = httpx.get(gw.base_url + "/metrics", headers={"authorization": "Bearer iso-metrics-token"}).text
    charged_series = [line for line in metrics.splitlines()
                      if line.startswith(("fairshare_gateway_tokens_total{", "fairshare_gateway_requests_total{"))]
    assert any('tenant="iso-a"' in line for line in charged_series)
    assert not any('tenant="iso-b"' in line for line in charged_series), charged_series
    with grpc.insecure_channel(worker_addr) as ch:
        load = pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)
    ids = {t.tenant_id for t in load.tenants}
    assert "iso-a" in ids and "iso-b" not in ids


def test_n_choices(gateway_factory, proxies):
    rec = proxies("record")
    gw = gateway_factory([{"id": "n-t", "limits": {"tpm": 100000}}], workers=[rec.addr])
    client = gw.client("n-t")
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, n=3, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(rec.requests[0].prompt_token_ids)
    assert sorted(q.sampling.seed for q in rec.requests) == [11, 12, 13]
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == [0, 1] and chunks[-1].usage.completion_tokens == 8
    t = client.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=2, n=2)
    assert [c.index for c in t.choices] == [0, 1, 2, 3] and t.usage.completion_tokens == 8
    assert gw.leases("n-t") == {}


@pytest.mark.parametrize("mode", ["unavailable", "abort"])
def test_worker_failing_before_first_token_is_retried_on_another(gateway_factory, proxies, worker_addr, mode):
    bad = proxies(mode)
    good = proxies("record")
    gw = gateway_factory([{"id": f"retry-{mode}", "limits": {"tpm": 100000}}], workers=[bad.addr, good.addr],
                         health_interval_s=30.0, metrics_token="routing-metrics-token", routing="least-loaded")
    client = gw.client(f"retry-{mode}")
    for i in range(4):  # least-loaded breaks ties in turn, so the faulty worker is picked first at least once
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, stream=bool(i % 2))
        if i % 2:
            assert list(r)[-1].choices[0].finish_reason == "length"
        else:
            assert r.choices[0].finish_reason == "length"
    assert bad.requests and len(good.requests) == 4
    assert {q.tenant.id for q in good.requests} == {f"retry-{mode}"}
    metrics = httpx.get(gw.base_url + "/metrics", headers={"authorization": "Bearer routing-metrics-token"}).text
    assert f'fairshare_gateway_worker_retries_total{{worker="{bad.addr}"}}' in metrics
    assert gw.leases(f"retry-{mode}") == {}


def test_no_worker_can_serve_is_503_and_refunds(gateway_factory, proxies):
    bad = proxies("unavailable")
    gw = gateway_factory([{"id": "dead", "limits": {"tpm": 6000}}], workers=[bad.addr], health_interval_s=30.0)
    with pytest.raises(openai.InternalServerError) as e:
        gw.client("dead").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10)
    assert e.value.status_code == 503 and e.value.body["type"] == "server_error"
    assert gw.leases("dead") == {}
    tokens, _ = gw.bucket("dead")
    assert tokens > 6000 - 1  # reserved, then refunded in full: nothing was generated


def test_disagreeing_or_unhealthy_worker_is_not_used(gateway_factory, proxies):
    other = proxies("other_template")
    good = proxies("record")
    gw = gateway_factory([{"id": "agree"}], workers=[good.addr, other.addr])
    ready = gw.readyz()
    by_addr = {w["addr"]: w for w in ready["workers"]}
    assert by_addr[good.addr]["agrees"] and not by_addr[other.addr]["agrees"]
    client = gw.client("agree")
    for _ in range(4):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert len(good.requests) == 4 and other.requests == []
    # the good one stops serving: requests get a 503 until it is back
    good.health.set("fairshare.v1.Worker", health_pb2.HealthCheckResponse.NOT_SERVING)
    wait_for(lambda: httpx.get(gw.base_url + "/readyz").status_code == 503, "gateway not ready once no worker serves")
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert e.value.status_code == 503
    good.health.set("fairshare.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
    wait_for(lambda: httpx.get(gw.base_url + "/readyz").status_code == 200, "gateway ready again")
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1).choices


def test_local_tokenizer_decides_which_workers_agree(gateway_factory, proxies, worker_addr, tmp_path):
    with grpc.insecure_channel(worker_addr, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        info = pb_grpc.WorkerStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    (tmp_path / "tokenizer.json").write_text(info.tokenizer_json)
    (tmp_path / "chat_template.jinja").write_text(info.chat_template)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": info.bos_token, "eos_token": info.eos_token}))
    other = proxies("other_template_consistent")
    good = proxies("record")
    gw = gateway_factory([{"id": "local-tok"}], workers=[other.addr, good.addr], tokenizer=tmp_path)
    by_addr = {w["addr"]: w for w in gw.readyz()["workers"]}
    assert by_addr[good.addr]["agrees"] and not by_addr[other.addr]["agrees"]
    client = gw.client("local-tok")
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        assert r.usage.prompt_tokens == len(good.requests[-1].prompt_token_ids)
    assert len(good.requests) == 3 and other.requests == []


def leave_once(base_url: str, key: str, body: dict, arrived) -> None:
    """Send `body` to /v1/chat/completions over a raw connection and close it (as a client that gives
    up does) as soon as `arrived()` is true: the moment the client leaves is a state, not a timer."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + payload)
        wait_for(arrived, "the request reached the worker")


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_the_first_token_cancels_and_releases(gateway_factory, proxies, stream):
    slow = proxies("slow_start")
    tid = f"early-{int(stream)}"
    gw = gateway_factory([{"id": tid, "limits": {"max_concurrent_requests": 1}}], workers=[slow.addr])
    leave_once(gw.base_url, gw.keys[tid], {"model": MODEL, "messages": HELLO, "max_tokens": 5, "stream": stream},
               lambda: slow.requests)
    wait_for(lambda: slow.cancelled and gw.leases(tid) == {},
             lambda: f"the worker call cancelled and the lease released: cancelled {slow.cancelled}, "
                     f"leases {gw.leases(tid)}")
    assert slow.cancelled == [slow.requests[0].request_id]
    # the slot is free again: the tenant's one concurrent request is admitted (and reaches the worker)
    leave_once(gw.base_url, gw.keys[tid], {"model": MODEL, "messages": HELLO, "max_tokens": 5, "stream": stream},
               lambda: len(slow.requests) == 2)
    wait_for(lambda: len(slow.cancelled) == 2 and gw.leases(tid) == {}, "the second call cancelled and released")


async def test_a_worker_reporting_not_serving_leaves_routing_from_its_health_watch_before_any_poll(proxies):
    """A draining worker (NOT_SERVING) is out of routing as soon as its health ``Watch`` stream says
    so, not at the next poll (there is none here: the poll interval is an hour); SERVING again on the
    stream brings it back through a full check. (Late polls: tests/unit/test_gateway_health_poll.py.)"""
    from gateway.routing import WorkerPool
    from tests.support.waits import wait_for_async

    p = proxies("record")
    pool = WorkerPool([p.addr], health_interval_s=3600, health_timeout_s=5.0)
    await pool.start()
    await pool._first_round.wait()
    (w,) = pool.workers
    try:
        assert w.usable and w.worker_id, w.last_error
        await wait_for_async(lambda: w.watch_task is not None, "the health watch started")
        p.health.set("fairshare.v1.Worker", health_pb2.HealthCheckResponse.NOT_SERVING)
        await wait_for_async(lambda: not w.usable, lambda: f"the watch took the NOT_SERVING worker out ({w})")
        assert "watch" in w.last_error
        p.health.set("fairshare.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
        await wait_for_async(lambda: w.usable, lambda: f"the watch brought the SERVING worker back ({w})")
    finally:
        await pool.stop()
