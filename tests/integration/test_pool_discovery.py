"""A pool, with real processes: `fairshare gateway` discovering reference workers (random tiny model)
through a workers file and through a DNS name, a worker added while the gateway runs, and a worker
drained with SIGTERM in the middle of load.

Every wait is on a state (the gateway's routing table in /readyz, the workers' own GetLoad and logs)
and fails naming it; nothing depends on how fast the machine is: the drained worker is kept draining
by a stream its test control stalls (tests/support/worker_control.py ``stall_after``), not by a
request long enough to outlast the test. The time from adding a worker to a request finishing on it
is measured and printed, never asserted (design bound: one discovery interval, 5 s by default, plus
one health check).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from fairshare.ports import free_port
from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from tests.support.auth import signed_channel
from tests.conftest import start_worker, stop_worker
from tests.support.control_client import WorkerControl
from tests.reliability.conftest import MODEL, GatewayProcess, get_load, tenant_load, wait_until

TENANT = "pool-t"
TENANTS = [{"id": TENANT, "limits": {"rpm": 100000, "tpm": 10000000, "max_concurrent_requests": 64}}]


def routing_table(gw: GatewayProcess) -> dict[str, dict]:
    """The gateway's workers as /readyz lists them (addr -> entry)."""
    return {w["addr"]: w for w in gw.readyz()["workers"]}


def usable(gw: GatewayProcess, addr: str) -> bool:
    return bool(routing_table(gw).get(addr, {}).get("usable"))


def finished_on(addr: str) -> int:
    t = tenant_load(addr, TENANT)
    return int(t.finished) if t is not None else 0


@pytest.fixture
def worker_a(tmp_path):
    proc, addr = start_worker("--threads", "1", log_path=tmp_path / "worker-a.log")
    yield addr
    stop_worker(proc)


def test_gateway_with_a_dns_name_routes_to_its_addresses(tmp_path, worker_a, redis_url):
    port = int(worker_a.rsplit(":", 1)[1])
    gw = GatewayProcess(tmp_path, TENANTS, [f"dns:///localhost:{port}"], redis_url)
    try:
        gw.wait_ready(120)
        assert usable(gw, worker_a), routing_table(gw)  # localhost -> 127.0.0.1: the worker
        before = finished_on(worker_a)
        r = gw.client(TENANT).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=2)
        assert r.choices[0].finish_reason == "length" and finished_on(worker_a) == before + 1
    finally:
        gw.stop()


class Load:
    """Client threads sending small requests through the gateway until stopped; counts outcomes."""

    def __init__(self, gw: GatewayProcess, threads: int = 4) -> None:
        self.gw = gw
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        self._lock = threading.Lock()

    def _run(self) -> None:
        client = self.gw.client(TENANT, timeout=120)
        while not self._stop.is_set():
            try:
                r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to ten"}],
                                                   max_tokens=8)
                assert r.choices[0].finish_reason == "length"
                with self._lock:
                    self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the test
                with self._lock:
                    self.failed.append(f"{type(e).__name__}: {e}")

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)


HOLDER = "holder"


def held_open_stream(addr: str, control: WorkerControl) -> tuple[grpc.Channel, object]:
    """A Generate call straight to a worker whose stream stays open until the test cancels it: the
    worker's test control stalls it after its first message, so the worker has a request in flight
    (and a SIGTERM drain waits on it) however fast the engine runs."""
    control.inject("stall_after", tenant=HOLDER, after=1)
    ch = signed_channel(addr)  # Generate is signed as the gateway signs it (worker authentication)
    req = pb.GenerateRequest(request_id="hold-open", tenant=pb.Tenant(id=HOLDER, weight=1.0),
                             prompt_token_ids=list(range(5, 25)),
                             sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True, temperature=0))
    call = pb_grpc.WorkerStub(ch).Generate(req)
    next(call)  # its first message: it is live on the worker now
    wait_for_stalled(control)
    return ch, call


def wait_for_stalled(control: WorkerControl) -> None:
    wait_until(lambda: any(e["kind"] == "stalled" for e in control.events(tenant=HOLDER)),
               "the held-open stream stalled by the worker's test control")


def test_added_worker_is_used_and_a_draining_worker_leaves_routing_before_it_stops(tmp_path, worker_a, redis_url):
    workers_file = tmp_path / "workers.txt"
    workers_file.write_text(f"{worker_a}\n")
    # least-loaded routing: both workers get requests; the default discovery interval (5 s)
    gw = GatewayProcess(tmp_path, TENANTS, [f"file://{workers_file}"], redis_url, "--routing", "least-loaded")
    b_log = tmp_path / "worker-b.log"
    b_port = free_port()
    b_proc = None
    load = None
    try:
        gw.wait_ready(120)
        b_proc, worker_b = start_worker("--threads", "1", "--drain-timeout", "300", port=b_port, log_path=b_log)
        # -- a worker that appears is used ------------------------------------------------------------
        t0 = time.monotonic()
        workers_file.write_text(f"{worker_a}\n{worker_b}\n")
        load = Load(gw).start()
        wait_until(lambda: usable(gw, worker_b), f"the gateway's routing table lists {worker_b} as usable")
        wait_until(lambda: finished_on(worker_b) > 0, f"a request routed by the gateway finished on {worker_b}")
        used_s = time.monotonic() - t0
        print(f"\nworker added to the workers file -> a request finished on it: {used_s:.1f} s "
              f"(discovery interval 5 s)")
        assert routing_table(gw)[worker_b]["worker_id"], "ModelInfo.worker_id reaches the routing table"
        # -- SIGTERM mid-load: it leaves routing before it stops; no request fails ---------------------
        control_b = WorkerControl(worker_b)
        hold_ch, hold = held_open_stream(worker_b, control_b)  # keeps B draining until the test lets it go
        b_proc.send_signal(15)
        wait_until(lambda: get_load(worker_b).draining, f"{worker_b} reports draining after SIGTERM")
        wait_until(lambda: not usable(gw, worker_b), f"the gateway takes the draining {worker_b} out of routing")
        assert b_proc.poll() is None, "the worker must still be draining while the gateway takes it out"

        def gateway_work_on_b_done() -> bool:
            t = tenant_load(worker_b, TENANT)
            return t is None or (t.running == 0 and t.waiting == 0)

        # what the gateway had sent B before it left routing finishes there (that is the drain)
        wait_until(gateway_work_on_b_done, f"the gateway's requests already on {worker_b} finished")
        served_on_b = finished_on(worker_b)
        ok_before = load.ok
        wait_until(lambda: load.ok >= ok_before + 20, "20 more requests through the gateway after B left routing")
        assert finished_on(worker_b) == served_on_b, "the gateway sent work to a worker it had taken out"
        assert finished_on(worker_a) > 0
        assert b_proc.poll() is None, "B drains while its held-open stream is in flight"
        hold.cancel()  # let B finish draining: it exits by itself
        hold_ch.close()
        control_b.close()
        b_proc.wait(120)
        assert b_proc.returncode == 0
        load.stop()
        assert load.failed == [], load.failed[:5]
        log = b_log.read_text(errors="replace")
        assert log.index("draining:") < log.index("stopped (refused")  # its own order of events
        refused = int(log.split("stopped (refused ")[1].split(" ")[0])
        assert refused == log.count("refused request ")  # any refused ones were retried elsewhere: none failed
        assert usable(gw, worker_a)
    finally:
        if load is not None:
            load.stop()
        if b_proc is not None and b_proc.poll() is None:
            stop_worker(b_proc)
        gw.stop()
