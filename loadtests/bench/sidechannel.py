"""Prefix-cache timing side channel (case CI2): can a tenant tell from TTFT what another tenant's
prompts were?

    python -m loadtests.bench.sidechannel [--pairs 300] [--prefix-tokens 256] [--suffix-tokens 32]
                                    [--batch 20] [--warmup 8]
                                    [--arms unsafe,namespaced,floor] [--floor 0.25] [--seed 0]
                                    [--addr HOST:PORT --label NAME]   (probe a running worker instead)

Protocol, over real gRPC against a real worker (a `fairshare worker --model random-tiny` started
as a subprocess per arm unless `--addr` is given), in rounds of `batch` pairs:

1. the victim tenant sends `batch` prompts, each a fresh random *prefix* (`prefix_tokens`) plus a
   victim suffix, and waits for them to finish (their KV blocks now sit in the radix cache);
2. the attacker tenant sends `batch` *pairs* of probes one at a time, the pairs in a random order:
   for each victim prompt a *shared* probe (that prompt's prefix + a fresh attacker suffix) and a
   *control* probe (fresh random tokens, the same length), back to back, which of the two goes
   first drawn by a fair coin; `max_tokens = 1`, so TTFT is almost all prefill. The two probes of a
   pair see the same machine load, so a CPU hiccup slows both and cancels in the comparison.

The attacker never hits its own cache: every prefix is used by exactly one shared probe, every
control is fresh, and each probe carries a fresh `cache_salt` as well. TTFT is the attacker's
view: from sending the call to the first `GenerateResponse` carrying tokens. The statistics
(`loadtests.bench.sidechannel_stats`): the paired AUC (the fraction of pairs whose shared probe came
back first, ties 1/2; the verdict's statistic), the pooled ROC AUC of a threshold on TTFT over all
probes and the best threshold's balanced accuracy (for the record). Arms: `unsafe` (the worker's experiment-only `--unsafe-global-cache`:
one global namespace; the leak must show, AUC near 1), `namespaced` (the default; AUC near 0.5),
`floor` (unsafe cache with a TTFT floor for the interactive tier: the floor masks the timing).
Timings are printed, never asserted, except in tests/integration/test_case_ci2_*, whose bounds
are statistical (AUC), not wall-clock.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

from loadtests.bench.sidechannel_stats import SideChannelResult, analyse, format_report

ROOT = Path(__file__).resolve().parents[2]
TOKEN_RANGE = (1000, 30000)  # ids drawn uniformly from here (inside the SmolLM2 vocabulary of random-tiny)

ARMS: dict[str, tuple[str, list[str]]] = {
    "unsafe": ("unsafe global cache", ["--unsafe-global-cache"]),
    "namespaced": ("per-tenant namespaces", []),
    "floor": ("unsafe global + TTFT floor {floor:g}s", ["--unsafe-global-cache", "--ttft-floor", "interactive={floor:g}"]),
}


def _size(default: int, help: str):
    """A `ProbeConfig` field: its default and the one line that documents it (the field's `--help`)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ProbeConfig:
    """Experiment size, all counts of probes or tokens. Each field is a flag of `main` named after it
    (``prefix_tokens`` → ``--prefix-tokens``), with the field's help and default."""

    pairs: int = _size(300, "probe pairs per arm (a shared probe + its control each)")
    prefix_tokens: int = _size(256, "tokens a shared probe has in common with a victim prompt")
    suffix_tokens: int = _size(32, "tokens after the prefix (victim prompts and probes alike)")
    batch: int = _size(20, "victim prompts per round")
    warmup: int = _size(8, "probes sent and discarded first")
    seed: int = _size(0, "seed of the token and order draws")

    @staticmethod
    def add_flags(p: argparse.ArgumentParser) -> None:
        """Add one ``--name`` flag per field to `p` (type int, the field's default and help)."""
        for f in fields(ProbeConfig):
            p.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, help=f.metadata["help"])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ProbeConfig":
        """The config the flags of `add_flags` give, read from parsed `args`."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _stubs():
    from fairshare.v1 import worker_pb2, worker_pb2_grpc

    return worker_pb2, worker_pb2_grpc


def _request(tenant: str, prompt: list[int], salt: str = ""):
    pb, _ = _stubs()
    return pb.GenerateRequest(
        request_id=uuid.uuid4().hex,
        tenant=pb.Tenant(id=tenant, weight=1.0, tier=pb.TIER_INTERACTIVE),
        prompt_token_ids=prompt, cache_salt=salt,
        sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    )


def worker_signer():
    """Signs the probes as the gateway would (fairshare/worker_auth.py): the keys of
    ``$FAIRSHARE_WORKER_KEYS_FILE`` / ``$FAIRSHARE_WORKER_KEYS``; when neither is set, a fresh key is put
    in ``$FAIRSHARE_WORKER_KEYS`` first, so the workers this benchmark starts inherit it."""
    from fairshare import worker_auth

    source = worker_auth.KeySource.from_settings()
    if source is None:
        os.environ[worker_auth.KEYS_ENV] = worker_auth.new_key_text("sidechannel").strip()
        source = worker_auth.KeySource.from_settings()
    return worker_auth.Signer(source)


def timed_generate(stub, req, timeout_s: float = 60.0, signer=None) -> tuple[float, int, float]:
    """Send one request (signed by `signer`, default `worker_signer()`); return (TTFT seconds as the
    client sees it, cached prompt tokens the worker reported, TTFT seconds the worker reported in
    `timings.first_token_s`). Raises RuntimeError when no token came back."""
    from fairshare.worker_auth import generate_claims

    metadata = (signer or worker_signer()).metadata(generate_claims(req))
    start = time.perf_counter()
    ttft = None
    cached = 0
    worker_ttft = 0.0
    for msg in stub.Generate(req, timeout=timeout_s, metadata=metadata):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - start
            worker_ttft = msg.timings.first_token_s
        if msg.finish_reason:
            cached = msg.usage.cached_prompt_tokens
    if ttft is None:
        raise RuntimeError(f"request {req.request_id} returned no token")
    return ttft, cached, worker_ttft


def probe_worker(addr: str, label: str, cfg: ProbeConfig = ProbeConfig(), victim: str = "victim",
                 attacker: str = "attacker") -> SideChannelResult:
    """Run the protocol (module docstring) against the worker at `addr`; return the analysed arm."""
    import grpc

    _, pb_grpc = _stubs()
    rng = random.Random(cfg.seed)
    lo, hi = TOKEN_RANGE
    length = cfg.prefix_tokens + cfg.suffix_tokens

    def fresh(n: int) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(n)]

    shared: list[float] = []
    control: list[float] = []
    worker_side: dict[str, list[float]] = {"shared": [], "control": []}
    cached = {"shared": 0, "control": 0}
    signer = worker_signer()
    with grpc.insecure_channel(addr) as channel, ThreadPoolExecutor(8) as pool:
        stub = pb_grpc.WorkerStub(channel)
        for _ in range(cfg.warmup):
            timed_generate(stub, _request(attacker, fresh(length), uuid.uuid4().hex), signer=signer)
        done = 0
        while done < cfg.pairs:
            n = min(cfg.batch, cfg.pairs - done)
            prefixes = [fresh(cfg.prefix_tokens) for _ in range(n)]
            list(pool.map(lambda p: timed_generate(stub, _request(victim, p + fresh(cfg.suffix_tokens)), signer=signer),
                          prefixes))
            rng.shuffle(prefixes)
            for prefix in prefixes:  # one pair: the shared probe and its control, back to back
                pair = [("shared", prefix + fresh(cfg.suffix_tokens)), ("control", fresh(length))]
                rng.shuffle(pair)   # which goes first is a fair coin, so order cannot favour a class
                for kind, prompt in pair:
                    ttft, hit, at_worker = timed_generate(stub, _request(attacker, prompt, uuid.uuid4().hex),
                                                          signer=signer)
                    (shared if kind == "shared" else control).append(ttft)
                    worker_side[kind].append(at_worker)
                    cached[kind] += hit
            done += n
    return analyse(label, shared, control, cached["shared"] / len(shared), cached["control"] / len(control),
                   worker_shared=worker_side["shared"], worker_control=worker_side["control"])


def start_worker(flags: list[str], threads: int | None = None, log_path: Path | None = None,
                 timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Start `fairshare worker --model random-tiny` with `flags` on a free loopback port; return
    (process, "127.0.0.1:port") once it listens. Raises RuntimeError / TimeoutError if it does not."""
    from fairshare.ports import free_port, wait_for_port

    worker_signer()  # (a key in the environment the worker inherits)
    port = free_port()
    cmd = [sys.executable, "-m", "fairshare.cli", "worker", "--host", "127.0.0.1", "--port", str(port),
           "--model", "random-tiny", *(["--threads", str(threads)] if threads else []), *flags]
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, timeout_s, proc)
    except BaseException:
        stop_worker(proc)
        raise
    return proc, f"127.0.0.1:{port}"


def stop_worker(proc: subprocess.Popen) -> None:
    """Terminate a worker started by `start_worker` (kill after 15 s)."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def run_arm(arm: str, cfg: ProbeConfig, floor_s: float = 0.25, threads: int | None = None,
            log_path: Path | None = None) -> SideChannelResult:
    """Start a worker for one arm (`unsafe`, `namespaced`, `floor`), probe it, stop it.
    Raises KeyError for an unknown arm."""
    label, flags = ARMS[arm]
    proc, addr = start_worker([f.format(floor=floor_s) for f in flags], threads, log_path)
    try:
        return probe_worker(addr, label.format(floor=floor_s), cfg)
    finally:
        stop_worker(proc)


def setup_line(cfg: ProbeConfig) -> str:
    return (f"CI2 timing side channel: random-tiny worker over gRPC; victim prompts = {cfg.prefix_tokens}-token "
            f"random prefix + {cfg.suffix_tokens}; attacker probes {cfg.prefix_tokens + cfg.suffix_tokens} tokens, "
            f"max_tokens 1, fresh cache_salt each; {cfg.pairs} pairs (shared + control back to back, coin-flip order), "
            f"shuffled in rounds of {cfg.batch}; TTFT = client send -> first token (ms)")


def main(argv: list[str] | None = None) -> int:
    """Entry point (`python -m loadtests.bench.sidechannel`); prints the report, returns 0."""
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.sidechannel", description=__doc__.split("\n\n")[0])
    ProbeConfig.add_flags(p)
    p.add_argument("--arms", default="unsafe,namespaced,floor", help="comma list of: " + ", ".join(ARMS))
    p.add_argument("--floor", type=float, default=0.25, help="TTFT floor of the floor arm, seconds")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the workers")
    p.add_argument("--addr", default=None, help="probe this running worker instead of starting one per arm")
    p.add_argument("--label", default="worker at --addr")
    args = p.parse_args(argv)
    cfg = ProbeConfig.from_args(args)
    print(setup_line(cfg), flush=True)
    if args.addr:
        results = [probe_worker(args.addr, args.label, cfg)]
    else:
        results = []
        for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
            if arm not in ARMS:
                p.error(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
            t0 = time.monotonic()
            results.append(run_arm(arm, cfg, args.floor, args.threads))
            print(f"  {arm}: done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    print(format_report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
