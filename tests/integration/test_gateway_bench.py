"""The gateway overhead benchmark runs end to end and prints its figures."""

from __future__ import annotations

import re

import pytest

from loadtests.bench.gateway import main
from loadtests.bench.wrk import wrk_path


def test_bench_prints_figures(capsys):
    assert main(["--requests", "30", "--latency-requests", "20", "--concurrency", "4", "--max-tokens", "4",
                 "--client", "httpx"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"direct\s+[\d.]+\s+[\d.]+", out) and re.search(r"gateway\s+[\d.]+\s+[\d.]+", out)
    assert "added" in out and "req/s" in out
    assert "non-streamed" in out and "streamed (SSE)" in out  # both modes in one run
    assert len(re.findall(r"gateway CPU: \d+\.\d+ ms per request", out)) == 2


def test_bench_streaming(capsys):
    assert main(["--requests", "20", "--latency-requests", "10", "--concurrency", "2", "--max-tokens", "3",
                 "--stream", "--client", "httpx"]) == 0
    assert "streamed (SSE)" in capsys.readouterr().out


def test_bench_with_wrk(capsys, monkeypatch):
    """wrk drives the gateway path and checks every answer (a 200 holding the completion's usage,
    or a stream's ``data: [DONE]``), and an answer without that marker fails the run instead of
    being counted as served; where wrk is not installed, ``--client wrk`` says how to add it
    (.ci/run installs it, so CI runs the first branch)."""
    args = ["--requests", "20", "--latency-requests", "10", "--concurrency", "4", "--max-tokens", "4",
            "--client", "wrk", "--wrk-seconds", "2"]
    if wrk_path() is None:
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2 and "apt-get install wrk" in capsys.readouterr().err
        return
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gateway: wrk" in out
    counts = [int(n) for n in re.findall(r"(\d+) via the gateway in 2 s", out)]
    assert len(counts) == 4 and min(counts) > 0, out  # concurrency 1 and 4, both modes
    assert len(re.findall(r"gateway CPU: \d+\.\d+ ms per request", out)) == 2

    from loadtests.bench import gateway as bench

    real = bench._wrk_figures

    async def wrong_marker(args, direct, url, body, key, marker, pid):  # a usage no answer has
        return await real(args, direct, url, body, key, '"completion_tokens":999', pid)

    monkeypatch.setattr(bench, "_wrk_figures", wrong_marker)
    assert main(args + ["--modes", "non-stream"]) == 1
    assert "bad answers" in capsys.readouterr().err
