"""`fairshare bench gateway`: the gateway's overhead against an echo worker, in one run.

    fairshare bench gateway [--modes non-stream,stream] [--requests 2000] [--concurrency 32]
                            [--latency-requests 300] [--max-tokens 16] [--tokens-per-message 0]
                            [--client auto|wrk|httpx] [--wrk-seconds 10]
                            [--gateway-cpu 0] [--load-cpus 1] [--redis-url URL] [--tokenizer DIR] [--json]

An echo worker (a test double implementing the gRPC contract in this process, with a small
word-level tokenizer and a ChatML template, or ``--tokenizer DIR``: a model's own tokenizer.json and
chat template, e.g. SmolLM2's, so that the gateway tokenizes as it does in production) answers every request with ``--max-tokens`` tokens, all
ready at once: like a worker that coalesces the tokens it has (worker/server.py) it sends them in one
message (``--tokens-per-message 1``: one message per token, as workers did before they coalesced).
Both paths are measured against it, for each mode (non-streamed and streamed chat completions):

- **direct**: the same ``Generate`` calls (prompt token ids the gateway would send) over gRPC;
- **gateway**: ``POST /v1/chat/completions`` through ``fairshare gateway`` (a separate process, with
  auth, validation, chat template, tokenizing, one Redis admission call, routing, settlement).

Figures: latency (p50/p99/mean, ms) at concurrency 1 with the two paths alternating request by
request, and the gateway's *added* latency (gateway minus direct at the same percentile);
throughput (requests/s) at ``--concurrency`` in alternating halves; and the gateway's **CPU ms per
request**: the CPU time (user + system, all its threads, from ``/proc``) the gateway process spent
during its throughput runs divided by their requests. CPU ms per request does not depend on how
fast the load generator is; requests/s does (the gateway's CPU share is printed beside it: at
~100 % the gateway is the bottleneck).

The gateway path's client (``--client``): wrk where it is on PATH (the default, ``auto``;
loadtests/bench/wrk.py checks every answer), which costs next to nothing itself, so the gateway
saturates its CPU at ``--concurrency``; or httpx, whose own CPU time per request is about the
gateway's: its latencies include it and its requests/s can be the client's limit (the gateway then
runs below a full CPU, and its CPU per request includes the wake-ups of a half-idle process). With
wrk each figure is ``--wrk-seconds`` of load in two halves alternating with the direct path; the
percentiles printed are the request-weighted means of the two halves' percentiles.

Placement (Linux): the gateway runs pinned to ``--gateway-cpu``; this process (load generator and
echo worker) and Redis to ``--load-cpus`` (default: every other CPU), as ``taskset`` would. On a
one-CPU machine nothing is pinned. On a busy machine, rerun: latencies and requests/s are
wall-clock.
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
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fairshare import worker_auth
from fairshare.local_redis import start_redis
from fairshare.ports import free_port, wait_for_port
from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from worker import grpc_server
from worker.multiplex import GenerateManyMixin
from worker.scheduling.metrics import percentile

from .wrk import answer_marker, run_wrk, wrk_path

ECHO_MODEL = "echo"
WORDS = ["hello", "world", "the", "a", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "how", "are",
         "you", "today", "please", "count", "to", "ten", "be", "brief", "system", "user", "assistant"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def echo_tokenizer_json() -> str:
    """A small word-level tokenizer (tokenizers JSON) with ChatML special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for w in WORDS + [f"w{i}" for i in range(200)]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return tok.to_str()


class EchoWorker(GenerateManyMixin, pb_grpc.WorkerServicer):
    """Implements the Worker contract without a model: answers `max_tokens` tokens at once.

    tokens_per_message: how many tokens each `GenerateResponse` carries (<= 0: all of them in one
    message, as a worker sends the tokens it has ready together).
    """

    def __init__(self, tokens_per_message: int = 0, files=None) -> None:
        from gateway.tokenization import TokenizerFiles

        self.tokens_per_message = tokens_per_message
        files = files or TokenizerFiles(echo_tokenizer_json(), CHATML, "", "<|im_end|>")
        self.tokenizer_json = files.tokenizer_json
        self.info = pb.ModelInfo(model_name=ECHO_MODEL, max_context_tokens=4096, tokenizer_json=files.tokenizer_json,
                                 chat_template=files.chat_template, eos_token_ids=[2], bos_token=files.bos_token,
                                 eos_token=files.eos_token, tokenizer_sha256=files.sha256, generate_many=True)

    async def Generate(self, request, context):
        n = request.sampling.max_tokens or 16
        prompt = list(request.prompt_token_ids) or [3]
        step = n if self.tokens_per_message <= 0 else self.tokens_per_message
        for start in range(0, n, step):
            k = min(step, n - start)
            msg = pb.GenerateResponse(token_ids=[prompt[(start + i) % len(prompt)] for i in range(k)],
                                      text_delta=" w" * k)
            if start + k == n:
                msg.finish_reason = pb.FINISH_REASON_LENGTH
                msg.usage.prompt_tokens = len(prompt)
                msg.usage.completion_tokens = n
            yield msg

    async def Abort(self, request, context):
        return pb.AbortResponse(found=False)

    async def GetModelInfo(self, request, context):
        return self.info

    async def GetLoad(self, request, context):
        return pb.Load(policy="echo")


class EchoServer:
    """The echo worker on a grpc.aio server in a background thread (own event loop)."""

    def __init__(self, tokens_per_message: int = 0, files=None) -> None:
        self.tokens_per_message = tokens_per_message
        self.files = files  # gateway.tokenization.TokenizerFiles, or None: the word-level echo tokenizer
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="echo-worker")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self.server = grpc_server.new_server()  # (the workers' options: the gateway's pings are welcome)
        pb_grpc.add_WorkerServicer_to_server(EchoWorker(self.tokens_per_message, self.files), self.server)
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self.server)
        self.server.add_insecure_port(self.addr)
        await self.server.start()
        for svc in ("", "fairshare.v1.Worker"):
            await hs.set(svc, health_pb2.HealthCheckResponse.SERVING)
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await self.server.stop(0)

    def start(self) -> "EchoServer":
        self._thread.start()
        self._ready.wait(30)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run_load(call, n: int, concurrency: int) -> tuple[list[float], float]:
    """Run `call()` n times with `concurrency` in flight; returns (latencies s, wall s)."""
    lat: list[float] = []
    todo = iter(range(n))

    async def lane():
        for _ in todo:
            t = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return lat, time.perf_counter() - t0


async def chat_completion(client, body: dict, max_tokens: int) -> None:
    """One ``POST /v1/chat/completions`` of `body` through `client` (an ``httpx.AsyncClient`` on the
    gateway): a stream is read to ``data: [DONE]``; a JSON body must count `max_tokens` completion
    tokens. Raises RuntimeError for an answer other than 200, AssertionError for a short one."""
    if body.get("stream"):
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"gateway answered {r.status_code}: {await r.aread()!r}")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    break
    else:
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {r.text}")
        assert r.json()["usage"]["completion_tokens"] == max_tokens


def wait_gateway_ready(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Wait until the gateway `proc` listens on `port` and answers ``/readyz`` with 200. Raises
    TimeoutError when nothing listens within `timeout_s` seconds, RuntimeError when `proc` exits
    first or ``/readyz`` does not answer 200 within `timeout_s` seconds more."""
    import urllib.request

    wait_for_port("127.0.0.1", port, timeout_s, proc)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("gateway not ready")
        time.sleep(0.1)


async def _bench_mode(args, stream: bool, gateway_url: str, key: str, worker_addr: str, gateway_pid: int) -> dict:
    """Latency at concurrency 1 and throughput at `args.concurrency` of both paths in one mode."""
    import httpx

    from gateway.tokenization import ChatTokenizer, TokenizerFiles

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello how are you today"}]
    tok = ChatTokenizer(_tokenizer_files(args) or TokenizerFiles(echo_tokenizer_json(), CHATML))
    prompt_ids = tok.encode_chat(messages)
    body = {"model": ECHO_MODEL, "messages": messages, "max_tokens": args.max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {key}"}

    channel = grpc.aio.insecure_channel(worker_addr)
    stub = pb_grpc.WorkerStub(channel)
    seq = iter(range(10**9))

    async def direct():
        req = pb.GenerateRequest(request_id=f"d{next(seq)}", prompt_token_ids=prompt_ids,
                                 tenant=pb.Tenant(id="bench", weight=1.0, tier=pb.TIER_INTERACTIVE),
                                 sampling=pb.SamplingParams(max_tokens=args.max_tokens))
        async for msg in stub.Generate(req):
            if msg.finish_reason:
                break

    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, limits=limits, timeout=60) as client:
        async def via_gateway():
            await chat_completion(client, body, args.max_tokens)

        # warm up both paths
        await _run_load(direct, 50, 4)
        await _run_load(via_gateway, 50, 4)
        if args.client == "wrk":
            out = await _wrk_figures(args, direct, f"{gateway_url}/v1/chat/completions", body, key,
                                     answer_marker(stream, args.max_tokens), gateway_pid)
            await channel.close()
            return out
        paths = {"direct": direct, "gateway": via_gateway}
        # latency: the two paths alternate request by request, so both see the same background noise
        lat1: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.latency_requests):
            for name, fn in paths.items():
                t = time.perf_counter()
                await fn()
                lat1[name].append(time.perf_counter() - t)
        # throughput: alternating halves per path, summed; the gateway's CPU time over its halves
        latc: dict[str, list[float]] = {name: [] for name in paths}
        wall: dict[str, float] = {name: 0.0 for name in paths}
        cpu_s = 0.0
        for part in (args.requests // 2, args.requests - args.requests // 2):
            for name, fn in paths.items():
                c0 = process_cpu_s(gateway_pid)
                lats, w = await _run_load(fn, part, args.concurrency)
                if name == "gateway":
                    cpu_s += process_cpu_s(gateway_pid) - c0
                latc[name] += lats
                wall[name] += w
        out = {name: _figures(lat1[name], latc[name], args.requests / wall[name]) for name in paths}
        out["gateway"]["cpu_ms_per_request"] = cpu_s * 1000 / args.requests
        out["gateway"]["cpu_share"] = cpu_s / wall["gateway"]
    await channel.close()
    return out


def _figures(lat1: list[float], loaded: list[float], rps: float) -> dict:
    """One path's figures (ms) from its latencies (s) at concurrency 1 and under load."""
    return {"p50_ms": percentile(lat1, 50) * 1000, "p99_ms": percentile(lat1, 99) * 1000,
            "mean_ms": statistics.fmean(lat1) * 1000, "rps": rps,
            "p50_ms_loaded": percentile(loaded, 50) * 1000, "p99_ms_loaded": percentile(loaded, 99) * 1000}


async def _wrk_figures(args, direct, url: str, body: dict, key: str, marker: str, gateway_pid: int) -> dict:
    """The figures of `_bench_mode` with wrk as the gateway path's client (loadtests/bench/wrk.py):
    the two paths alternate in halves (direct: `direct()` calls, as with httpx; gateway: a wrk run of
    ``--wrk-seconds / 2``), at concurrency 1 and then at ``--concurrency``; the gateway's CPU time
    is taken over its wrk runs at ``--concurrency``."""
    half_s = args.wrk_seconds / 2
    lat1: list[float] = []
    lat_gw1: list = []
    for part in (args.latency_requests // 2, args.latency_requests - args.latency_requests // 2):
        for _ in range(part):
            t = time.perf_counter()
            await direct()
            lat1.append(time.perf_counter() - t)
        lat_gw1.append(await asyncio.to_thread(run_wrk, url, body, key, marker, 1, half_s))
    latc: list[float] = []
    wall_direct = 0.0
    runs = []
    cpu_s = 0.0
    for part in (args.requests // 2, args.requests - args.requests // 2):
        lats, w = await _run_load(direct, part, args.concurrency)
        latc += lats
        wall_direct += w
        c0 = process_cpu_s(gateway_pid)
        runs.append(await asyncio.to_thread(run_wrk, url, body, key, marker, args.concurrency, half_s))
        cpu_s += process_cpu_s(gateway_pid) - c0
    n_gw = sum(r.requests for r in runs)
    wall_gw = sum(r.wall_s for r in runs)

    def _avg(results, attr: str) -> float:  # request-weighted mean of the halves' figures (s -> ms)
        return sum(getattr(r, attr) * r.requests for r in results) / max(1, sum(r.requests for r in results)) * 1000

    return {"direct": _figures(lat1, latc, args.requests / wall_direct),
            "gateway": {"p50_ms": _avg(lat_gw1, "p50_s"), "p99_ms": _avg(lat_gw1, "p99_s"),
                        "mean_ms": _avg(lat_gw1, "mean_s"), "rps": n_gw / wall_gw,
                        "p50_ms_loaded": _avg(runs, "p50_s"), "p99_ms_loaded": _avg(runs, "p99_s"),
                        "cpu_ms_per_request": cpu_s * 1000 / max(1, n_gw), "cpu_share": cpu_s / wall_gw,
                        "requests": n_gw, "latency_requests": sum(r.requests for r in lat_gw1)}}


def _tokenizer_files(args):
    """The model tokenizer of ``--tokenizer DIR`` (gateway.tokenization.TokenizerFiles), or None."""
    if not args.tokenizer:
        return None
    from gateway.tokenization import load_tokenizer_dir

    return load_tokenizer_dir(args.tokenizer)


def _placement(args) -> tuple[set[int] | None, set[int] | None]:
    """(gateway CPUs, load-generator CPUs), or (None, None) where nothing is pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if args.gateway_cpu is None and len(cpus) < 2:
        return None, None
    gw = {cpus[0] if args.gateway_cpu is None else args.gateway_cpu}
    load = {int(c) for c in args.load_cpus.split(",")} if args.load_cpus else set(cpus) - gw
    return gw, (load or None)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures; returns the exit code."""
    p = argparse.ArgumentParser(prog="fairshare bench gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="non-stream,stream",
                   help="comma-separated: non-stream, stream (SSE)")
    p.add_argument("--stream", action="store_true", help="only the streamed mode (same as --modes stream)")
    p.add_argument("--requests", type=int, default=2000, help="requests per path at --concurrency")
    p.add_argument("--latency-requests", type=int, default=300, help="requests per path at concurrency 1")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens the echo worker answers per request")
    p.add_argument("--tokens-per-message", type=int, default=0,
                   help="tokens per worker message (0: all in one, as a coalescing worker sends ready tokens)")
    p.add_argument("--gateway-cpu", type=int, default=None,
                   help="CPU the gateway is pinned to (default: the first one, when there are two or more)")
    p.add_argument("--load-cpus", default=None,
                   help="comma-separated CPUs for the load generator, echo worker and Redis (default: the others)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a model directory whose tokenizer.json and chat template the echo worker serves "
                        "(default: a small word-level tokenizer)")
    p.add_argument("--client", choices=("auto", "wrk", "httpx"), default="auto",
                   help="the gateway path's HTTP client: wrk (C, negligible cost of its own; loadtests/bench/wrk.py), "
                        "httpx (Python: its own CPU time adds to the latencies and can cap the requests/s), "
                        "auto: wrk when it is on PATH")
    p.add_argument("--wrk-seconds", type=float, default=10.0,
                   help="with wrk: seconds of gateway load per figure (concurrency 1, --concurrency), in two halves")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = p.parse_args(argv)
    modes = ["stream"] if args.stream else [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("non-stream", "stream") for m in modes):
        p.error("--modes takes non-stream and/or stream")

    if args.client == "wrk" and wrk_path() is None:
        p.error("--client wrk: wrk is not on PATH (Debian: apt-get install wrk)")
    if args.client == "auto":
        args.client = "wrk" if wrk_path() else "httpx"
        if args.client == "httpx":
            print("fairshare bench gateway: wrk is not on PATH (Debian: apt-get install wrk); the gateway path's "
                  "client is httpx, whose own CPU time adds to its latencies and can cap its requests/s",
                  file=sys.stderr)
    gw_cpus, load_cpus = _placement(args)
    own_cpus = os.sched_getaffinity(0) if load_cpus is not None else None
    if load_cpus is not None:  # before the echo worker's threads start: threads and children inherit it
        os.sched_setaffinity(0, load_cpus)
    try:
        results = _run(args, modes, gw_cpus)
    finally:
        if own_cpus is not None:
            os.sched_setaffinity(0, own_cpus)
    if results is None:
        return 1
    _report(args, results, gw_cpus, load_cpus)
    return 0


def _run(args, modes: list[str], gw_cpus: set[int] | None) -> dict[str, dict] | None:
    """Start Redis, the echo worker and the gateway, run every mode; None (after printing why) on failure."""
    from gateway.auth import create_key

    echo = EchoServer(args.tokens_per_message, _tokenizer_files(args)).start()
    procs: list[subprocess.Popen] = []
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fairshare-bench-") as tmp:
        tmp_path = Path(tmp)
        redis_url = args.redis_url
        if redis_url is None:
            rport = free_port()
            procs.append(start_redis(rport, tmp_path / "redis"))
            redis_url = f"redis://127.0.0.1:{rport}/0"
        secret = "bench-secret"
        tenants = tmp_path / "tenants.yaml"
        tenants.write_text(json.dumps({"tenants": [{"id": "bench", "limits": {"rpm": 10**8, "tpm": 10**10}}]}))
        key, _ = create_key(secret.encode(), "bench", tmp_path / "tenants.keys.yaml")
        gport = free_port()
        # the echo worker shares its CPU with the load generator: a late health answer is load, not an outage
        env = dict(os.environ, FAIRSHARE_SECRET=secret, FAIRSHARE_HEALTH_TIMEOUT_S="10")
        if not (env.get(worker_auth.KEYS_ENV) or env.get(worker_auth.KEYS_FILE_ENV)):  # it signs as in production
            env[worker_auth.KEYS_ENV] = worker_auth.new_key_text("bench").strip()
        pin = None if gw_cpus is None else (lambda: os.sched_setaffinity(0, gw_cpus))
        gw = subprocess.Popen([sys.executable, "-m", "fairshare.cli", "gateway", "--host", "127.0.0.1", "--port",
                               str(gport), "--tenants", str(tenants), "--workers", echo.addr, "--redis-url", redis_url,
                               "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "gateway.log", "wb"), preexec_fn=pin)
        procs.append(gw)
        try:
            wait_gateway_ready(gport, gw)
            for mode in modes:
                results[mode] = asyncio.run(_bench_mode(args, mode == "stream", f"http://127.0.0.1:{gport}", key,
                                                        echo.addr, gw.pid))
        except Exception as e:
            print(f"fairshare bench gateway: {type(e).__name__}: {e}", file=sys.stderr)
            log = (tmp_path / "gateway.log").read_text(errors="replace")[-2000:]
            if log:
                print(log, file=sys.stderr)
            return None
        finally:
            stop_processes(procs, echo)
    return results


def stop_processes(procs: list[subprocess.Popen], echo: EchoServer | None = None, wait_s: float = 10.0) -> None:
    """Terminate `procs`, the last started first (each killed if it has not exited after `wait_s`
    seconds), then stop the echo worker `echo`."""
    for pr in reversed(procs):
        pr.terminate()
        try:
            pr.wait(wait_s)
        except subprocess.TimeoutExpired:
            pr.kill()
    if echo is not None:
        echo.stop()


def _report(args, results: dict[str, dict], gw_cpus: set[int] | None, load_cpus: set[int] | None) -> None:
    per_msg = "all in one message" if args.tokens_per_message <= 0 else f"{args.tokens_per_message} per message"
    where = ("unpinned" if gw_cpus is None else
             f"gateway pinned to CPU {','.join(map(str, sorted(gw_cpus)))}; load generator, echo worker and Redis "
             f"on CPU {','.join(map(str, sorted(load_cpus or ())))}")
    client = ("wrk (one thread; its latency histogram)" if args.client == "wrk" else "httpx (Python)")
    print(f"gateway overhead vs direct gRPC to an echo worker ({args.max_tokens} tokens per reply, {per_msg}; "
          f"{os.cpu_count()} CPUs, {where})")
    print(f"  clients: direct: grpc.aio (Python); gateway: {client}")
    for mode, res in results.items():
        d, g = res["direct"], res["gateway"]
        label = "streamed (SSE)" if mode == "stream" else "non-streamed"
        print(f"  {label} chat completions")
        counts = (f"{args.latency_requests} direct, {g['latency_requests']} via the gateway in {args.wrk_seconds:g} s"
                  if "latency_requests" in g else f"{args.latency_requests} requests per path")
        print(f"    latency at concurrency 1 ({counts}):")
        print(f"      {'':8} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
        for name, r in (("direct", d), ("gateway", g)):
            print(f"      {name:8} {r['p50_ms']:9.2f} {r['p99_ms']:9.2f} {r['mean_ms']:9.2f}")
        print(f"      {'added':8} {g['p50_ms'] - d['p50_ms']:9.2f} {g['p99_ms'] - d['p99_ms']:9.2f} "
              f"{g['mean_ms'] - d['mean_ms']:9.2f}")
        counts = (f"{args.requests} direct, {g['requests']} via the gateway in {args.wrk_seconds:g} s"
                  if "requests" in g else f"{args.requests} requests per path")
        print(f"    throughput at concurrency {args.concurrency} ({counts}):")
        print(f"      {'':8} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9}")
        for name, r in (("direct", d), ("gateway", g)):
            print(f"      {name:8} {r['rps']:9.1f} {r['p50_ms_loaded']:9.2f} {r['p99_ms_loaded']:9.2f}")
        print(f"      gateway CPU: {g['cpu_ms_per_request']:.3f} ms per request "
              f"({g['cpu_share'] * 100:.0f} % of one CPU while loaded)")
    if args.json:
        print(json.dumps({"max_tokens": args.max_tokens, "tokens_per_message": args.tokens_per_message,
                          "concurrency": args.concurrency, "gateway_cpus": sorted(gw_cpus or ()),
                          "load_cpus": sorted(load_cpus or ()), "modes": results}))


if __name__ == "__main__":
    sys.exit(main())
