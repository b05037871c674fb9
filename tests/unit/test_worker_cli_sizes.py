"""`fairshare worker` size flags: a zero, negative or non-numeric size is an argparse error (exit 2,
one `error:` line, no traceback) before any model is loaded, not a ValueError/ZeroDivisionError
from the engine after it."""

from __future__ import annotations

import pytest

from tests.unit.cli_checks import assert_worker_usage_error
from worker.cli import build_parser


@pytest.mark.parametrize("argv,message", [
    (["--max-running", "0"], "argument --max-running: 0 is not > 0"),
    (["--block-size", "0"], "argument --block-size: 0 is not > 0"),
    (["--num-kv-blocks", "-5"], "argument --num-kv-blocks: -5 is not > 0"),
    (["--max-num-batched-tokens", "x"], "argument --max-num-batched-tokens: 'x' is not an integer"),
    (["--max-model-len", "0"], "argument --max-model-len"),
    (["--kv-cache-mb", "nan"], "argument --kv-cache-mb: nan is not > 0"),
    (["--kv-cache-mb", "-1"], "argument --kv-cache-mb"),
    (["--threads", "0"], "argument --threads"),
    (["--metrics-max-tenants", "0"], "argument --metrics-max-tenants"),
])
def test_bad_sizes_are_argparse_errors(argv, message, capsys):
    assert_worker_usage_error(argv, message, capsys)


def test_good_sizes_parse_to_numbers():
    a = build_parser().parse_args(["--max-running", "8", "--block-size", "16", "--num-kv-blocks", "100",
                                   "--kv-cache-mb", "0.5", "--max-model-len", "2048"])
    assert (a.max_running, a.block_size, a.num_kv_blocks, a.kv_cache_mb, a.max_model_len) == (8, 16, 100, 0.5, 2048)
    d = build_parser().parse_args([])
    assert (d.max_running, d.block_size, d.num_kv_blocks, d.kv_cache_mb) == (64, 16, None, None)
