"""`fairshare bench recovery`: how long `fairshare up` takes to heal a `kill -9`, printed as figures.

::

    fairshare bench recovery [--model random-tiny] [--kills 2] [--child worker|redis|gateway ...]

Starts `fairshare up` (free ports, a temporary state dir), then for each child named and each kill:
SIGKILLs it and, polling with a small chat completion every 0.1 s, measures the seconds from the
kill to (1) the supervisor's "is back" notice and (2) the first request that succeeds; it counts the
requests refused meanwhile and the ``retry-after`` they carried. The platform runs with a 1-s
restart window (``--restart-window-s 1``), so kills seconds apart never add up to the restart limit;
it is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _measure(up, child: str, client, model: str, timeout_s: float) -> dict:
    """Kill `child` once; returns {"back_s", "served_s", "refused", "retry_after"}."""
    import openai

    before = len(up.lines_matching(f"the {child} is back"))
    pid = up.run_info()["children"][child]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    refused, hints = 0, set()
    served_s = back_s = None
    time.sleep(0.05)
    while time.monotonic() - t0 < timeout_s and (served_s is None or back_s is None):
        if back_s is None and len(up.lines_matching(f"the {child} is back")) > before:
            back_s = time.monotonic() - t0
        if served_s is None:
            try:
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
                served_s = time.monotonic() - t0
            except openai.APIStatusError as e:
                refused += 1
                if "retry-after" in e.response.headers:
                    hints.add(e.response.headers["retry-after"])
            except openai.APIConnectionError:
                refused += 1
        time.sleep(0.1)
    return {"back_s": back_s, "served_s": served_s, "refused": refused, "retry_after": sorted(hints)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fairshare bench recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random-tiny", help="smollm2 or random-tiny (default)")
    p.add_argument("--kills", type=int, default=2, help="kills per child (default 2)")
    p.add_argument("--child", action="append", choices=["worker", "redis", "gateway"], default=None,
                   help="which child to kill (repeatable; default: worker and redis)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up on one recovery after this many seconds")
    args = p.parse_args(argv)
    import openai

    from loadtests.up_process import UpProcess

    children = args.child or ["worker", "redis"]
    with tempfile.TemporaryDirectory(prefix="fairshare-recovery-") as tmp:
        up = UpProcess(Path(tmp) / "state", "--restart-window-s", "1", model=args.model)
        up.start(900)
        try:
            client = openai.OpenAI(base_url=up.base_url, api_key=next(iter(up.keys.values())), max_retries=0,
                                   timeout=60)
            print(f"fairshare up with {up.model}; {args.kills} kill(s) per child; CPU count {os.cpu_count()}",
                  flush=True)
            for child in children:
                runs = []
                for i in range(args.kills):
                    m = _measure(up, child, client, up.model, args.timeout)
                    runs.append(m)
                    print(f"{child} kill {i + 1}: supervisor notice after {m['back_s'] or float('nan'):.1f} s, "
                          f"first request served after {m['served_s'] or float('nan'):.1f} s; {m['refused']} "
                          f"refused meanwhile (retry-after {', '.join(m['retry_after']) or '-'})", flush=True)
                served = [m["served_s"] for m in runs if m["served_s"] is not None]
                if served:
                    print(f"{child}: served again after median {statistics.median(served):.1f} s, "
                          f"max {max(served):.1f} s", flush=True)
        finally:
            rc = up.stop()
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
