"""`fairshare bench NAME [options]`: benchmarks that print figures (never timed assertions in tests).

Each benchmark lives in `loadtests/bench/` and has a ``main(argv) -> int``; this module only
dispatches to it (imported lazily, so `fairshare bench cache` never imports torch).

    fairshare bench engine [...]       reference engine decode throughput (vs llama.cpp, transformers)
    fairshare bench gateway [...]      the gateway's overhead against an echo worker
    fairshare bench cache [...]        prefix-cache hit rates by isolation mode
    fairshare bench sidechannel [...]  CI2: the TTFT timing side channel
    fairshare bench recovery [...]     `fairshare up` healing a kill -9
    fairshare bench chaos [...]        mixed load while Redis, a worker and the gateway are killed at random
    fairshare bench grammar [...]      the cost of grammar-constrained decoding
    fairshare bench scheduler [...]    the scheduling core's decision time per iteration
    fairshare bench weights [...]      what a weight means when nobody queues, and its cost
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "engine": "loadtests.bench.engine",
    "gateway": "loadtests.bench.gateway",
    "cache": "loadtests.bench.cache",
    "sidechannel": "loadtests.bench.sidechannel",
    "recovery": "loadtests.bench.recovery",
    "chaos": "loadtests.bench.chaos",
    "grammar": "loadtests.bench.grammar",
    "scheduler": "loadtests.bench.scheduler",
    "weights": "loadtests.bench.weights",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fairshare bench`; returns the benchmark's exit code (2 for an unknown name)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: fairshare bench {{{'|'.join(BENCHMARKS)}}} [options]"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    what, rest = argv[0], argv[1:]
    if what not in BENCHMARKS:
        print(f"fairshare bench: unknown benchmark {what!r}\n{usage}", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[what]).main(rest) or 0)
