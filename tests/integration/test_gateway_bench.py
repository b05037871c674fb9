"""The gateway overhead benchmark runs end to end and prints its figures."""

from __future__ import annotations

import re

from loadtests.bench.gateway import main


def test_bench_prints_figures(capsys):
    assert main(["--requests", "30", "--latency-requests", "20", "--concurrency", "4", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"direct\s+[\d.]+\s+[\d.]+", out) and re.search(r"gateway\s+[\d.]+\s+[\d.]+", out)
    assert "added" in out and "req/s" in out
    assert "non-streamed" in out and "streamed (SSE)" in out  # both modes in one run
    assert len(re.findall(r"gateway CPU: \d+\.\d+ ms per request", out)) == 2


def test_bench_streaming(capsys):
    assert main(["--requests", "20", "--latency-requests", "10", "--concurrency", "2", "--max-tokens", "3",
                 "--stream"]) == 0
    assert "streamed (SSE)" in capsys.readouterr().out
