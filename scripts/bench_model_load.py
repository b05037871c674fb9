"""Print how long SmolLM2 takes to load: the first time (GGUF -> converted cache) and from the cache.

    .venv/bin/python scripts/bench_model_load.py [--repeat 3]

The figure tests/unit/test_models.py used to bound with a timed assertion: that test now checks the
cache is used (the GGUF file is never read, nothing is rewritten); the time is measured here.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="loads from the cache to time (default 3)")
    args = p.parse_args()
    from worker.models import load_model

    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        load_model("smollm2", cache_dir=d, progress=False)
        first = time.perf_counter() - t
        cached = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            load_model("smollm2", cache_dir=d, progress=False)
            cached.append(time.perf_counter() - t)
    print(f"smollm2 first load (convert the GGUF file into the cache): {first:.2f} s")
    print(f"smollm2 load from the cache: median {statistics.median(cached):.2f} s over {len(cached)} "
          f"(min {min(cached):.2f}, max {max(cached):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
