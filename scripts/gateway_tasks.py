"""Count the asyncio tasks the gateway creates per request and the Python function calls its event
loop thread makes per request (cProfile's call counts): figures that do not depend on how busy the
machine is, unlike CPU time. The gateway app runs in this process (uvicorn on a thread), with the echo
worker of `fairshare bench gateway` and a redis-server on a free port.

    .venv/bin/python scripts/gateway_tasks.py [--requests 200] [--max-tokens 16] [--tokens-per-message 0]

Prints, for non-streamed and streamed chat completions, the tasks created per request by the
coroutine they run (uvicorn's own per-request task included), and the gRPC messages per request.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import tempfile
from pathlib import Path

import httpx

from fairshare import worker_auth
from fairshare.local_redis import start_redis
from fairshare.ports import free_port
from gateway.app import create_app
from gateway.auth import create_key
from loadtests.bench.gateway import ECHO_MODEL, EchoServer
from gateway.config import GatewaySettings
from gateway.serve import ServerThread

COUNTS: collections.Counter = collections.Counter()
COUNTING = [False]
PROFILE = cProfile.Profile()


def python_calls() -> int:
    """Function calls the gateway's loop thread has made so far (the profiler runs on that thread)."""
    return sum(e.callcount for e in PROFILE.getstats())


def counting_factory(loop, coro, **kwargs):
    if COUNTING[0]:
        COUNTS[getattr(coro, "__qualname__", type(coro).__name__)] += 1
    return asyncio.Task(coro, loop=loop, **kwargs)


def with_factory(app):
    """The app, setting the counting task factory on the server's loop at its first call."""
    state = {"set": False}

    async def wrapped(scope, receive, send):
        if not state["set"]:
            asyncio.get_running_loop().set_task_factory(counting_factory)
            PROFILE.enable()  # profiles this (the server's) thread from now on
            state["set"] = True
        await app(scope, receive, send)

    return wrapped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tokens-per-message", type=int, default=0)
    p.add_argument("--top", type=int, default=0, help="also list the N callers with the most calls per request")
    args = p.parse_args()
    echo = EchoServer(args.tokens_per_message).start()
    with tempfile.TemporaryDirectory() as tmp:
        rport = free_port()
        redis = start_redis(rport, Path(tmp) / "redis")
        try:
            tf = Path(tmp) / "tenants.yaml"
            tf.write_text(json.dumps({"tenants": [{"id": "t", "limits": {"rpm": 10**8, "tpm": 10**10}}]}))
            key, _ = create_key(b"s" * 32, "t", Path(tmp) / "tenants.keys.yaml")
            settings = GatewaySettings(tenants_file=tf, workers=[echo.addr], secret="s" * 32,
                                       redis_url=f"redis://127.0.0.1:{rport}/0", health_timeout_s=10,
                                       worker_keys=worker_auth.new_key_text("tasks").strip())  # signs as in production
            server = ServerThread(with_factory(create_app(settings))).start()
            try:
                run(server.base_url, key, args)
            finally:
                server.stop()
        finally:
            redis.terminate()
            redis.wait(10)
            echo.stop()
    return 0


def run(base: str, key: str, args) -> None:
    import time

    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=60) as c:
        deadline = time.monotonic() + 60
        while c.get("/readyz").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("gateway not ready")
            time.sleep(0.1)
        msgs = [{"role": "user", "content": "hello how are you today"}]
        per_msg = args.max_tokens if args.tokens_per_message <= 0 else args.tokens_per_message
        print(f"asyncio tasks created per request ({args.requests} requests each, {args.max_tokens} tokens, "
              f"{per_msg} per worker message: {-(-args.max_tokens // per_msg)} gRPC message(s) per request)")
        for stream in (False, True):
            body = {"model": ECHO_MODEL, "messages": msgs, "max_tokens": args.max_tokens, "stream": stream}
            for _ in range(5):  # warm-up (connections, first-use caches)
                c.post("/v1/chat/completions", json=body).raise_for_status()
            COUNTS.clear()
            before = {e.code: e.callcount for e in PROFILE.getstats()}
            calls0 = python_calls()
            COUNTING[0] = True
            for _ in range(args.requests):
                c.post("/v1/chat/completions", json=body).raise_for_status()
            COUNTING[0] = False
            calls = python_calls() - calls0
            total = sum(COUNTS.values())
            print(f"  {'streamed' if stream else 'non-streamed'}: {total / args.requests:.2f} tasks and "
                  f"{calls / args.requests:.0f} Python function calls (loop thread) per request")
            for name, n in COUNTS.most_common():
                print(f"    {n / args.requests:6.2f}  {name}")
            if args.top:
                grown = collections.Counter()
                for e in PROFILE.getstats():
                    name = e.code if isinstance(e.code, str) else f"{e.code.co_qualname} ({Path(e.code.co_filename).name})"
                    grown[name] += e.callcount - before.get(e.code, 0)
                print("    functions with the most calls per request:")
                for name, n in grown.most_common(args.top):
                    print(f"    {n / args.requests:8.1f}  {name}")


if __name__ == "__main__":
    raise SystemExit(main())
