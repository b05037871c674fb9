"""Compare the gateway's CPU per request (and, with wrk, its p50 latency) between two checkouts,
paired round by round.

    .venv/bin/python scripts/gateway_cpu_pair.py BASE_DIR OTHER_DIR [--rounds 20] [--requests 600]
                                                 [--concurrency 32] [--modes non-stream,stream]
                                                 [--client auto|wrk|httpx] [--wrk-seconds 3]

On a shared, busy machine one `fairshare bench gateway` run moves by a fifth from one run to the
next, more than most changes to the gateway. Here one echo worker (the bench's) and one Redis serve
two gateways at once, ``fairshare gateway`` started from each checkout, both pinned to the first CPU
(the load generator, the echo worker and Redis on the others, as the bench places them). Rounds of
`--requests` chat completions at `--concurrency` (with wrk, the default where it is installed:
`--wrk-seconds` of load, which keeps the gateway at its full CPU) alternate between the two (ABBA order), each
gateway's CPU time (``/proc``, all its threads) is read around its own round, and the ratio
OTHER / BASE is taken round by round: both sides of a pair see the same load on the machine.

Prints, per mode, each side's CPU ms per request (min, median, max over the rounds) and the paired
ratio (min, median, max); with wrk also each side's p50 latency and the paired difference OTHER -
BASE in ms (``--concurrency 1`` for the latency a lone client sees). Each round opens fresh client connections before it is counted (uvicorn
closes keep-alive connections idle for 5 s, as they are while the other gateway's round runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from fairshare import worker_auth
from fairshare.local_redis import start_redis
from fairshare.ports import free_port
from gateway.auth import create_key
from loadtests.bench.gateway import (ECHO_MODEL, EchoServer, _run_load, chat_completion, process_cpu_s,
                                     stop_processes, wait_gateway_ready)
from loadtests.bench.wrk import answer_marker, run_wrk, wrk_path

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello how are you today"}]


def start_gateway(tree: Path, env: dict, tmp: Path, tenants: Path, worker: str, redis_url: str,
                  cpus: set[int] | None) -> tuple[int, subprocess.Popen]:
    """``fairshare gateway`` from checkout `tree` (its own code first on the path); (port, process)
    once it answers ``/readyz``. Raises RuntimeError when it does not within a minute."""
    port = free_port()
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    proc = subprocess.Popen([sys.executable, "-m", "fairshare.cli", "gateway", "--host", "127.0.0.1", "--port",
                             str(port), "--tenants", str(tenants), "--workers", worker, "--redis-url", redis_url,
                             "--log-level", "warning"], cwd=tree, env=dict(env, PYTHONPATH=str(tree)),
                            stdout=subprocess.DEVNULL, stderr=open(tmp / f"gateway-{port}.log", "wb"), preexec_fn=pin)
    try:
        wait_gateway_ready(port, proc)
    except (RuntimeError, TimeoutError):
        proc.kill()
        raise RuntimeError(f"the gateway from {tree} never became ready (log: {tmp}/gateway-{port}.log)") from None
    return port, proc


async def measure(ports: list[tuple[int, subprocess.Popen]], key: str, args, stream: bool) -> list[list[float]]:
    """CPU ms per request of each gateway, one figure per round."""
    body = {"model": ECHO_MODEL, "messages": MESSAGES, "max_tokens": 16, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}

    def client(port: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=2 * args.concurrency, max_keepalive_connections=2 * args.concurrency)
        return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {key}"},
                                 limits=limits, timeout=60)

    def caller(c: httpx.AsyncClient):
        return lambda: chat_completion(c, body, 16)

    if args.client == "wrk":
        return await _measure_wrk(ports, key, args, body, answer_marker(stream, 16))
    cpu: list[list[float]] = [[] for _ in ports]
    for port, _ in ports:  # warm-up
        async with client(port) as c:
            await _run_load(caller(c), 300, args.concurrency)
    for r in range(args.rounds):
        order = list(range(len(ports))) if r % 2 == 0 else list(reversed(range(len(ports))))
        for i in order:
            port, proc = ports[i]
            async with client(port) as c:
                await _run_load(caller(c), 2 * args.concurrency, args.concurrency)  # connections open, uncounted
                c0 = process_cpu_s(proc.pid)
                await _run_load(caller(c), args.requests, args.concurrency)
                cpu[i].append((process_cpu_s(proc.pid) - c0) * 1000 / args.requests)
    return cpu


async def _measure_wrk(ports, key: str, args, body: dict, marker: str) -> list[list[float]]:
    """`measure` with wrk as the client: each round is a wrk run of ``--wrk-seconds`` per gateway
    (every answer checked for `marker`), its CPU time divided by the requests wrk counted. Each
    round's wrk p50 (ms) goes to ``args.p50`` (one list per gateway)."""
    cpu: list[list[float]] = [[] for _ in ports]
    args.p50 = [[] for _ in ports]
    for port, _ in ports:  # warm-up
        await asyncio.to_thread(run_wrk, f"http://127.0.0.1:{port}/v1/chat/completions", body, key, marker,
                                args.concurrency, 1)
    for r in range(args.rounds):
        order = list(range(len(ports))) if r % 2 == 0 else list(reversed(range(len(ports))))
        for i in order:
            port, proc = ports[i]
            c0 = process_cpu_s(proc.pid)
            res = await asyncio.to_thread(run_wrk, f"http://127.0.0.1:{port}/v1/chat/completions", body, key,
                                          marker, args.concurrency, args.wrk_seconds)
            cpu[i].append((process_cpu_s(proc.pid) - c0) * 1000 / max(1, res.requests))
            args.p50[i].append(res.p50_s * 1000)
    return cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", type=Path, help="checkout the ratio divides by")
    p.add_argument("other", type=Path, help="checkout compared with it")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--requests", type=int, default=600, help="requests per gateway per round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--modes", default="non-stream,stream")
    p.add_argument("--client", choices=("auto", "wrk", "httpx"), default="auto",
                   help="load generator: wrk (saturates the gateway; loadtests/bench/wrk.py), httpx, "
                        "auto: wrk when it is on PATH")
    p.add_argument("--wrk-seconds", type=float, default=3.0, help="with wrk: seconds per gateway per round")
    args = p.parse_args()
    if args.client == "auto":
        args.client = "wrk" if wrk_path() else "httpx"
    trees = [args.base.resolve(), args.other.resolve()]
    cpus = sorted(os.sched_getaffinity(0))
    gw_cpus, load_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (None, None)
    if load_cpus:
        os.sched_setaffinity(0, load_cpus)  # before the echo worker's threads and Redis start
    echo = EchoServer().start()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="gateway-cpu-pair-") as tmp_name:
        tmp = Path(tmp_name)
        rport = free_port()
        procs.append(start_redis(rport, tmp / "redis"))
        tenants = tmp / "tenants.yaml"
        tenants.write_text(json.dumps({"tenants": [{"id": "bench", "limits": {"rpm": 10**8, "tpm": 10**10}}]}))
        key, _ = create_key(b"pair-secret", "bench", tmp / "tenants.keys.yaml")
        env = dict(os.environ, FAIRSHARE_SECRET="pair-secret", FAIRSHARE_HEALTH_TIMEOUT_S="10")
        env[worker_auth.KEYS_ENV] = worker_auth.new_key_text("pair").strip()
        try:
            ports = []
            for tree in trees:
                ports.append(start_gateway(tree, env, tmp, tenants, echo.addr, f"redis://127.0.0.1:{rport}/0", gw_cpus))
                procs.append(ports[-1][1])
            for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
                cpu = asyncio.run(measure(ports, key, args, mode == "stream"))
                size = f"{args.wrk_seconds:g} s of wrk" if args.client == "wrk" else f"{args.requests} requests"
                print(f"{mode}: CPU ms per request ({args.rounds} rounds of {size} at c={args.concurrency})")
                for tree, v in zip(trees, cpu):
                    print(f"  {str(tree):40} min {min(v):.3f}  median {statistics.median(v):.3f}  max {max(v):.3f}")
                ratios = [o / b for b, o in zip(cpu[0], cpu[1])]
                print(f"  other / base, paired by round: min {min(ratios):.3f}  median {statistics.median(ratios):.3f}"
                      f"  max {max(ratios):.3f}")
                if args.client == "wrk":
                    print(f"p50 latency ms at c={args.concurrency}")
                    for tree, v in zip(trees, args.p50):
                        print(f"  {str(tree):40} min {min(v):.3f}  median {statistics.median(v):.3f}  max {max(v):.3f}")
                    diffs = [o - b for b, o in zip(*args.p50)]
                    print(f"  other - base, paired by round: min {min(diffs):+.3f}  median "
                          f"{statistics.median(diffs):+.3f}  max {max(diffs):+.3f}")
        finally:
            stop_processes(procs, echo, wait_s=15.0)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
