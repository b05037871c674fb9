"""SGLang on a GPU node, FairShare plugin off vs on: two tenants under sustained overload.

Run by deploy/gpu/sglang-check.sh. For each mode (`off`: SGLang's own scheduling, the plugin not
loaded; `vtc`: the plugin on) it starts `sglang.Engine` in process, then runs a closed loop for
`--duration` seconds: tenant `heavy` keeps `--heavy-share`x as many requests in flight as tenant
`light` (`--light-inflight`), together far more than `--max-running` so SGLang's waiting queue is
never empty. Requests are built exactly as `fairshare worker --engine sglang` builds them
(`worker.sglang_server.request_to_sglang`: signed tenant token, tenant radix namespace), so the
plugin sees them as it would in production.

Per tenant, over the measured window (after `--warmup` seconds): service units `α·P + β·O`
(P = uncached prompt tokens of requests whose first token arrived in the window, O = output tokens
received in the window; α=1, β=2), share of service, output tokens/s, completed requests and mean
time to first token; printed side by side for the two modes.

Model: `--model DIR` (a local HF directory), or by default a ~0.85B Llama config written to a
temporary directory and loaded with SGLang's `load_format="dummy"` (random weights, no download).
The plugin must be discoverable by the scheduler processes: if FairShare is not pip-installed in
this environment, `prepare_plugin_path()` puts the repo and a minimal `*.dist-info` declaring the
`sglang.srt.plugins` entry point on PYTHONPATH (inherited by SGLang's spawned processes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DUMMY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def write_dummy_model(directory: Path) -> Path:
    """config.json of the default model (weights come from SGLang's dummy loader)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(DUMMY_LLAMA, indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return directory


def plugin_registered() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "worker.sglang_plugin:register" for ep in entry_points(group="sglang.srt.plugins"))


def prepare_plugin_path(tmp: Path, force_shim: bool = False) -> str:
    """Make the plugin discoverable here and in spawned processes; returns how."""
    if plugin_registered() and not force_shim:
        return "installed entry point"
    dist = tmp / "site" / "fairshare_sglang_check-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fairshare-sglang-check\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nfairshare = worker.sglang_plugin:register\n")
    paths = [str(tmp / "site"), str(ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    sys.path[:0] = paths
    import importlib

    importlib.invalidate_caches()
    if not plugin_registered():
        raise RuntimeError("could not make the fairshare plugin entry point visible")
    return "entry point shim on PYTHONPATH"


@dataclass
class TenantStats:
    service: float = 0.0
    output_tokens: int = 0
    completed: int = 0
    ttft: list[float] = field(default_factory=list)


def run_mode(mode: str, args, model_dir: Path) -> dict:
    """One Engine lifetime with the plugin `mode` (`off` or a policy); returns per-tenant stats."""
    import sglang

    from fairshare.v1 import worker_pb2
    from worker.sglang_plugin import tenant as tn
    from worker.sglang_server import ModelFacts, request_to_sglang

    os.environ["FAIRSHARE_SGLANG_POLICY"] = mode
    secret = tn.ensure_secret()
    kw = dict(model_path=str(model_dir), skip_tokenizer_init=True, max_running_requests=args.max_running,
              mem_fraction_static=args.mem_fraction, log_level="error", random_seed=args.seed)
    if args.dummy:
        kw["load_format"] = "dummy"
    if args.chunked_prefill_size:
        kw["chunked_prefill_size"] = args.chunked_prefill_size
    engine = sglang.Engine(**kw)
    tm = engine.tokenizer_manager
    incremental = bool(getattr(tm, "incremental_streaming_output", False))
    facts = ModelFacts(name=model_dir.name, max_context_tokens=int(getattr(tm, "context_len", 4096)),
                       vocab_size=int(DUMMY_LLAMA["vocab_size"] if args.dummy else args.vocab_size))
    rng = random.Random(args.seed)
    stats = {"heavy": TenantStats(), "light": TenantStats()}
    inflight = {"heavy": args.light_inflight * args.heavy_share, "light": args.light_inflight}
    counter = [0]

    async def one(tenant: str, t_start: float, t_end: float, stop_at: float) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        while time.monotonic() < stop_at:
            counter[0] += 1
            req = worker_pb2.GenerateRequest(
                request_id=f"{mode}-{tenant}-{counter[0]}",
                tenant=worker_pb2.Tenant(id=tenant, weight=1.0, tier=worker_pb2.TIER_INTERACTIVE),
                prompt_token_ids=[rng.randrange(3, facts.vocab_size) for _ in range(args.prompt_len)])
            req.sampling.max_tokens = args.output_len
            req.sampling.ignore_eos = True
            req.sampling.temperature = 0.0
            gen_kwargs = request_to_sglang(req, facts, secret)
            sent = time.monotonic()
            seen = 0
            first = None
            async for out in tm.generate_request(GenerateReqInput(**gen_kwargs), None):
                now = time.monotonic()
                ids = out.get("output_ids") or []
                new = len(ids) if incremental else len(ids) - seen
                seen += new
                meta = out.get("meta_info") or {}
                s = stats[tenant]
                if new and first is None:
                    first = now
                    if t_start <= now < t_end:
                        cached = int(meta.get("cached_tokens") or 0)
                        s.service += args.alpha * (args.prompt_len - cached)
                        s.ttft.append(now - sent)
                if t_start <= now < t_end:
                    s.service += args.beta * new
                    s.output_tokens += new
                if meta.get("finish_reason") is not None:
                    if t_start <= now < t_end:
                        s.completed += 1
                    break

    async def workload() -> None:
        t0 = time.monotonic()
        t_start, t_end = t0 + args.warmup, t0 + args.warmup + args.duration
        tasks = [asyncio.ensure_future(one(t, t_start, t_end, t_end))
                 for t in ("heavy", "light") for _ in range(inflight[t])]
        await asyncio.gather(*tasks)

    try:
        engine.loop.run_until_complete(workload())
    finally:
        engine.shutdown()
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local HF model directory (default: dummy ~0.85B Llama)")
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this (--model)")
    p.add_argument("--modes", default="off,vtc", help="comma list: off (plugin not loaded), vtc, fcfs, ...")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per mode")
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--light-inflight", type=int, default=16)
    p.add_argument("--heavy-share", type=int, default=4)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--mem-fraction", type=float, default=0.7)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="fairshare-sglang-check-"))
    how = prepare_plugin_path(tmp)
    args.dummy = args.model is None
    model_dir = write_dummy_model(tmp / "random-llama-1b") if args.dummy else Path(args.model)
    import sglang

    print(f"sglang-check: sglang {sglang.__version__}, plugin via {how}, model "
          f"{'dummy ~0.85B Llama (random weights)' if args.dummy else model_dir}")
    print(f"workload: heavy keeps {args.heavy_share * args.light_inflight} requests in flight, light "
          f"{args.light_inflight}; each {args.prompt_len} prompt + {args.output_len} output tokens (ignore_eos); "
          f"max_running_requests {args.max_running}; {args.duration:.0f} s measured after {args.warmup:.0f} s")
    results = {}
    for mode in [m for m in args.modes.split(",") if m]:
        t = time.monotonic()
        results[mode] = run_mode(mode, args, model_dir)
        print(f"  mode {mode}: done in {time.monotonic() - t:.0f} s", flush=True)

    modes = list(results)
    print(f"\nservice units = {args.alpha:g}*uncached prompt + {args.beta:g}*output tokens, in the window")
    header = f"{'':28}" + "".join(f"{('plugin ' + m) if m != 'off' else 'plugin off':>18}" for m in modes)
    print(header)
    rows = [("heavy service", lambda s: f"{s['heavy'].service:.0f}"),
            ("light service", lambda s: f"{s['light'].service:.0f}"),
            ("light share of service", lambda s: f"{100 * s['light'].service / max(1e-9, s['heavy'].service + s['light'].service):.1f}%"),
            ("heavy output tok/s", lambda s: f"{s['heavy'].output_tokens / args.duration:.1f}"),
            ("light output tok/s", lambda s: f"{s['light'].output_tokens / args.duration:.1f}"),
            ("total output tok/s", lambda s: f"{(s['heavy'].output_tokens + s['light'].output_tokens) / args.duration:.1f}"),
            ("heavy completed", lambda s: f"{s['heavy'].completed}"),
            ("light completed", lambda s: f"{s['light'].completed}"),
            ("heavy mean TTFT s", lambda s: f"{sum(s['heavy'].ttft) / max(1, len(s['heavy'].ttft)):.2f}"),
            ("light mean TTFT s", lambda s: f"{sum(s['light'].ttft) / max(1, len(s['light'].ttft)):.2f}")]
    for name, fmt in rows:
        print(f"{name:28}" + "".join(f"{fmt(results[m]):>18}" for m in modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
