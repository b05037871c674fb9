"""`fairshare bench gateway`: the gateway's overhead against an echo worker, in one run.

    fairshare bench gateway [--requests 400] [--concurrency 8] [--max-tokens 16] [--stream]
                            [--redis-url URL]   (default: start a redis-server on a free port)

An echo worker (a test double implementing the gRPC contract in this process: it streams
``max_tokens`` tokens back at once, with a small word-level tokenizer and a ChatML template) serves
both paths:

- **direct**: the same ``Generate`` calls (prompt token ids the gateway would send) over gRPC;
- **gateway**: ``POST /v1/chat/completions`` through ``fairshare gateway`` (a separate process, with
  auth, validation, chat template, tokenizing, one Redis admission call, routing, settlement).

Latency (p50/p99/mean, ms) is measured at concurrency 1 with the two paths alternating request by
request; throughput (requests/s) at ``--concurrency`` in alternating halves. Added latency is gateway
minus direct at the same percentile. On a busy machine, rerun: the figures are wall-clock.
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
from fairshare.procs import free_port, start_redis, wait_for_port
from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc

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


class EchoWorker(pb_grpc.WorkerServicer):
    """Implements the Worker contract without a model: streams `max_tokens` tokens immediately."""

    def __init__(self) -> None:
        self.tokenizer_json = echo_tokenizer_json()
        import hashlib

        self.info = pb.ModelInfo(model_name=ECHO_MODEL, max_context_tokens=4096, tokenizer_json=self.tokenizer_json,
                                 chat_template=CHATML, eos_token_ids=[2], bos_token="", eos_token="<|im_end|>",
                                 tokenizer_sha256=hashlib.sha256((self.tokenizer_json + CHATML).encode()).hexdigest())

    async def Generate(self, request, context):
        n = request.sampling.max_tokens or 16
        prompt = list(request.prompt_token_ids) or [3]
        for i in range(n):
            tid = prompt[i % len(prompt)]
            msg = pb.GenerateResponse(token_ids=[tid], text_delta=" w")
            if i == n - 1:
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

    def __init__(self) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="echo-worker")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(EchoWorker(), self.server)
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


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


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


async def _bench(args, gateway_url: str, key: str, worker_addr: str) -> dict:
    import httpx

    from .tokenization import ChatTokenizer, TokenizerFiles

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello how are you today"}]
    tok = ChatTokenizer(TokenizerFiles(echo_tokenizer_json(), CHATML))
    prompt_ids = tok.encode_chat(messages)
    body = {"model": ECHO_MODEL, "messages": messages, "max_tokens": args.max_tokens, "stream": bool(args.stream)}
    if args.stream:
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
            if args.stream:
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
                usage = r.json()["usage"]
                assert usage["completion_tokens"] == args.max_tokens

        # warm up both paths
        await _run_load(direct, 20, 2)
        await _run_load(via_gateway, 20, 2)
        paths = {"direct": direct, "gateway": via_gateway}
        # latency: the two paths alternate request by request, so both see the same background noise
        lat1: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.latency_requests):
            for name, fn in paths.items():
                t = time.perf_counter()
                await fn()
                lat1[name].append(time.perf_counter() - t)
        # throughput: alternating halves per path, summed
        latc: dict[str, list[float]] = {name: [] for name in paths}
        wall: dict[str, float] = {name: 0.0 for name in paths}
        for part in (args.requests // 2, args.requests - args.requests // 2):
            for name, fn in paths.items():
                lats, w = await _run_load(fn, part, args.concurrency)
                latc[name] += lats
                wall[name] += w
        out = {}
        for name in paths:
            out[name] = {"p50_ms": _pct(lat1[name], 50) * 1000, "p99_ms": _pct(lat1[name], 99) * 1000,
                         "mean_ms": statistics.fmean(lat1[name]) * 1000, "rps": args.requests / wall[name],
                         "p50_ms_loaded": _pct(latc[name], 50) * 1000, "p99_ms_loaded": _pct(latc[name], 99) * 1000}
    await channel.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures; returns the exit code."""
    p = argparse.ArgumentParser(prog="fairshare bench gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400, help="requests per path at --concurrency")
    p.add_argument("--latency-requests", type=int, default=200, help="requests per path at concurrency 1")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens the echo worker streams back per request")
    p.add_argument("--stream", action="store_true", help="stream (SSE) through the gateway")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = p.parse_args(argv)

    from .auth import create_key

    echo = EchoServer().start()
    procs: list[subprocess.Popen] = []
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
        env = dict(os.environ, FAIRSHARE_SECRET=secret)
        if not (env.get(worker_auth.KEYS_ENV) or env.get(worker_auth.KEYS_FILE_ENV)):  # it signs as in production
            env[worker_auth.KEYS_ENV] = worker_auth.new_key_text("bench").strip()
        gw = subprocess.Popen([sys.executable, "-m", "fairshare.cli", "gateway", "--host", "127.0.0.1", "--port",
                               str(gport), "--tenants", str(tenants), "--workers", echo.addr, "--redis-url", redis_url,
                               "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "gateway.log", "wb"))
        procs.append(gw)
        try:
            wait_for_port("127.0.0.1", gport, 60, gw)
            import urllib.request

            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{gport}/readyz", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("gateway not ready")
                time.sleep(0.1)
            res = asyncio.run(_bench(args, f"http://127.0.0.1:{gport}", key, echo.addr))
        except Exception as e:
            print(f"fairshare bench gateway: {e}", file=sys.stderr)
            log = (tmp_path / "gateway.log").read_text(errors="replace")[-2000:]
            if log:
                print(log, file=sys.stderr)
            return 1
        finally:
            for pr in reversed(procs):
                pr.terminate()
                try:
                    pr.wait(10)
                except subprocess.TimeoutExpired:
                    pr.kill()
            echo.stop()

    d, g = res["direct"], res["gateway"]
    mode = "streamed (SSE)" if args.stream else "non-streamed"
    print(f"gateway overhead vs direct gRPC to an echo worker ({mode} chat completions, {args.max_tokens} tokens "
          f"each; {os.cpu_count()} CPUs)")
    print(f"  latency at concurrency 1 ({args.latency_requests} requests per path):")
    print(f"    {'':8} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
    for name, r in (("direct", d), ("gateway", g)):
        print(f"    {name:8} {r['p50_ms']:9.2f} {r['p99_ms']:9.2f} {r['mean_ms']:9.2f}")
    print(f"    {'added':8} {g['p50_ms'] - d['p50_ms']:9.2f} {g['p99_ms'] - d['p99_ms']:9.2f} "
          f"{g['mean_ms'] - d['mean_ms']:9.2f}")
    print(f"  throughput at concurrency {args.concurrency} ({args.requests} requests per path):")
    print(f"    {'':8} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9}")
    for name, r in (("direct", d), ("gateway", g)):
        print(f"    {name:8} {r['rps']:9.1f} {r['p50_ms_loaded']:9.2f} {r['p99_ms_loaded']:9.2f}")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
