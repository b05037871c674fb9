"""`fairshare worker` size flags parse to numbers; bad sizes (zero, negative, non-numeric) are argparse
errors, tested in test_worker_cli_errors.py."""

from __future__ import annotations

from worker.cli import build_parser


def test_good_sizes_parse_to_numbers():
    a = build_parser().parse_args(["--max-running", "8", "--block-size", "16", "--num-kv-blocks", "100",
                                   "--kv-cache-mb", "0.5", "--max-model-len", "2048"])
    assert (a.max_running, a.block_size, a.num_kv_blocks, a.kv_cache_mb, a.max_model_len) == (8, 16, 100, 0.5, 2048)
    d = build_parser().parse_args([])
    assert (d.max_running, d.block_size, d.num_kv_blocks, d.kv_cache_mb) == (64, 16, None, None)
