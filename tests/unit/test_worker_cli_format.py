"""`fairshare worker --dtype / --quantization`: the defaults, and combinations the runner cannot
run rejected as usage errors (exit 2, one line) before any model is loaded."""

from __future__ import annotations

import pytest

from tests.unit.cli_checks import assert_worker_usage_error
from worker.cli import build_parser


@pytest.mark.parametrize("argv,message", [
    (["--quantization", "int4", "--dtype", "float32"], "--quantization int4 needs --dtype bfloat16"),
    (["--quantization", "int8", "--dtype", "float32"], "--quantization int8 needs --dtype bfloat16"),
    (["--quantization", "int4", "--device", "cuda"], "use --quantization none on CUDA"),
    (["--quantization", "int3"], "argument --quantization: invalid choice"),
    (["--dtype", "float16"], "argument --dtype: invalid choice"),
])
def test_impossible_formats_are_usage_errors(argv, message, capsys):
    assert_worker_usage_error(argv, message, capsys)


def test_format_defaults_and_choices():
    d = build_parser().parse_args([])
    assert (d.dtype, d.quantization, d.kv_cache_mb) == ("auto", "auto", None)
    a = build_parser().parse_args(["--dtype", "bfloat16", "--quantization", "int8"])
    assert (a.dtype, a.quantization) == ("bfloat16", "int8")
