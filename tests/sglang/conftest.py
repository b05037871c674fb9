"""tests/sglang: FairShare's SGLang backend.

Tests that need SGLang 0.5.23 itself (the hooks on its real classes, its radix cache, the hooked
names' signatures, its scheduler stepped on CPU by sglang_driver.py and the parity tests against
the reference scheduler) run in the CPU-only SGLang environment that scripts/ci-sglang-env.sh builds
(`make test-sglang`, part of `make test`). In an environment without `sglang` (the main .venv)
those files are not collected, and the rest (tenant tokens, request translation, the plugin's
state on stand-in requests) runs as usual.
"""

import importlib.util

NEEDS_SGLANG = ["test_sglang_*.py", "test_case_ci3_*.py", "test_parity_*.py"]

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else list(NEEDS_SGLANG)
