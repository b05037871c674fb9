"""Redis outage under load: redis-server is killed (SIGKILL) while two tenants send requests, then
started again on the same port (empty: no persistence).

The gateway runs with ``redis_outage_policy`` interactive=degrade, batch=fail_closed and
``gateway_replicas=2``. Throughout, the interactive tenant keeps being served (against this replica's
buckets at limit/2, which the test checks with the in-flight limit), the batch tenant gets 503s in
OpenAI's shape with ``retry-after`` only while Redis is down, and nobody ever gets a 500. Streams
admitted before the outage finish normally. After recovery every running request holds exactly one
lease, in Redis (those Redis lost when it restarted are re-created, those held locally are moved),
and when everything has finished no lease is left anywhere and every bucket is within its bounds.

Every phase waits for a state, not a time: the load is served before the kill, the gateway has
noticed the outage and each tier has had its answer from the degraded gateway before Redis returns.
The long streams whose leases are counted stay open on any machine: their worker stops relaying
after the first message (test control `stall_after`, tests/support) until the client closes them.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.reliability.conftest import (HELLO, MODEL, InProcessGateway, RedisServer, assert_error_object,
                                        lease_state, live_leases, open_stream, sse_events, tpm_bucket,
                                        wait_until)
from tests.support.waits import join_all

CAP, EACH = 6000, 1400  # rx-cap's in-flight budget and what each of its streams reserves
LIMITS = {"rpm": 60000, "tpm": 6_000_000, "max_inflight_tokens": 20000, "max_concurrent_requests": 32}
TENANTS = [
    {"id": "rx-inter", "tier": "interactive", "limits": LIMITS},
    {"id": "rx-batch", "tier": "batch", "limits": LIMITS},
    {"id": "rx-cap", "tier": "interactive", "limits": {"max_inflight_tokens": CAP, "tpm": 6_000_000}},
]
SHORT = {"model": MODEL, "messages": HELLO, "max_tokens": 4}
STALL = "[inject:stall]"  # prompt marker of the streams the workers stop relaying after one message
HELD = [{"role": "user", "content": f"Hello {STALL}"}]
LONG = {"model": MODEL, "messages": HELD, "max_tokens": 1500, "ignore_eos": True}


class Load:
    """One tenant's closed-loop load (a plain and a streamed client), recording every outcome."""

    def __init__(self, gw: InProcessGateway, tenant: str) -> None:
        self.gw, self.tenant = gw, tenant
        self.records: list[dict] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in (False, True)]

    def _run(self, stream: bool) -> None:
        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set():
                t0 = time.monotonic()
                rec = {"t0": t0, "stream": stream}
                try:
                    if stream:
                        with http.stream("POST", self.gw.base_url + "/v1/chat/completions", headers=self.gw.headers(
                                self.tenant), json={**SHORT, "stream": True}) as r:
                            rec["status"] = r.status_code
                            rec["headers"] = dict(r.headers)
                            if r.status_code == 200:
                                rec["events"], rec["done"] = sse_events(r.iter_lines())
                            else:
                                r.read()
                                rec["body"] = r.json()
                    else:
                        r = http.post(self.gw.base_url + "/v1/chat/completions", headers=self.gw.headers(self.tenant),
                                      json=SHORT)
                        rec["status"], rec["headers"] = r.status_code, dict(r.headers)
                        rec["body"] = r.json()
                except Exception as e:  # noqa: BLE001 - recorded and asserted on
                    rec["exception"] = repr(e)
                rec["t1"] = time.monotonic()
                self.records.append(rec)
                time.sleep(0.02)  # pacing of the closed loop (orders nothing)

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> list[dict]:
        self.stop.set()
        join_all(self.threads, f"{self.tenant}'s load loops")
        return self.records


@pytest.fixture
def redis_srv(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


def test_redis_killed_and_restarted_under_two_tenant_load(redis_srv, workers, tmp_path):
    gw = InProcessGateway(tmp_path / "gw", TENANTS, workers.addrs, redis_srv.url,
                          redis_outage_policy={"interactive": "degrade", "batch": "fail_closed",
                                               "background": "fail_closed"},
                          gateway_replicas=2, redis_probe_interval_s=0.2, redis_timeout_s=1.0, lease_ttl_s=3.0,
                          health_interval_s=0.5).wait_ready()
    r = redis_srv.client()
    control = gw.gw.control
    http = httpx.Client(timeout=60)
    try:
        for i in range(2):
            workers.control(i).inject("stall_after", after=1, prompt_contains=STALL)
        p = gw.client("rx-cap").chat.completions.create(model=MODEL, messages=HELD, max_tokens=1).usage.prompt_tokens
        cap_body = {"model": MODEL, "messages": HELD, "max_tokens": EACH - p, "ignore_eos": True}

        loads = [Load(gw, "rx-inter").start(), Load(gw, "rx-batch").start()]
        # streams admitted through Redis before the outage, running across it
        before = {t: open_stream(http, gw.base_url, gw.keys[t], LONG) for t in ("rx-inter", "rx-batch")}
        assert all(s.status_code == 200 for s in before.values())
        for ld in loads:
            wait_until(lambda ld=ld: any(x.get("status") == 200 for x in ld.records), f"{ld.tenant} served")

        # -- outage ---------------------------------------------------------------------------------
        t_kill = time.monotonic()
        redis_srv.kill()
        wait_until(lambda: not control.up, "the gateway notices the outage")
        t_noticed = time.monotonic()
        during = open_stream(http, gw.base_url, gw.keys["rx-inter"], LONG)  # admitted locally (degrade)
        assert during.status_code == 200
        # the local share is limit / replicas: 6000 / 2 = 3000 in-flight tokens -> two 1400-token streams, not three
        cap = [open_stream(http, gw.base_url, gw.keys["rx-cap"], cap_body) for _ in range(2)]
        assert [s.status_code for s in cap] == [200, 200]
        third = open_stream(http, gw.base_url, gw.keys["rx-cap"], cap_body)
        third.read()
        assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1, third.text
        assert assert_error_object(third.json())["code"] == "rate_limit_exceeded"
        assert control.local.held() and not (live_leases_safe(r, gw.prefix, "rx-inter"))
        # each tier gets its answer from the degraded gateway: interactive served locally, batch refused
        inter_load, batch_load = loads
        wait_until(lambda: any(x["t0"] > t_noticed and x.get("status") == 200 for x in inter_load.records),
                   "rx-inter served from the local buckets during the outage")
        wait_until(lambda: any(x["t0"] > t_noticed and x.get("status") == 503 for x in batch_load.records),
                   "rx-batch refused (503) during the outage")

        # -- Redis returns (empty) on the same port -----------------------------------------------------
        t_restart = time.monotonic()
        redis_srv.start()
        wait_until(lambda: control.up, "admission back on Redis")
        t_recovered = time.monotonic()
        for ld in loads:  # each tenant is served again (automatic recovery)
            wait_until(lambda ld=ld: sum(x["t0"] > t_recovered and x.get("status") == 200 for x in ld.records) >= 2,
                       f"{ld.tenant} served after recovery")
        records = {ld.tenant: ld.finish() for ld in loads}

        # every running request holds exactly one lease, in Redis: the ones Redis lost were re-created,
        # the local ones moved; nothing is held locally any more
        assert control.local.held() == [] and control.owed == {}
        held = gw.held_lease_ids()
        in_redis = set().union(*(live_leases(r, gw.prefix, t["id"]) for t in TENANTS))
        assert in_redis == held and len(held) == 5, (in_redis, held)  # 2 before, 1 during, 2 rx-cap
        # the moved rx-cap leases count in Redis: 2 x 1400 held, so 2 more fit in 6000 and a third does not
        more = [open_stream(http, gw.base_url, gw.keys["rx-cap"], cap_body) for _ in range(2)]
        assert [s.status_code for s in more] == [200, 200]
        over = open_stream(http, gw.base_url, gw.keys["rx-cap"], cap_body)
        over.read()
        assert over.status_code == 429 and "in-flight" in over.json()["error"]["message"]

        # streams that crossed the outage were never interrupted
        for s in [*before.values(), during, *cap, *more]:
            s.close()
        m = gw.gw.metrics
        assert m.leases_reinstated._value.get() >= 2 and m.leases_moved._value.get() >= 3
        assert m.redis_up._value.get() == 1

        # -- what the clients saw ----------------------------------------------------------------------
        for tenant, recs in records.items():
            assert recs, tenant
            for rec in recs:
                assert "exception" not in rec, rec
                assert rec["status"] in (200, 429, 503), rec
                if rec["status"] == 200 and rec["stream"]:
                    assert rec["done"] and not any("error" in e for e in rec["events"]), rec
                if rec["status"] != 200:
                    assert_error_object(rec["body"])
                    assert int(rec["headers"]["retry-after"]) >= 1
            after = [x for x in recs if x["t0"] > t_recovered]
            assert after and all(x["status"] == 200 for x in after), (tenant, after)
        inter, batch = records["rx-inter"], records["rx-batch"]
        assert all(x["status"] == 200 for x in inter), [x for x in inter if x["status"] != 200]
        outage = [x for x in batch if x["status"] == 503]
        assert outage, "the batch tier must fail closed during the outage"
        for x in outage:  # only while Redis was down (every request sent after the recovery got a 200, above)
            assert t_kill <= x["t1"] and x["t0"] <= t_recovered, (x, t_kill, t_recovered)
            assert x["body"]["error"]["type"] == "server_error" and "rate limiter" in x["body"]["error"]["message"]
        served_during = [x for x in inter if t_noticed < x["t0"] and x["t1"] < t_restart]
        assert served_during, "the interactive tier is served from local buckets during the outage"
        print(f"\nredis outage: down {t_restart - t_kill:.1f} s, admission back on Redis {t_recovered - t_restart:.2f} s "
              f"after the restart; during the outage interactive got {len(served_during)} x 200, batch got "
              f"{len(outage)} x 503 (retry-after 1); {m.leases_reinstated._value.get():.0f} leases re-created, "
              f"{m.leases_moved._value.get():.0f} moved from local buckets into Redis")

        # -- nothing lost or left behind -------------------------------------------------------------------
        wait_until(lambda: not gw.gw.live and not control.live, "every request settled")
        for t in TENANTS:
            assert lease_state(r, gw.prefix, t["id"]) == (set(), set()), t["id"]
            b = tpm_bucket(r, gw.prefix, t["id"])
            assert b is None or 0 <= b[0] <= t["limits"]["tpm"], (t["id"], b)
            lb = control.local.bucket(t["id"], "tpm")
            assert lb is None or 0 <= lb[0] <= lb[1] == t["limits"]["tpm"] / 2, (t["id"], lb)
        assert control.local.held() == [] and control.owed == {}
    finally:
        http.close()
        gw.stop()
        r.close()


def live_leases_safe(r, prefix, tenant):
    """Redis is down: nothing can be read (and nothing is expected)."""
    try:
        return live_leases(r, prefix, tenant)
    except Exception:  # noqa: BLE001
        return set()
