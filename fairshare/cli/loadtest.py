"""`fairshare loadtest`: run a Locust campaign against FairShare and write a per-tenant report.

::

    fairshare loadtest list
    fairshare loadtest CAMPAIGN [--policy vtc|fcfs|both] [--duration S] [--model smollm2|random-tiny|DIR]
                                [--max-running N] [--rate-scale X] [--length-scale X] [--seed N] [--out DIR]
    fairshare loadtest CAMPAIGN --url URL [--keys FILE] [--worker HOST:PORT]... [--worker-metrics URL]...
                                [--policy-label NAME] [--duration S] [--out DIR]

Without ``--url`` it starts the platform on this machine for each policy (``fairshare up`` on free
ports, a temporary state directory whose tenants file holds the campaign's tenants, the worker's
``--max-running`` from the campaign unless given), reads the tenants' API keys from its banner, runs
Locust headless for the campaign's duration, samples the worker's per-tenant counters (GetLoad)
every second, stops the platform, and then writes ``report.md`` (with ``ttft.png``, ``service.png``,
``rejections.png``) and ``summary.json`` into ``--out``. ``--policy both`` runs FCFS, then VTC, with
the same requests (same seed), and puts them side by side.

With ``--url`` it runs against a deployed gateway: keys come from ``--keys FILE`` (YAML/JSON
``{tenant: key}``) or the environment (``FAIRSHARE_LOADTEST_KEYS``, ``FAIRSHARE_KEY_<TENANT>``; see
`loadtests.client`); per-tenant service comes from the workers' GetLoad (``--worker``, repeatable)
or their Prometheus endpoints (``--worker-metrics``, repeatable; ``fairshare worker --metrics-port``),
summed over workers, else it is estimated from the usage the client saw. The policy is whatever the
cluster runs: read from GetLoad or the metrics when available, else ``--policy-label``.

Exit status: 0 when the report was written, 1 on a failure (platform did not start, Locust failed,
no request completed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from fairshare.cli.scrape import add_metrics_url_options
from loadtests.up_process import UpNotReady, UpProcess

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
UP_READY_TIMEOUT_S = 900.0
SAMPLE_INTERVAL_S = 1.0


class LoadtestError(Exception):
    """An expected failure: printed as one line, exit status 1."""


def log(msg: str) -> None:
    print(f"fairshare loadtest: {msg}", flush=True)


# ------------------------------------------------------------------------------------------------
# Worker sampling
# ------------------------------------------------------------------------------------------------

_PROM_FIELDS = {
    "fairshare_worker_tenant_charged_service_units": "charged_service",
    "fairshare_worker_tenant_prompt_tokens_computed": "prompt_tokens",
    "fairshare_worker_tenant_output_tokens": "output_tokens",
    "fairshare_worker_tenant_finished_requests": "finished",
    "fairshare_worker_tenant_waiting_requests": "waiting",
    "fairshare_worker_tenant_running_requests": "running",
}


def getload_reader(addr: str):
    """() -> (policy, {tenant: counters}) from a worker's GetLoad."""
    import grpc

    from fairshare.v1 import worker_pb2, worker_pb2_grpc

    channel = grpc.insecure_channel(addr)
    stub = worker_pb2_grpc.WorkerStub(channel)

    def read():
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        return load.policy, {t.tenant_id: {"charged_service": t.charged_service, "prompt_tokens": t.prompt_tokens,
                                           "output_tokens": t.output_tokens, "finished": t.finished,
                                           "waiting": t.waiting, "running": t.running,
                                           "virtual_counter": t.virtual_counter} for t in load.tenants}

    read.close = channel.close  # type: ignore[attr-defined]
    return read


def metrics_reader(url: str):
    """() -> (policy, {tenant: counters}) from a worker's Prometheus endpoint (`--metrics-port`)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    client = httpx.Client(timeout=5)

    def read():
        text = client.get(url).raise_for_status().text
        policy, out = "", {}
        for fam in text_string_to_metric_families(text):
            if fam.name == "fairshare_worker_policy_info":
                for s in fam.samples:
                    policy = s.labels.get("policy", policy)
            key = _PROM_FIELDS.get(fam.name)
            if key is None:
                continue
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                out.setdefault(s.labels.get("tenant", "?"), {})[key] = s.value
        return policy, out

    read.close = client.close  # type: ignore[attr-defined]
    return read


class Sampler:
    """Samples every reader every `interval_s` in a thread; counters are summed over workers."""

    def __init__(self, readers: list, interval_s: float = SAMPLE_INTERVAL_S):
        self.readers, self.interval_s = readers, interval_s
        self.samples: list[dict] = []  # {"wall": unix time, "tenants": {...}}
        self.policy = ""
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Sampler":
        if self.readers:
            self._thread.start()
        return self

    def sample(self) -> None:
        total: dict[str, dict[str, float]] = {}
        for read in self.readers:
            policy, tenants = read()
            self.policy = policy or self.policy
            for t, vals in tenants.items():
                acc = total.setdefault(t, {})
                for k, v in vals.items():
                    acc[k] = acc.get(k, 0.0) + float(v)
        self.samples.append({"wall": time.time(), "tenants": total})

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.sample()
            except Exception:  # a missed sample is not fatal; count it
                self.errors += 1
            self._stop.wait(max(self.interval_s - (time.monotonic() - t), 0.05))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for read in self.readers:
            close = getattr(read, "close", None)
            if close:
                close()


# ------------------------------------------------------------------------------------------------
# One policy
# ------------------------------------------------------------------------------------------------

def run_locust(campaign, url: str, keys: dict[str, str], model: str | None, duration_s: float, seed: int,
               rate_scale: float, out: Path, length_scale: float = 1.0) -> dict:
    """Run Locust headless for `duration_s`; return the records JSON it wrote."""
    out.mkdir(parents=True, exist_ok=True)
    records = out / "records.json"
    cfg = {"campaign": campaign.name, "duration_s": duration_s, "seed": seed, "rate_scale": rate_scale,
           "length_scale": length_scale, "host": url, "model": model, "keys": keys, "records": str(records)}
    cfg_path = out / "locust_config.json"  # holds the API keys: created 0600, removed when Locust is done
    cfg_path.unlink(missing_ok=True)
    with os.fdopen(os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(cfg, f)
    users = campaign.total_users()
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
           "-u", str(users), "-r", str(users), "-t", f"{int(round(duration_s))}s", "--stop-timeout", "0",
           "--csv", str(out / "locust"), "--only-summary", "--exit-code-on-error", "0", "--loglevel", "WARNING"]
    env = dict(os.environ, FAIRSHARE_LOADTEST_CONFIG=str(cfg_path), PYTHONUNBUFFERED="1")
    try:
        with open(out / "locust.log", "wb") as logf:
            proc = subprocess.run(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                  env=env, timeout=duration_s + 120)
    except subprocess.TimeoutExpired:
        raise LoadtestError(f"locust did not finish within {duration_s + 120:.0f} s "
                            f"(see {out / 'locust.log'})") from None
    finally:
        cfg_path.unlink(missing_ok=True)
    if proc.returncode != 0 or not records.exists():
        tail = (out / "locust.log").read_text(errors="replace")[-3000:]
        raise LoadtestError(f"locust exited with {proc.returncode} (log {out / 'locust.log'}):\n{tail}")
    return json.loads(records.read_text())


def run_policy(campaign, policy_label: str, url: str, keys: dict[str, str], model: str | None, args, out: Path,
               readers: list, setup: dict):
    from loadtests.reports.loadtest import Run, read_locust_stats

    log(f"{policy_label}: running `{campaign.name}` for {args.duration:g} s against {url} "
        f"({campaign.total_users()} Locust users)")
    sampler = Sampler(readers).start()
    try:
        data = run_locust(campaign, url, keys, model, args.duration, args.seed, args.rate_scale, out,
                          args.length_scale)
    finally:
        sampler.stop()
    t0 = data.get("t0_wall") or (sampler.samples[0]["wall"] if sampler.samples else time.time())
    samples = [{"t": s["wall"] - t0, "tenants": s["tenants"]} for s in sampler.samples]
    before = [i for i, s in enumerate(samples) if s["t"] <= 0]
    if before:  # the last sample before the start is the baseline; earlier ones are noise
        samples = samples[before[-1]:]
    (out / "worker_samples.json").write_text(json.dumps({"policy": sampler.policy, "errors": sampler.errors,
                                                        "samples": samples}))
    run = Run(policy=policy_label, data=data, samples=samples, locust_stats=read_locust_stats(out / "locust_stats.csv"),
              worker_source=setup.get("worker_source", ""), setup=setup)
    done = sum(1 for r in data["records"] if r["outcome"] == "ok")
    log(f"{policy_label}: {len(data['records'])} requests sent, {done} completed")
    if done == 0:
        raise LoadtestError(f"{policy_label}: no request completed (see {out / 'locust.log'} and "
                            f"{out / 'records.json'})")
    return run, sampler.policy


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairshare loadtest",
        description="Run a Locust load-test campaign (per-tenant users, streaming) and write report.md with "
                    "plots. Without --url the platform is started on this machine for each policy.")
    p.add_argument("campaign", help="campaign name, or `list`")
    p.add_argument("--policy", choices=["vtc", "fcfs", "both"], default=None,
                   help="local platform: scheduling policy, or both (FCFS then VTC, side by side); default vtc")
    p.add_argument("--duration", type=float, default=None, help="seconds per policy (default: the campaign's)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same requests)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every tenant's request rate")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every prompt and output length (e.g. 0.25 for GPU-sized campaigns on a CPU)")
    p.add_argument("--out", type=Path, default=None,
                   help="report directory (default <state dir>/loadtest/CAMPAIGN-YYYYmmdd-HHMMSS, e.g. ./var/...)")
    local = p.add_argument_group("local platform (no --url)")
    local.add_argument("--model", default="smollm2", help="smollm2 (default), random-tiny, or a model directory")
    local.add_argument("--max-running", type=int, default=None,
                       help="worker running-batch limit (default: the campaign's)")
    local.add_argument("--state-dir", type=Path, default=None,
                       help="state directory to use (default: a temporary one, removed afterwards); a tenants "
                            "file already in it is kept, and the campaign's keys must then be given with --keys")
    remote = p.add_argument_group("deployed cluster (--url)")
    remote.add_argument("--url", default=None, help="gateway base URL, e.g. https://llm.example.com")
    remote.add_argument("--keys", type=Path, default=None,
                        help="YAML/JSON file {tenant: api key} (else FAIRSHARE_LOADTEST_KEYS / FAIRSHARE_KEY_<TENANT>)")
    remote.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                        help="a worker's gRPC address for GetLoad (repeat for each worker)")
    add_metrics_url_options(remote, gateway=False)
    remote.add_argument("--policy-label", default=None,
                        help="name of the deployed policy in the report (default: read from the workers, "
                             "else `deployed`)")
    remote.add_argument("--model-name", default=None, help="model to request (default: the first of /v1/models)")
    return p


def _list_campaigns() -> int:
    from loadtests.campaigns import CAMPAIGNS

    for c in CAMPAIGNS.values():
        w = c.workload()
        tenants = ", ".join(f"{t.tenant_id} (w={t.weight:g}, {c.tenants[t.tenant_id].users} users)" for t in w.tenants)
        print(f"{c.name:<16} {c.description}\n{'':<16} {c.duration_s:g} s; max-running {c.max_running}; "
              f"tenants: {tenants}")
    return 0


def _resolve_keys(args, tenants: list[str]) -> dict[str, str]:
    from loadtests.client import keys_from_env, load_keys_file

    keys = load_keys_file(args.keys) if args.keys else keys_from_env(tenants)
    missing = [t for t in tenants if not keys.get(t)]
    if missing:
        from loadtests.client import env_name

        raise LoadtestError(f"no API key for tenant(s) {', '.join(missing)}: give --keys FILE ({{tenant: key}}) "
                            f"or set FAIRSHARE_LOADTEST_KEYS / {', '.join(env_name(t) for t in missing)}")
    return {t: keys[t] for t in tenants}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.campaign == "list":
        return _list_campaigns()
    from loadtests.campaigns import get_campaign

    try:
        campaign = get_campaign(args.campaign)
    except KeyError as e:
        print(f"fairshare loadtest: {e.args[0]}", file=sys.stderr)
        return 2
    if args.url and args.policy == "both":
        print("fairshare loadtest: --policy both needs a local platform (a deployed cluster runs one policy); "
              "run the campaign once per deployment instead", file=sys.stderr)
        return 2
    if args.duration is None:
        args.duration = campaign.duration_s
    if args.duration < 5:
        print("fairshare loadtest: --duration must be at least 5 s", file=sys.stderr)
        return 2
    if args.out is None:
        from fairshare.cli.up import default_state_dir

        args.out = default_state_dir() / "loadtest" / f"{campaign.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out: Path = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        if args.url:
            runs = _run_remote(campaign, args, out)
        else:
            runs = _run_local(campaign, args, out)
    except LoadtestError as e:
        print(f"fairshare loadtest: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fairshare loadtest: interrupted", file=sys.stderr)
        return 130

    from loadtests.reports.loadtest import write_report

    summary = write_report(out, runs, campaign, campaign.focus)
    _print_summary(summary)
    log(f"report: {out / 'report.md'}")
    return 0


def _print_summary(summary: dict) -> None:
    for pol, s in summary["runs"].items():
        for t, v in s["tenants"].items():
            p99 = v["ttft_p99_s"]
            share = v["worker_service_share"]
            print(f"  {pol:<5} {t:<12} sent {v['sent']:>4}  ok {v['ok']:>4}  429 {v['rejected_429']:>4}  "
                  f"TTFT p50 {_fmt(v['ttft_p50_s'])}  p99 {_fmt(p99)}  "
                  f"service share {'–' if share is None else f'{share:.1%}'}", flush=True)
    c = summary.get("comparison")
    if c:
        print(f"  {c['tenant']}: p99 TTFT FCFS {_fmt(c['ttft_p99_fcfs_s'])} vs VTC {_fmt(c['ttft_p99_vtc_s'])}",
              flush=True)
        of, ov = c.get("overtaken_mean_fcfs"), c.get("overtaken_mean_vtc")
        if of is not None and ov is not None:
            print(f"  {c['tenant']}: other tenants' first tokens while one waited (mean) FCFS {of:.1f} vs VTC {ov:.1f}",
                  flush=True)


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3f} s"


def _run_local(campaign, args, out: Path) -> list:
    policies = ["fcfs", "vtc"] if args.policy == "both" else [args.policy or "vtc"]
    max_running = args.max_running or campaign.max_running
    tmp = None
    if args.state_dir:
        state = args.state_dir.expanduser().resolve()
    else:
        tmp = tempfile.mkdtemp(prefix="fairshare-loadtest-")
        state = Path(tmp)
    tenants_file = state / "tenants.yaml"
    state.mkdir(parents=True, exist_ok=True)
    preset_keys: dict[str, str] = {}
    if not tenants_file.exists():
        tenants_file.write_text("# written by `fairshare loadtest " + campaign.name + "`\n"
                                + yaml.safe_dump(campaign.tenants_file(args.duration), sort_keys=False))
    elif args.keys or os.environ.get("FAIRSHARE_LOADTEST_KEYS"):
        preset_keys = _resolve_keys(args, campaign.tenant_ids())
    limits = {t["id"]: t.get("limits") for t in campaign.tenants_file(args.duration)["tenants"] if t.get("limits")}
    runs = []
    keys: dict[str, str] = dict(preset_keys)
    try:
        for policy in policies:
            pdir = out / policy
            pdir.mkdir(parents=True, exist_ok=True)
            log(f"{policy}: starting the platform (model {args.model}, --max-running {max_running}, "
                f"state {state})")
            t_start = time.monotonic()
            plat = _start_platform(state, policy, args.model, max_running, pdir / "up.log",
                                   forget_keys=tmp is not None and not keys)
            try:
                keys.update(plat.keys)
                missing = [tid for tid in campaign.tenant_ids() if tid not in keys]
                if missing:
                    raise LoadtestError(f"no API key for {', '.join(missing)}: the state dir's tenants already had "
                                        "keys; pass them with --keys FILE")
                log(f"{policy}: platform up in {time.monotonic() - t_start:.0f} s at {plat.url}")
                setup = {"target": f"local `fairshare up` ({plat.url}), policy {policy}", "policy": policy,
                         "max_running": max_running, "model_arg": args.model, "limits": limits,
                         "worker_source": f"GetLoad {plat.worker_addr} (sampled every {SAMPLE_INTERVAL_S:g} s)"}
                run, _ = run_policy(campaign, policy, plat.url, {tid: keys[tid] for tid in campaign.tenant_ids()},
                                    plat.model or None, args, pdir, [getload_reader(plat.worker_addr)], setup)
                runs.append(run)
            finally:
                rc = plat.stop()
                if rc not in (0, None):
                    log(f"{policy}: `fairshare up` exited {rc} on Ctrl-C (log {pdir / 'up.log'})")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return runs


def _start_platform(state: Path, policy: str, model: str, max_running: int, log_path: Path,
                    forget_keys: bool) -> UpProcess:
    """Start `fairshare up`; once more on other ports if it fails (a free port may be taken by another
    process before the platform binds it, on a shared machine). `forget_keys`: the state dir is ours
    and no key was read yet, so key digests a failed start created can be dropped (they are re-created
    and printed by the next start). Raises LoadtestError when the second start fails too."""
    extra = ["--max-running", str(max_running)] if max_running else []
    for attempt in (1, 2):
        plat = UpProcess(state, *extra, model=model, policy=policy, log_path=log_path)
        try:
            return plat.start(UP_READY_TIMEOUT_S)
        except UpNotReady as e:
            if attempt == 2:
                raise LoadtestError(str(e)) from None
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            log(f"{policy}: `fairshare up` failed ({lines[-1] if lines else e}); trying once more on other ports")
            if forget_keys:
                (state / "tenants.keys.yaml").unlink(missing_ok=True)
    raise AssertionError("unreachable")


def _run_remote(campaign, args, out: Path) -> list:
    keys = _resolve_keys(args, campaign.tenant_ids())
    readers = [getload_reader(a) for a in args.worker] + [metrics_reader(u) for u in args.worker_metrics]
    label = args.policy_label or args.policy
    if not label and readers:
        try:
            probe = Sampler(readers)
            probe.sample()
            label = probe.policy or None
        except Exception as e:  # noqa: BLE001
            where = ", ".join(args.worker + args.worker_metrics)
            raise LoadtestError(f"cannot read the workers' load ({where}): {e}") from None
    label = label or "deployed"
    src = ", ".join([f"GetLoad {a}" for a in args.worker] + [f"metrics {u}" for u in args.worker_metrics])
    setup = {"target": f"deployed gateway {args.url}", "policy": label, "max_running": "as deployed",
             "worker_source": (src + f" (sampled every {SAMPLE_INTERVAL_S:g} s, summed)") if src else ""}
    pdir = out / label
    run, _ = run_policy(campaign, label, args.url.rstrip("/"), keys, args.model_name, args, pdir, readers, setup)
    return [run]


if __name__ == "__main__":
    sys.exit(main())
