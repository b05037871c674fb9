"""Shared fixtures: a real redis-server and a real gRPC worker on loopback ports.

Also the suite-wide rules that keep a verdict independent of the machine: Hypothesis never times an
example (no deadline, no too-slow health check), and in CI a skip whose reason does not name CUDA or
a GPU is a failure (tests/support/skip_rule.py; tests/unit/test_skip_rule.py checks the files).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fairshare.local_redis import start_redis
from fairshare.ports import free_port, wait_for_port
from tests.support.settlement import wait_answered_settled
from tests.support.skip_rule import skip_allowed_in_ci
from tests.support.skips import in_ci

ROOT = Path(__file__).resolve().parents[1]

# Worker authentication (fairshare/worker_auth.py): every worker and gateway the tests start, in
# process or as a subprocess, verifies and signs with this key; raw gRPC clients sign with
# tests/support/auth.py.
TEST_WORKER_KEYS = "test-key:" + "5e" * 24
os.environ.setdefault("FAIRSHARE_WORKER_KEYS", TEST_WORKER_KEYS)

try:  # (the SGLang test environment has no Hypothesis)
    from hypothesis import HealthCheck, settings

    # In CI the examples are derived from each test's name (derandomize): every run there gives the
    # same verdict, so a landing is never refused by a new random draw; elsewhere every run explores
    # new examples (a failure prints the example and the @reproduce_failure line to replay it).
    settings.register_profile("fairshare", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                              derandomize=in_ci(), database=None if in_ci() else settings.default.database)
    settings.load_profile("fairshare")
except ImportError:
    pass


def _fail_skip_in_ci(report) -> None:
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not skip_allowed_in_ci(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, where only tests that need CUDA may skip: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """URL of a fresh redis-server (no persistence) on a free loopback port, for the session."""
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


TEST_WORKER = [sys.executable, "-m", "tests.support.worker_main"]  # `fairshare worker` + test control


def worker_command(*extra: str, model: str = "random-tiny", policy: str = "vtc", port: int) -> list[str]:
    """The test worker's command line (tests/support/worker_main.py: the flags of `fairshare worker`)."""
    return [*TEST_WORKER, "--host", "127.0.0.1", "--port", str(port), "--model", model, "--policy", policy, *extra]


def start_worker(*extra: str, model: str = "random-tiny", policy: str = "vtc", port: int | None = None,
                 log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start the test worker (the real `fairshare worker` plus its test-control service) as a
    subprocess; return (process, "127.0.0.1:port") once it listens."""
    port = port or free_port()
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(worker_command(*extra, model=model, policy=policy, port=port), cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, env=os.environ.copy())
    wait_for_port("127.0.0.1", port, 300.0, proc)
    return proc, f"127.0.0.1:{port}"


def stop_worker(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM a worker started by `start_worker`; SIGKILL it if it has not exited after timeout_s."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


@pytest.fixture(scope="session")
def worker_addr(tmp_path_factory):
    """Address of the session's test worker serving the seeded random tiny Llama (VTC policy)."""
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    proc, addr = start_worker(log_path=log)
    yield addr
    stop_worker(proc)


@pytest.fixture
def control(worker_addr):
    """The session worker's test control (tests/support/control_client.py); reset before and after
    the test, so a hold or a fault never leaks into the next one."""
    from tests.support.control_client import WorkerControl

    c = WorkerControl(worker_addr)
    c.reset()
    yield c
    c.reset()
    c.close()


# -- gateway fixtures (gateway/ tests) ---------------------------------------------------------------

def wait_ready(base_url: str, timeout_s: float = 120.0) -> None:
    """Wait until the gateway at `base_url` answers /readyz with 200 and has polled every worker it
    was given to a healthy answer (whether their tokenizers agree is the tests' business), so that no
    test depends on how soon a first poll came back (AssertionError after `timeout_s`)."""
    import json
    import urllib.request

    from tests.support.waits import wait_for

    def ready() -> bool:
        with urllib.request.urlopen(base_url + "/readyz", timeout=5) as r:
            body = json.loads(r.read())
            return r.status == 200 and body["workers_healthy"] == body["workers_total"]

    wait_for(ready, f"gateway {base_url} ready, every worker healthy", timeout_s, interval_s=0.05, ignore=(OSError,))

GATEWAY_TEST_SECRET = "gateway-test-secret"
GATEWAY_TEST_METRICS_TOKEN = "gateway-test-metrics-token"  # a test gateway's default metrics token


def readyz_detail(base_url: str, metrics_token: str, timeout_s: float = 5.0) -> dict:
    """The operator's /readyz body (each worker's address and state, the models), read with the metrics
    token; raises AssertionError when the gateway did not give the detail."""
    import httpx

    body = httpx.get(base_url + "/readyz", headers={"authorization": f"Bearer {metrics_token}"},
                     timeout=timeout_s).json()
    assert "workers" in body, f"/readyz gave no worker detail to the metrics token: {body}"
    return body


class GatewayHandle:
    """A gateway served by uvicorn in a background thread, with API keys for its tenants and sync
    helpers to inspect its Redis state (leases, buckets)."""

    def __init__(self, server, settings, keys: dict[str, str], redis_url: str):
        import redis as redis_sync

        from gateway.redis_buckets import tenant_keys

        self.server = server
        self.settings = settings
        self.keys = keys
        self.base_url = server.base_url
        self.redis = redis_sync.Redis.from_url(redis_url)
        self._keys_of = lambda tenant_id: tenant_keys(settings.key_prefix, tenant_id)

    @property
    def app(self):
        return self.server.app

    def readyz(self) -> dict:
        """/readyz as an operator sees it (with this gateway's metrics token)."""
        return readyz_detail(self.base_url, self.settings.metrics_token_value())

    def client(self, tenant_id: str, **kw):
        """Official `openai` client for a tenant's key (no automatic retries)."""
        import openai

        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.keys[tenant_id], **kw)

    def redis_time_ms(self) -> float:
        s, us = self.redis.time()
        return s * 1000 + us / 1000

    def settled(self) -> None:
        """Wait until every answered request has settled (tests/support/settlement.py): the Redis
        reads below call it first, so they see the releases of every response the test has read."""
        wait_answered_settled(self.app.state.gw)

    def leases(self, tenant_id: str, settled: bool = True) -> dict[str, int]:
        """Unexpired in-flight leases of a tenant, once answered requests have settled (settled=False:
        as Redis holds them now): lease id -> tokens."""
        if settled:
            self.settled()
        _, _, z, h = self._keys_of(tenant_id)
        live = self.redis.zrangebyscore(z, f"({self.redis_time_ms()}", "+inf")
        vals = self.redis.hmget(h, live) if live else []
        return {m.decode(): int(float(v)) for m, v in zip(live, vals) if v is not None}

    def lease_expiry_ms(self, tenant_id: str) -> dict[str, float]:
        """Every stored lease of a tenant, expired or not (answered requests settled first): lease id
        -> expiry (Redis time, ms)."""
        self.settled()
        _, _, z, _ = self._keys_of(tenant_id)
        return {m.decode(): score for m, score in self.redis.zrange(z, 0, -1, withscores=True)}

    def bucket(self, tenant_id: str, which: str = "tpm") -> tuple[float, float] | None:
        """Stored (tokens, timestamp ms) of a tenant's ``rpm``/``tpm`` bucket, once answered requests
        have settled (their refunds made); None when absent (full)."""
        self.settled()
        key = self._keys_of(tenant_id)[0 if which == "rpm" else 1]
        t, ts = self.redis.hmget(key, ["t", "ts"])
        return None if t is None else (float(t), float(ts))

    def seed_bucket(self, tenant_id: str, which: str, tokens: float) -> float:
        """Set a bucket to `tokens` now (Redis time); returns that time in ms."""
        key = self._keys_of(tenant_id)[0 if which == "rpm" else 1]
        now = self.redis_time_ms()
        self.redis.hset(key, mapping={"t": repr(float(tokens)), "ts": repr(now)})
        self.redis.pexpire(key, 600_000)
        return now


@pytest.fixture(scope="module")
def gateway_factory(redis_url, worker_addr, tmp_path_factory):
    """`start(tenants, workers=None, **settings) -> GatewayHandle`: a gateway on a free port with the
    given tenants (dicts in the tenants-file schema) and one API key per tenant; stopped when the
    test module ends (module-scoped gateway fixtures use it too). Not at the session's end: a gateway
    left running polls its workers and heartbeats to Redis in this process for every later test
    (after six gateway test modules, a simulator test took 57 s of CPU with their gateways still
    running against 40 s once each module stopped its own)."""
    import yaml

    from gateway.app import create_app
    from gateway.auth import create_key
    from gateway.config import GatewaySettings
    from gateway.serve import ServerThread

    started = []

    def start(tenants: list[dict], workers: list[str] | None = None, wait_ready_s: float = 120.0, **overrides):
        d = tmp_path_factory.mktemp("gateway")
        tf = d / "tenants.yaml"
        tf.write_text(yaml.safe_dump({"tenants": tenants}))
        keys = {t["id"]: create_key(GATEWAY_TEST_SECRET.encode(), t["id"], d / "tenants.keys.yaml")[0]
                for t in tenants}
        overrides.setdefault("redis_url", redis_url)
        overrides.setdefault("metrics_token", GATEWAY_TEST_METRICS_TOKEN)
        settings = GatewaySettings(tenants_file=tf, workers=[worker_addr] if workers is None else workers,
                                   secret=GATEWAY_TEST_SECRET, **overrides)
        server = ServerThread(create_app(settings)).start()
        started.append(server)
        handle = GatewayHandle(server, settings, keys, redis_url)
        if wait_ready_s:
            wait_ready(handle.base_url, wait_ready_s)
        return handle

    yield start
    for s in started:
        s.stop()
