"""`fairshare bench chaos`: mixed load against `fairshare up` while its parts are killed; a report of
what was lost and what leaked. A run, not a test: it prints figures.

::

    fairshare bench chaos [--minutes 10] [--model random-tiny] [--workers 2] [--clients 6]
                          [--kill-every 20:40] [--seed 0]

What it does:

1. Starts `fairshare up --workers 2` (a temporary state dir, free ports, lease TTL 4 s, the
   interactive tier degrading to local buckets while Redis is down, the others failing closed) with
   three tenants on two tiers: ``acme`` (interactive, weight 1), ``globex`` (interactive, weight 3),
   ``nightly`` (background, weight 0.5).
2. For ``--minutes``, ``--clients`` threads send requests as fast as they are answered: by weighted
   random choice of tenant and kind, 40% plain chat completions, 30% streams read to the end, 10%
   streams the client closes after two chunks (cancels), 8% plain requests with an
   ``x-request-timeout`` far shorter than their generation (client deadlines), 6% requests with a
   ``max_tokens`` over the context (oversize: 400), 6% streams of the background tenant with long
   outputs. Meanwhile, every ``--kill-every`` seconds (uniform in the range), one of Redis, a worker
   or the gateway is SIGKILLed at random, once the previous kill has healed (the supervisor printed
   "is back").
3. Then the load stops, everything heals, the lease TTL passes, and it reports:

   - requests by outcome: completed, cancelled by the client, each 4xx by code, declared outage
     answers (503 ``service_unavailable`` with ``retry-after``, 504/408 deadlines, SSE error events of
     those codes, connections refused or cut while the gateway was down) and **undeclared** ones
     (any other 5xx, a non-OpenAI error body, a stream cut without an error event, a connection
     error while the gateway was up), each undeclared one listed;
   - leases left in Redis (live ones: must be 0; expired entries not yet purged, harmless);
   - KV blocks still held on each worker (and requests waiting or running there);
   - bucket drift: each tenant's TPM and RPM buckets are seeded, three requests of known usage are
     sent, and the stored buckets are compared with ``seed + refill - used`` (0 means the accounting
     is exact after the chaos: scripts reloaded, no settlement lost or replayed twice).

Model: random-tiny by default (a seeded random Llama: realistic token counts and engine work, fast
on a CPU); ``--model smollm2`` runs the real model (slower: fewer requests).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TENANTS = [
    {"id": "acme", "weight": 1.0, "tier": "interactive",
     "limits": {"rpm": 6000, "tpm": 400000, "max_concurrent_requests": 16}},
    {"id": "globex", "weight": 3.0, "tier": "interactive",
     "limits": {"rpm": 6000, "tpm": 400000, "max_concurrent_requests": 16}},
    {"id": "nightly", "weight": 0.5, "tier": "background",
     "limits": {"rpm": 6000, "tpm": 400000, "max_concurrent_requests": 8}},
]
KINDS = (("plain", 40), ("stream", 30), ("cancel", 10), ("client_deadline", 8), ("oversize", 6),
         ("long_stream", 6))
LEASE_TTL_S = 4.0
PROMPTS = ["Hello, how are you?", "Write a haiku about the sea.", "What is the capital of France?",
           "Summarize the plot of a novel you like.", "List three prime numbers."]


@dataclass
class Outcomes:
    """Outcome counts and the undeclared ones (with what was seen)."""

    counts: collections.Counter = field(default_factory=collections.Counter)
    undeclared: list[str] = field(default_factory=list)
    per_tenant: dict[str, collections.Counter] = field(default_factory=lambda: collections.defaultdict(
        collections.Counter))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, tenant: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            self.per_tenant[tenant][outcome] += 1
            if outcome.startswith("UNDECLARED"):
                self.undeclared.append(f"{outcome}: {detail}"[:300])


class Downtime:
    """When the gateway was down (killed .. back), to tell a declared connection loss from another."""

    def __init__(self) -> None:
        self.intervals: list[list[float]] = []
        self.lock = threading.Lock()

    def down(self, t: float) -> None:
        with self.lock:
            self.intervals.append([t, float("inf")])

    def up(self, t: float) -> None:
        with self.lock:
            if self.intervals and self.intervals[-1][1] == float("inf"):
                self.intervals[-1][1] = t

    def overlaps(self, start: float, end: float, slack_s: float = 1.0) -> bool:
        with self.lock:
            return any(a - slack_s <= end and start <= b + slack_s for a, b in self.intervals)


def _error_of(resp) -> dict | None:
    try:
        body = resp.json()
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}:
        return err
    return None


def classify_status(resp) -> tuple[str, str]:
    """(outcome, detail) of a non-200 answer."""
    err = _error_of(resp)
    if err is None:
        return "UNDECLARED non-OpenAI error body", f"{resp.status_code} {resp.text[:200]!r}"
    code = err.get("code")
    if resp.status_code == 503 and code == "service_unavailable" and "retry-after" in resp.headers:
        return "503 declared outage (retry-after)", ""
    if (resp.status_code, code) in ((504, "timeout"), (408, "request_timeout")):
        return f"{resp.status_code} {code}", ""
    if resp.status_code >= 500:
        return f"UNDECLARED {resp.status_code}", f"{code} {err.get('message')}"
    return f"{resp.status_code} {code}", ""


def classify_events(lines: list[str]) -> tuple[str, str]:
    """(outcome, detail) of a stream read to its end."""
    datas = [ln[5:].strip() for ln in lines if ln.startswith("data:")]
    if datas and datas[-1] == "[DONE]":
        return "200 completed (stream)", ""
    last = None
    if datas:
        try:
            last = json.loads(datas[-1])
        except ValueError:
            last = None
    err = last.get("error") if isinstance(last, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        if code in ("service_unavailable", "timeout", "request_timeout"):
            return f"stream error event {code}", ""
        return "UNDECLARED stream error event", json.dumps(err)[:200]
    return "stream cut off", f"{len(datas)} data events, no [DONE], no error event"


class Load:
    """The client threads."""

    def __init__(self, base_url: str, keys: dict[str, str], model: str, out: Outcomes, downtime: Downtime,
                 rng: random.Random) -> None:
        self.base_url, self.keys, self.model, self.out, self.downtime = base_url, keys, model, out, downtime
        self.rng = rng
        self.stop = threading.Event()
        self.sent = 0

    def _one(self, http, rng: random.Random) -> None:
        import httpx

        kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
        tenant = "nightly" if kind == "long_stream" else rng.choices(["acme", "globex", "nightly"], [3, 3, 2])[0]
        body = {"model": self.model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": rng.choice([8, 16, 32, 64]), "ignore_eos": True}
        headers = {"authorization": f"Bearer {self.keys[tenant]}"}
        if kind == "oversize":
            body["max_tokens"] = 10**6
        if kind == "client_deadline":
            body["max_tokens"] = 400
            headers["x-request-timeout"] = "0.3"
        if kind == "long_stream":
            body["max_tokens"] = 300
        stream = kind in ("stream", "cancel", "long_stream")
        start = time.monotonic()
        self.sent += 1
        try:
            if not stream:
                r = http.post(self.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
                if r.status_code == 200:
                    ok = bool(r.json().get("choices"))
                    self.out.add(tenant, "200 completed" if ok else "UNDECLARED 200 without choices", r.text[:200])
                else:
                    self.out.add(tenant, *classify_status(r))
                    self._back_off(r)
                return
            req = http.build_request("POST", self.base_url + "/v1/chat/completions", json={**body, "stream": True},
                                     headers=headers, timeout=120)
            r = http.send(req, stream=True)
            try:
                if r.status_code != 200:
                    r.read()
                    self.out.add(tenant, *classify_status(r))
                    self._back_off(r)
                    return
                lines, data = [], 0
                for line in r.iter_lines():
                    lines.append(line)
                    data += line.startswith("data:")
                    if kind == "cancel" and data >= 2:
                        self.out.add(tenant, "cancelled by the client")
                        return
                outcome, detail = classify_events(lines)
                if outcome == "stream cut off":
                    outcome = ("stream cut off (gateway killed)" if self.downtime.overlaps(start, time.monotonic())
                               else "UNDECLARED stream cut off")
                self.out.add(tenant, outcome, detail)
            finally:
                r.close()
        except (httpx.TransportError, OSError) as e:
            end = time.monotonic()
            if self.downtime.overlaps(start, end):
                self.out.add(tenant, "connection refused/cut (gateway killed)")
            else:
                self.out.add(tenant, "UNDECLARED connection error", f"{type(e).__name__}: {e}")
            self.stop.wait(0.5)  # as a client would: back off before trying again

    def _back_off(self, resp) -> None:
        """Honour a retry hint (429, 503) as the official clients do (at most 2 s here)."""
        hint = resp.headers.get("retry-after-ms") or (float(resp.headers["retry-after"]) * 1000
                                                      if "retry-after" in resp.headers else None)
        if hint is not None:
            self.stop.wait(min(2.0, float(hint) / 1000))

    def run(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                self._one(http, rng)


def _kill_loop(up, names: list[str], lo: float, hi: float, until: float, rng: random.Random, downtime: Downtime,
               kills: list[tuple[float, str, float | None]], stop: threading.Event) -> None:
    """Kill one child at random every U(lo, hi) seconds, once the previous kill has healed."""
    while not stop.is_set():
        if stop.wait(rng.uniform(lo, hi)) or time.monotonic() > until:
            return
        name = rng.choice(names)
        before = len(up.lines_matching(f"the {name} is back"))
        pid = up.run_info()["children"][name]
        t = time.monotonic()
        if name == "gateway":
            downtime.down(t)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        print(f"  [{time.strftime('%H:%M:%S')}] killed the {name} (pid {pid})", flush=True)
        try:
            up.wait_for_line(f"the {name} is back", timeout_s=600, what=f"the {name} back", count=before + 1)
            healed = time.monotonic() - t
        except TimeoutError:
            healed = None
        if name == "gateway":
            downtime.up(time.monotonic())
        kills.append((t, name, healed))
        print(f"  [{time.strftime('%H:%M:%S')}] the {name} is back after "
              f"{'%.1f s' % healed if healed is not None else 'NEVER'}", flush=True)


def _leases(redis_url: str) -> tuple[int, int]:
    """(live leases, expired entries not yet purged) over every tenant."""
    import redis

    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    s, us = r.time()
    now = s * 1000 + us / 1000
    live = stale = 0
    for key in r.scan_iter("fairshare:{*}:leases"):
        live += r.zcount(key, f"({now}", "+inf")
        stale += r.zcount(key, "-inf", now)
    return live, stale


def _worker_loads(addrs: list[str]) -> list[tuple[str, int, int, int]]:
    import grpc

    from fairshare.v1 import worker_pb2, worker_pb2_grpc

    out = []
    for a in addrs:
        with grpc.insecure_channel(a) as ch:
            load = worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
        out.append((a, load.kv_blocks_used, load.waiting, load.running))
    return out


def _drift(redis_url: str, base_url: str, keys: dict[str, str], model: str) -> dict[str, tuple[float, float]]:
    """Per tenant (TPM drift, RPM drift) in tokens / requests after seeding the buckets and sending three
    requests of known usage: stored bucket - (seed + refill - used)."""
    import httpx
    import redis

    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    out = {}
    for t in TENANTS:
        tid, lim = t["id"], t["limits"]
        tpm_key, rpm_key = f"fairshare:{{{tid}}}:tpm", f"fairshare:{{{tid}}}:rpm"
        s, us = r.time()
        ts0 = s * 1000 + us / 1000
        seed_t, seed_r = lim["tpm"] / 4, lim["rpm"] / 4
        r.hset(tpm_key, mapping={"t": repr(seed_t), "ts": repr(ts0)})
        r.hset(rpm_key, mapping={"t": repr(seed_r), "ts": repr(ts0)})
        used = 0
        for i in range(3):
            resp = httpx.post(base_url + "/v1/chat/completions", timeout=120,
                              headers={"authorization": f"Bearer {keys[tid]}"},
                              json={"model": model, "messages": [{"role": "user", "content": PROMPTS[i]}],
                                    "max_tokens": 16, "ignore_eos": True})
            resp.raise_for_status()
            u = resp.json()["usage"]
            used += u["prompt_tokens"] + u["completion_tokens"]
        time.sleep(0.5)  # (settlement runs before the answer; this only lets a stray late one land)
        t_tpm, ts_tpm = (float(x) for x in r.hmget(tpm_key, ["t", "ts"]))
        t_rpm, ts_rpm = (float(x) for x in r.hmget(rpm_key, ["t", "ts"]))
        exp_tpm = seed_t + (ts_tpm - ts0) * lim["tpm"] / 60000.0 - used
        exp_rpm = seed_r + (ts_rpm - ts0) * lim["rpm"] / 60000.0 - 3
        out[tid] = (t_tpm - exp_tpm, t_rpm - exp_rpm)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fairshare bench chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load and kills (default 10)")
    p.add_argument("--model", default="random-tiny", help="random-tiny (default) or smollm2")
    p.add_argument("--workers", type=int, default=2, help="workers under `fairshare up` (default 2)")
    p.add_argument("--clients", type=int, default=6, help="client threads (default 6)")
    p.add_argument("--kill-every", default="20:40", help="seconds between kills, LO:HI uniform (default 20:40)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lo, hi = (float(x) for x in args.kill_every.split(":"))
    import yaml

    from loadtests.up_process import UpProcess

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="fairshare-chaos-") as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        (state / "tenants.yaml").write_text(yaml.safe_dump({"tenants": TENANTS}, sort_keys=False))
        up = UpProcess(state, "--restart-window-s", "1", "--lease-ttl-s", str(LEASE_TTL_S),
                       "--redis-outage-policy", "interactive=degrade,batch=fail_closed,background=fail_closed",
                       model=args.model, workers=args.workers, log_path=Path(tmp) / "up.log")
        up.start(900)
        rc = 1
        try:
            info = up.run_info()
            names = ["redis", "gateway", *[n for n in info["children"] if n.startswith("worker")]]
            redis_url = f"redis://127.0.0.1:{up.redis_port}/0"
            print(f"fairshare up with {args.workers} workers, model {up.model}; {args.clients} clients for "
                  f"{args.minutes:g} min; a kill every {lo:g}-{hi:g} s among {', '.join(names)}; "
                  f"CPU count {os.cpu_count()}", flush=True)
            out, downtime, kills = Outcomes(), Downtime(), []
            load = Load(up.url, up.keys, up.model, out, downtime, rng)
            t0 = time.monotonic()
            until = t0 + args.minutes * 60
            stop_kills = threading.Event()
            killer = threading.Thread(target=_kill_loop, args=(up, names, lo, hi, until, random.Random(args.seed + 1),
                                                               downtime, kills, stop_kills), daemon=True)
            clients = [threading.Thread(target=load.run, args=(args.seed + 100 + i,), daemon=True)
                       for i in range(args.clients)]
            for th in [killer, *clients]:
                th.start()
            while time.monotonic() < until:
                time.sleep(1)
            load.stop.set()
            for th in clients:
                th.join(180)
            stop_kills.set()
            killer.join(700)
            elapsed = time.monotonic() - t0
            # heal, then let a killed gateway's leases expire
            time.sleep(LEASE_TTL_S + 2)
            live, stale = _leases(redis_url)
            loads = _worker_loads(up.worker_addrs)
            drift = _drift(redis_url, up.url, up.keys, up.model)
            _report(args, out, kills, elapsed, live, stale, loads, drift)
            rc = 0 if not out.undeclared and live == 0 and all(kv == w == r == 0 for _, kv, w, r in loads) \
                and all(abs(a) < 1e-3 and abs(b) < 1e-3 for a, b in drift.values()) else 1
        finally:
            up.stop()
    return rc


def _report(args, out: Outcomes, kills, elapsed: float, live: int, stale: int, loads, drift) -> None:
    total = sum(out.counts.values())
    print()
    print(f"== fairshare bench chaos: {total} requests in {elapsed / 60:.1f} min, {len(kills)} kills "
          f"(model {args.model}, {args.workers} workers, {args.clients} clients, seed {args.seed})")
    by_child = collections.defaultdict(list)
    for _, name, healed in kills:
        by_child[name.split("-")[0]].append(healed)
    for name, heals in sorted(by_child.items()):
        ok = [h for h in heals if h is not None]
        print(f"   killed {name}: {len(heals)}x, back after median {statistics.median(ok):.1f} s, "
              f"max {max(ok):.1f} s" if ok else f"   killed {name}: {len(heals)}x, never back")
    print("-- requests by outcome")
    for outcome, n in sorted(out.counts.items(), key=lambda kv: (kv[0].startswith("UNDECLARED"), -kv[1])):
        print(f"   {n:>7}  {outcome}")
    print(f"   undeclared 5xx / errors: {len(out.undeclared)}")
    for u in out.undeclared[:20]:
        print(f"      {u}")
    print("-- leaks after the load (lease TTL passed)")
    print(f"   leases live in Redis: {live}   (expired entries not yet purged: {stale})")
    for addr, kv, waiting, running in loads:
        print(f"   worker {addr}: KV blocks held {kv}, waiting {waiting}, running {running}")
    print("-- bucket drift (stored - (seed + refill - used), 3 probe requests per tenant)")
    for tid, (d_tpm, d_rpm) in drift.items():
        print(f"   {tid:<8} TPM {d_tpm:+.3f} tokens   RPM {d_rpm:+.4f} requests")


if __name__ == "__main__":
    sys.exit(main())
