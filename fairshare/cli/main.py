"""The `fairshare` command line.

Sub-commands are dispatched lazily so that e.g. `fairshare gateway` never imports torch:

- `fairshare worker ...`   -> `worker.cli.main`    (gRPC worker, reference engine)
- `fairshare gateway ...`  -> `gateway.cli.main`   (OpenAI-compatible gateway)
- `fairshare keys ...`     -> `gateway.cli.keys_main` (API keys, stored as HMAC digests)
- `fairshare up ...`       -> `fairshare.cli.up.main`  (embedded platform: Redis + worker + gateway, supervised)
- `fairshare top ...`      -> `fairshare.cli.top.main` (live per-tenant view from the metrics)
- `fairshare bench ...`    -> `fairshare.cli.bench.main` (benchmarks in `loadtests/bench/`)
- `fairshare sim ...`      -> `fairshare.cli.sim.main`   (fairness simulator; no torch except `calibrate`)
- `fairshare loadtest ...` -> `fairshare.cli.loadtest.main` (Locust campaigns and their reports)
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "worker": ("worker.cli", "main", "run a gRPC worker (reference engine)"),
    "gateway": ("gateway.cli", "main", "run the OpenAI-compatible gateway"),
    "keys": ("gateway.cli", "keys_main", "create / list / revoke tenant API keys"),
    "up": ("fairshare.cli.up", "main", "start Redis, a worker and the gateway on this machine"),
    "top": ("fairshare.cli.top", "main", "live per-tenant view (service share, queues, KV, TTFT, 429s)"),
    "bench": ("fairshare.cli.bench", "main", "print benchmark figures (engine, gateway)"),
    "sim": ("fairshare.cli.sim", "main", "fairness simulator: calibrate, run a workload, write the report"),
    "loadtest": ("fairshare.cli.loadtest", "main", "run a Locust campaign (per-tenant report, FCFS vs VTC)"),
}


def _usage() -> str:
    lines = ["usage: fairshare COMMAND [ARGS...]", "", "commands:"]
    for name, (_, _, help_text) in _COMMANDS.items():
        lines.append(f"  {name:<9} {help_text}")
    lines.append("")
    lines.append("Run `fairshare COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fairshare` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from fairshare import __version__

        print(__version__)
        return 0
    name = argv[0]
    if name not in _COMMANDS:
        print(f"fairshare: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = _COMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    rc = func(argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
