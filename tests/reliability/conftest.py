"""Fixtures and helpers of the reliability suite: real processes (redis-server, reference workers with
the random tiny model, gateways in process or as `fairshare gateway` subprocesses) that the tests break.

- `RedisServer`: a redis-server the test can kill (SIGKILL) and restart on the same port.
- `KillableWorkers` / `two_workers`: two test workers (package scope; tests/support/worker_main.py:
  the real worker plus its test control) that tests may kill or SIGTERM; `ensure_alive()` restarts
  the dead ones on their ports (the next test's setup does it). `control(i)` holds worker i's engine
  or injects its faults (tests/support/control_client.py); every test starts with both reset.
- `InProcessGateway`: the app under uvicorn in a thread, with access to its internals (leases held,
  owed settlements) and to the Redis it uses.
- `GatewayProcess`: `python -m fairshare.cli gateway ...` as a subprocess (to kill -9 or SIGTERM it).
- SSE and OpenAI-error helpers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import grpc
import httpx
import pytest
import redis as redis_sync
import yaml

from fairshare.local_redis import start_redis
from fairshare.ports import free_port, wait_for_port
from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from tests.conftest import GATEWAY_TEST_METRICS_TOKEN, ROOT, readyz_detail, worker_command
from tests.support.control_client import WorkerControl
from tests.support.settlement import wait_answered_settled
from tests.support.waits import DEFAULT_TIMEOUT_S, wait_for

SECRET = "reliability-test-secret"
MODEL = "random-tiny"
HELLO = [{"role": "user", "content": "Hello, how are you?"}]


# -- waiting -----------------------------------------------------------------------------------------

def wait_until(pred: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = DEFAULT_TIMEOUT_S,
               interval_s: float = 0.05) -> float:
    """Poll `pred` until truthy (a probe that raises is "not yet"); return the seconds it took (for
    the report, never asserted). AssertionError naming `what` after `timeout_s` (a hang's ceiling)."""
    t0 = time.monotonic()
    wait_for(pred, what, timeout_s, interval_s, ignore=(Exception,))
    return time.monotonic() - t0


# -- OpenAI-shaped errors and SSE ---------------------------------------------------------------------

def assert_error_object(obj: Any) -> dict:
    """`obj` is exactly ``{"error": {"message": str, "type": str, "param": str|None, "code": str|None}}``."""
    assert isinstance(obj, dict) and set(obj) == {"error"}, obj
    err = obj["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


def assert_error_response(resp: httpx.Response, status: int | None = None) -> dict:
    """An HTTP error answer in OpenAI's shape (JSON body), optionally with `status`."""
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.status_code >= 400, resp.status_code
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    return assert_error_object(resp.json())


def sse_events(lines) -> tuple[list[dict], bool]:
    """(JSON objects of the ``data:`` lines, whether ``data: [DONE]`` was seen)."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    return events, done


# -- Redis ---------------------------------------------------------------------------------------------

class RedisServer:
    """A redis-server on a fixed port that can be killed (SIGKILL) and started again on that port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = start_redis(self.port, self.workdir)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self) -> redis_sync.Redis:
        return redis_sync.Redis.from_url(self.url, socket_timeout=2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def lease_state(r: redis_sync.Redis, prefix: str, tenant: str) -> tuple[set[str], set[str]]:
    """(members of the tenant's lease zset, fields of its lease hash), expired or not."""
    base = f"{prefix}:{{{tenant}}}"
    z = {m.decode() for m in r.zrange(f"{base}:leases", 0, -1)}
    h = {f.decode() for f in r.hkeys(f"{base}:lease_tokens")}
    return z, h


def live_leases(r: redis_sync.Redis, prefix: str, tenant: str) -> set[str]:
    """Unexpired lease ids of a tenant."""
    s, us = r.time()
    now_ms = s * 1000 + us / 1000
    return {m.decode() for m in r.zrangebyscore(f"{prefix}:{{{tenant}}}:leases", f"({now_ms}", "+inf")}


def tpm_bucket(r: redis_sync.Redis, prefix: str, tenant: str) -> tuple[float, float] | None:
    t, ts = r.hmget(f"{prefix}:{{{tenant}}}:tpm", ["t", "ts"])
    return None if t is None else (float(t), float(ts))


# -- tenants and keys ----------------------------------------------------------------------------------

def write_tenants(d: Path, tenants: list[dict]) -> tuple[Path, dict[str, str]]:
    """Write a tenants file and one key per tenant in `d`; returns (tenants file, {tenant: key})."""
    from gateway.auth import create_key

    d.mkdir(parents=True, exist_ok=True)
    tf = d / "tenants.yaml"
    tf.write_text(yaml.safe_dump({"tenants": tenants}))
    keys = {t["id"]: create_key(SECRET.encode(), t["id"], d / "tenants.keys.yaml")[0] for t in tenants}
    return tf, keys


def wait_ready(base_url: str, timeout_s: float = DEFAULT_TIMEOUT_S, proc: subprocess.Popen | None = None) -> None:
    """Until the gateway is ready and routes to every worker it was given (each healthy and agreeing):
    the tests spread requests over the workers, so one still unpolled (a first poll that came too
    late on a loaded machine) must not leave them all on the other."""
    last = {}

    def ready():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}")
        try:
            r = httpx.get(base_url + "/readyz", timeout=5)
        except (httpx.HTTPError, OSError):
            return False
        last["body"] = r.text[:1000]
        body = r.json()
        return r.status_code == 200 and body["workers_usable"] == body["workers_total"]

    wait_for(ready, lambda: f"gateway {base_url} ready with every worker usable; /readyz {last.get('body')}",
             timeout_s)


# -- gateways --------------------------------------------------------------------------------------------

class _TenantClients:
    """What both gateway handles give a test: an official openai client or bearer headers for a
    tenant (needs `base_url` and `keys`: tenant -> API key), and /readyz as an operator sees it."""

    base_url: str
    keys: dict[str, str]

    def readyz(self) -> dict:
        """/readyz with the test gateways' metrics token: each worker's address and state."""
        return readyz_detail(self.base_url, GATEWAY_TEST_METRICS_TOKEN)

    def client(self, tenant: str, **kw):
        import openai

        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.keys[tenant], **kw)

    def headers(self, tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[tenant]}"}


class InProcessGateway(_TenantClients):
    """The gateway app under uvicorn in a thread of the test process (its internals are inspectable)."""

    def __init__(self, d: Path, tenants: list[dict], workers: list[str], redis_url: str, **overrides) -> None:
        from gateway.app import create_app
        from gateway.config import GatewaySettings
        from gateway.serve import ServerThread

        self.tenants_file, self.keys = write_tenants(d, tenants)
        overrides.setdefault("key_prefix", "fs-rel-" + d.name)
        overrides.setdefault("metrics_token", GATEWAY_TEST_METRICS_TOKEN)
        self.settings = GatewaySettings(tenants_file=self.tenants_file, workers=workers, redis_url=redis_url,
                                        secret=SECRET, **overrides)
        self.prefix = self.settings.key_prefix
        self.server = ServerThread(create_app(self.settings)).start()
        self.base_url = self.server.base_url
        self.redis_url = redis_url

    @property
    def gw(self):
        return self.server.app.state.gw

    def wait_ready(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> "InProcessGateway":
        wait_ready(self.base_url, timeout_s)
        return self

    def redis_client(self) -> redis_sync.Redis:
        return redis_sync.Redis.from_url(self.redis_url, socket_timeout=5)

    def held_lease_ids(self) -> set[str]:
        """Lease ids this gateway holds for running requests (Redis-held and local), once its answered
        requests have settled."""
        self.settled()
        return set(dict(self.gw.control.live))

    def settled(self) -> None:
        """Wait until every answered request has settled (tests/support/settlement.py)."""
        wait_answered_settled(self.gw)

    def stop(self) -> None:
        self.server.stop()


class GatewayProcess(_TenantClients):
    """`python -m fairshare.cli gateway ...` as a subprocess (its own process group), logging to a file."""

    def __init__(self, d: Path, tenants: list[dict] | None, workers: list[str], redis_url: str, *args: str,
                 port: int | None = None, env: dict[str, str] | None = None, tenants_file: Path | None = None,
                 keys: dict[str, str] | None = None) -> None:
        if tenants is not None:
            self.tenants_file, self.keys = write_tenants(d, tenants)
        else:
            self.tenants_file, self.keys = tenants_file, dict(keys or {})
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = d / f"gateway-{self.port}-{int(time.time() * 1000)}.log"
        cmd = [sys.executable, "-m", "fairshare.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
               "--tenants", str(self.tenants_file), "--workers", ",".join(workers), "--redis-url", redis_url, *args]
        e = {k: v for k, v in os.environ.items() if not k.startswith("FAIRSHARE_") or k == "FAIRSHARE_WORKER_KEYS"}
        e.update({"FAIRSHARE_SECRET": SECRET, "FAIRSHARE_HEALTH_INTERVAL_S": "0.3", "PYTHONUNBUFFERED": "1",
                  "FAIRSHARE_METRICS_TOKEN": GATEWAY_TEST_METRICS_TOKEN})
        e.update(env or {})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> "GatewayProcess":
        wait_ready(self.base_url, timeout_s, self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL (no cleanup of any kind)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def term(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 25) -> str:
        """The last `lines` lines of the gateway's log (for a wait's failure message)."""
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


# -- workers -----------------------------------------------------------------------------------------------

def get_load(addr: str) -> pb.Load:
    with grpc.insecure_channel(addr) as ch:
        return pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)


def tenant_load(addr: str, tenant: str) -> pb.TenantLoad | None:
    return next((t for t in get_load(addr).tenants if t.tenant_id == tenant), None)


def idle(addr: str) -> bool:
    """Nothing waiting or running and every KV block free."""
    load = get_load(addr)
    return load.waiting == 0 and load.running == 0 and load.kv_blocks_used == 0


class KillableWorkers:
    """Test workers (random tiny model) on fixed ports that tests may kill or SIGTERM.

    inject_rules: faults (`WorkerControl.inject` arguments) every worker started from now on has from
    its first request (`--test-inject`), e.g. for one restarted while traffic flows; `reset()` clears them."""

    def __init__(self, d: Path, n: int = 2, drain_timeout_s: float = 4.0) -> None:
        self.d = d
        self.ports = [free_port() for _ in range(n)]
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.drain_timeout_s = drain_timeout_s
        self.starts = 0
        self.inject_rules: list[dict] = []
        self._controls: dict[int, WorkerControl] = {}

    def _spawn(self, i: int) -> subprocess.Popen:
        inject = [x for rule in self.inject_rules for x in ("--test-inject", json.dumps(rule))]
        cmd = worker_command("--drain-timeout", str(self.drain_timeout_s), "--threads", "1", *inject, model=MODEL,
                             port=self.ports[i])
        self.starts += 1
        log = open(self.d / f"worker-{i}-{self.starts}.log", "wb")
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
                                start_new_session=True)

    def control(self, i: int) -> WorkerControl:
        """The test control of worker `i` (tests/support/control_client.py; one channel per port, which
        reconnects to a restarted worker)."""
        if i not in self._controls:
            self._controls[i] = WorkerControl(self.addrs[i])
        return self._controls[i]

    def reset(self) -> None:
        """Release every engine and stalled stream, disarm every fault (live and for later starts)."""
        self.inject_rules = []
        for i in range(len(self.ports)):
            if self.alive(i):
                self.control(i).reset()

    def alive(self, i: int) -> bool:
        p = self.procs[i]
        return p is not None and p.poll() is None

    def ensure_alive(self) -> None:
        """Start every worker that is not running (in parallel) and wait until each serves."""
        started = []
        for i in range(len(self.ports)):
            if not self.alive(i):
                self.procs[i] = self._spawn(i)
                started.append(i)
        for i in started:
            wait_for_port("127.0.0.1", self.ports[i], 300.0, self.procs[i])
        for i in range(len(self.ports)):
            wait_until(lambda i=i: get_load(self.addrs[i]) is not None, f"worker {i} answers")

    def start_async(self, i: int) -> None:
        """Start worker `i` again without waiting (it listens ~10 s later)."""
        if not self.alive(i):
            self.procs[i] = self._spawn(i)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)

    def term(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)

    def logs(self) -> str:
        return "\n".join(f.read_text(errors="replace") for f in sorted(self.d.glob("worker-*.log")))

    def stop(self) -> None:
        for c in self._controls.values():
            c.close()
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                p.terminate()
        for p in self.procs:
            if p is not None:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


@pytest.fixture(scope="package")
def two_workers(tmp_path_factory):
    """Two killable reference workers (drain timeout 4 s); each test gets both running."""
    ws = KillableWorkers(tmp_path_factory.mktemp("workers"), 2)
    ws.ensure_alive()
    yield ws
    ws.stop()


@pytest.fixture
def workers(two_workers):
    """Both workers running, their test controls reset (and reset again after the test)."""
    two_workers.ensure_alive()
    two_workers.reset()
    yield two_workers
    two_workers.reset()


def open_stream(http: httpx.Client, base_url: str, key: str, body: dict, path: str = "/v1/chat/completions"):
    """POST a streamed request and return the response once its headers arrived (unread body)."""
    req = http.build_request("POST", base_url + path, json={**body, "stream": True},
                             headers={"authorization": f"Bearer {key}"})
    return http.send(req, stream=True)


def read_stream(resp: httpx.Response) -> tuple[list[dict], bool]:
    """Read an SSE response to its end: (events, saw [DONE]). A broken connection ends it early."""
    lines = []
    try:
        for line in resp.iter_lines():
            lines.append(line)
    except httpx.HTTPError:
        pass
    finally:
        resp.close()
    return sse_events(lines)
