"""`fairshare up` as a subprocess: the handle `fairshare loadtest` and the e2e tests start the platform with.

::

    up = UpProcess(state_dir, "--max-running", "4", model="random-tiny", log_path=Path("up.log"))
    up.start(timeout_s=180)          # free ports, output collected, returns once the banner is printed
    up.keys                          # {tenant: "sk-..."} as the banner printed them (new keys only)
    up.base_url, up.worker_addr      # "http://127.0.0.1:PORT/v1", "127.0.0.1:PORT"
    up.metrics_urls()                # {"gateway": [...], "workers": [...]} from run.json
    up.wait_for_line("the worker is back", timeout_s=300, what="the worker's restart")
    up.stop()                        # Ctrl-C (SIGINT), as a user stops it; returns the exit status

The banner lines parsed here are the ones `fairshare.cli.up._print_banner` writes (``tenant ID key
sk-...``, ``model: NAME``, and ``Ctrl-C stops everything.`` as its last text line).
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
from pathlib import Path

from fairshare.ports import free_port, port_in_use

ROOT = Path(__file__).resolve().parents[1]
BANNER_DONE = "Ctrl-C stops everything."
KEY_RE = re.compile(r"tenant\s+(\S+)\s+key\s+(sk-\S+)")
MODEL_RE = re.compile(r"^\s*model:\s+(\S+)", re.M)
DEFAULT_COMMAND = (sys.executable, "-m", "fairshare.cli")


class UpNotReady(RuntimeError):
    """`fairshare up` exited, or did not print its banner in time; the message ends with its last output."""


class UpProcess:
    """One `fairshare up` child on three distinct free loopback ports (gateway, worker, Redis).

    Args:
        state_dir: its ``--state-dir`` (tenants file, keys, secret, run.json).
        *extra: more `fairshare up` arguments, e.g. ``"--max-running", "4"``.
        model: ``--model`` (smollm2, random-tiny, or a model directory).
        policy: ``--policy`` (vtc, fcfs); None leaves the default.
        log_path: a file that gets every byte it prints (appended); None keeps it in memory only.
        command: how to call `fairshare` (default ``python -m fairshare.cli`` of this interpreter;
            the e2e tests pass the console script, as `make up` runs it).

    Its combined stdout/stderr is read by a thread into `lines` (``\\r`` counts as a line end, so
    progress bars do not pile up into one line). The child gets its own session, so `kill()` can
    SIGKILL its process group.
    """

    def __init__(self, state_dir: Path, *extra: str, model: str = "smollm2", policy: str | None = None,
                 log_path: Path | None = None, command: list[str] | tuple[str, ...] = DEFAULT_COMMAND,
                 workers: int = 1):
        self.state_dir, self.extra, self.model_arg, self.policy = Path(state_dir), list(extra), model, policy
        self.log_path, self.command = log_path, list(command)
        self.workers = workers
        ports: list[int] = []
        while len(ports) < 3:
            p = free_port()
            consecutive = [p + i for i in range(workers)] if len(ports) == 1 else [p]  # the workers' block
            if not any(q in ports or q > 65535 or (q != p and port_in_use("127.0.0.1", q)) for q in consecutive):
                ports.append(p)
        self.port, self.worker_port, self.redis_port = ports
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    # -- where it listens, what it printed --------------------------------------------------------

    @property
    def url(self) -> str:
        """The gateway, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (``url + "/v1"``)."""
        return self.url + "/v1"

    @property
    def worker_addr(self) -> str:
        """The (first) worker's gRPC address ``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.worker_port}"

    @property
    def worker_addrs(self) -> list[str]:
        """Every worker's gRPC address (``workers`` consecutive ports)."""
        return [f"127.0.0.1:{self.worker_port + i}" for i in range(self.workers)]

    @property
    def output(self) -> str:
        """Everything read so far, one string."""
        return "\n".join(self.lines)

    @property
    def keys(self) -> dict[str, str]:
        """{tenant: API key} printed in the banner: only keys created by this run (none on a rerun)."""
        return dict(KEY_RE.findall(self.output))

    @property
    def model(self) -> str:
        """The served model name from the banner ("" before the banner)."""
        m = MODEL_RE.search(self.output)
        return m.group(1) if m else ""

    def run_info(self) -> dict:
        """``state_dir/run.json``: pids and ports of its children. Raises OSError/ValueError if absent."""
        return json.loads((self.state_dir / "run.json").read_text())

    def metrics_urls(self) -> dict[str, list[str]]:
        """The admin listeners' /metrics URLs: ``{"gateway": [url], "workers": [url]}`` (run.json)."""
        return self.run_info()["metrics"]

    def lines_matching(self, needle: str) -> list[str]:
        """Every line printed so far that contains `needle`."""
        return [ln for ln in list(self.lines) if needle in ln]

    def wait_for_line(self, needle: str, timeout_s: float, what: str, count: int = 1) -> str:
        """Wait until at least `count` printed lines contain `needle`; returns the last of them.
        Raises TimeoutError naming `what` (with its last output) after `timeout_s` seconds, or
        UpNotReady when it exits first without printing them."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.lines_matching(needle)
            if len(found) >= count:
                return found[-1]
            if self.proc is not None and self.proc.poll() is not None:
                self._join_reader()
                found = self.lines_matching(needle)
                if len(found) >= count:
                    return found[-1]
                raise UpNotReady(f"`fairshare up` exited with {self.proc.returncode} before {what}:\n"
                                 + self.output[-3000:])
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s (no line with {needle!r} "
                                   f"x{count}):\n" + self.output[-3000:])
            time.sleep(0.1)

    # -- life cycle -------------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the child and its output reader; does not wait."""
        cmd = [*self.command, "up", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-port", str(self.worker_port), "--redis-port", str(self.redis_port),
               "--model", self.model_arg, "--state-dir", str(self.state_dir)]
        if self.policy:
            cmd += ["--policy", self.policy]
        if self.workers != 1:
            cmd += ["--workers", str(self.workers)]
        cmd += self.extra
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def start(self, timeout_s: float = 900.0) -> "UpProcess":
        """`spawn()`, then wait up to `timeout_s` seconds for the banner.

        Raises UpNotReady if it exits first or the time runs out; it is stopped (`stop()`) before
        the error propagates, as it is on any other exception (Ctrl-C) while waiting.
        """
        self.spawn()
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        try:
            while BANNER_DONE not in self.output:
                if self.proc.poll() is not None:
                    self._join_reader()
                    raise UpNotReady(f"`fairshare up` exited with {self.proc.returncode} before it was ready:\n"
                                     + self.output[-4000:])
                if time.monotonic() > deadline:
                    raise UpNotReady(f"`fairshare up` not ready after {timeout_s:.0f} s:\n" + self.output[-4000:])
                time.sleep(0.2)
        except BaseException:
            self.stop(timeout_s=30.0)
            raise
        return self

    def wait(self, timeout_s: float) -> int:
        """Wait for it to exit by itself and for its last output; returns the exit status.
        Raises subprocess.TimeoutExpired after `timeout_s` seconds."""
        assert self.proc is not None
        rc = self.proc.wait(timeout_s)
        self._join_reader()
        return rc

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int | None:
        """Send `sig` (Ctrl-C by default; SIGTERM also stops it cleanly) and wait up to `timeout_s`
        seconds; if it hangs, `kill()`. Returns the exit status (negative: killed by that signal),
        None if it was never spawned."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._join_reader()
        return self.proc.returncode

    def kill(self) -> None:
        """Last resort: SIGKILL the process group of `fairshare up` and of every child run.json names."""
        if self.proc is None:
            return
        pids: list[int] = []
        try:
            pids = [int(p) for p in self.run_info().get("children", {}).values()]
        except (OSError, ValueError):
            pass
        for pid in [self.proc.pid, *pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._join_reader()

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(5)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        log = open(self.log_path, "ab") if self.log_path is not None else None
        try:
            buf = b""
            while True:
                chunk = self.proc.stdout.read1(65536)
                if not chunk:
                    break
                if log is not None:
                    log.write(chunk)
                    log.flush()
                buf += chunk
                *done, buf = buf.replace(b"\r", b"\n").split(b"\n")
                self.lines.extend(d.decode("utf-8", "replace") for d in done)
            if buf:
                self.lines.append(buf.decode("utf-8", "replace"))
        finally:
            if log is not None:
                log.close()
