"""`fairshare worker` flags with bad values: each is an argparse error (exit 2, one `error:` line naming
the flag and the value, no traceback) before any model is loaded, not an error from the engine after
it. One table for every flag family (sizes, prefix cache, tiers)."""

from __future__ import annotations

import pytest

from tests.unit.cli_checks import assert_worker_usage_error

BAD_FLAGS = [
    # cache options
    (["--ttft-floor", "nosuchtier=1"], "is not TIER=SECONDS"),
    (["--ttft-floor", "interactive=-1"], "TTFT floor (seconds) -1.0 is not in [0, 600]"),
    (["--ttft-floor", "interactive=nan"], "is not in [0, 600]"),
    (["--cached-rate", "3"], "cached rate 3.0 is not in [0, 1]"),
    (["--cached-rate", "x"], "'x' is not a number"),
    # sizes
    (["--max-running", "0"], "argument --max-running: 0 is not > 0"),
    (["--block-size", "0"], "argument --block-size: 0 is not > 0"),
    (["--num-kv-blocks", "-5"], "argument --num-kv-blocks: -5 is not > 0"),
    (["--max-num-batched-tokens", "x"], "argument --max-num-batched-tokens: 'x' is not an integer"),
    (["--max-model-len", "0"], "argument --max-model-len"),
    (["--kv-cache-mb", "nan"], "argument --kv-cache-mb: nan is not > 0"),
    (["--kv-cache-mb", "-1"], "argument --kv-cache-mb"),
    (["--threads", "0"], "argument --threads"),
    (["--metrics-max-tenants", "0"], "argument --metrics-max-tenants"),
    # tiers
    (["--tier-min-share", "interactive=0.1"], "interactive is the top tier"),
    (["--tier-min-share", "gold=0.1"], "unknown tier 'gold'"),
    (["--tier-min-share", "batch"], "is not TIER=FRAC"),
    (["--tier-min-share", "batch=x"], "is not TIER=FRAC"),
    (["--tier-min-share", "batch=1"], "must be in [0, 1)"),
    (["--tier-min-share", "batch=0.6", "--tier-min-share", "background=0.5"], "must sum to less than 1"),
    (["--tier-min-share", "batch=0.1", "--tier-min-share", "batch=0.2"], "'batch' given twice"),
    (["--tier-min-share", "batch=0.1", "--no-tier-scheduling"], "needs tier scheduling"),
    (["--iteration-token-target", "0"], "argument --iteration-token-target: 0 is not > 0"),
    (["--lower-tier-token-target", "-1"], "argument --lower-tier-token-target: -1 is not >= 0"),
    (["--lower-tier-token-target", "x"], "argument --lower-tier-token-target: 'x' is not an integer"),
    (["--lower-tier-grace-iterations", "-1"], "argument --lower-tier-grace-iterations: -1 is not >= 0"),
    (["--lower-tier-idle-token-target", "0"], "argument --lower-tier-idle-token-target: 0 is not > 0"),
    (["--hand-back-after-s", "-1"], "argument --hand-back-after-s: -1 is not in [0, 3600) seconds"),
    (["--hand-back-after-s", "soon"], "argument --hand-back-after-s: 'soon' is not a number"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS)
def test_bad_flag_values_are_argparse_errors(argv, message, capsys):
    assert_worker_usage_error(argv, message, capsys)
