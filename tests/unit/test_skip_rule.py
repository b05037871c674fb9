"""In CI nothing may skip except what needs CUDA: every test file is checked (AST) for skips outside a
CUDA/GPU condition (tests/support/skip_rule.py), and the checker itself is shown to catch each form.

The rule is static, so it holds whether or not `CI` is set where this runs; at run time
tests/conftest.py also turns a skip whose reason does not name CUDA/GPU into a failure under CI.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.skip_rule import find_violations, skip_allowed_in_ci

TESTS = Path(__file__).resolve().parents[1]


def violations(src: str) -> list[str]:
    return [v.what for v in find_violations(textwrap.dedent(src))]


@pytest.mark.parametrize("src,what", [
    ("import pytest\npytest.importorskip('matplotlib')\n", "pytest.importorskip"),
    ("import pytest\ndef test_x():\n    pytest.skip('locust is not installed')\n", "pytest.skip"),
    ("import pytest as pt\ndef test_x():\n    pt.skip('no redis')\n", "pytest.skip"),
    ("from pytest import skip\ndef test_x():\n    skip('later')\n", "pytest.skip"),
    ("from pytest import importorskip as need\nneed('xgrammar')\n", "pytest.importorskip"),
    ("import pytest\n@pytest.mark.skip(reason='flaky')\ndef test_x():\n    pass\n", "pytest.mark.skip"),
    ("import pytest\n@pytest.mark.skip\ndef test_x():\n    pass\n", "pytest.mark.skip"),
    ("import sys, pytest\n@pytest.mark.skipif(sys.platform == 'darwin', reason='linux only')\ndef test_x():\n"
     "    pass\n", "pytest.mark.skipif"),
    ("from pytest import mark\npytestmark = mark.skipif(True, reason='slow')\n", "pytest.mark.skipif"),
    ("import unittest\n@unittest.skipIf(True, 'x')\ndef test_x():\n    pass\n", "unittest.skipIf"),
    ("from unittest import SkipTest\ndef test_x():\n    raise SkipTest('x')\n", "raise unittest.SkipTest"),
    ("import pytest\ndef test_x():\n    raise pytest.skip.Exception('x')\n", "raise pytest.skip.Exception"),
    # a skip that merely follows a CI check which does not fail is still a skip in CI
    ("import os, pytest\ndef test_x():\n    if os.environ.get('CI'):\n        print('ci')\n"
     "    pytest.skip('missing')\n", "pytest.skip"),
    # the CI guard must come right before the skip, in the same block
    ("import os, pytest\ndef test_x(ok):\n    if os.environ.get('CI'):\n        pytest.fail('missing')\n"
     "    print(ok)\n    pytest.skip('missing')\n", "pytest.skip"),
])
def test_checker_flags_skips_outside_a_cuda_condition(src, what):
    assert violations(src) == [what]


@pytest.mark.parametrize("src", [
    "import pytest, torch\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')\n"
    "def test_x():\n    pass\n",
    "import pytest\ndef test_x(has_gpu):\n    if not has_gpu:\n        pytest.skip('no GPU on this machine')\n",
    "import pytest, torch\ndef test_x():\n    if not torch.cuda.is_available():\n        pytest.skip('later')\n",
    "import os, pytest\ndef need(ok, msg):\n    if not ok:\n        if os.environ.get('CI'):\n"
    "            pytest.fail(msg)\n        pytest.skip(msg)\n",
    "import pytest\ndef in_ci():\n    return True\ndef need(msg):\n    if in_ci():\n        pytest.fail(msg)\n"
    "    pytest.skip(msg)\n",
    "import pytest\ndef test_x():\n    pytest.fail('no skip here')\n",
])
def test_checker_allows_cuda_skips_and_the_ci_guard(src):
    assert violations(src) == []


def test_runtime_rule_allows_only_cuda_or_gpu_reasons():
    assert skip_allowed_in_ci("needs CUDA") and skip_allowed_in_ci("Skipped: no GPU available")
    assert not skip_allowed_in_ci("matplotlib missing") and not skip_allowed_in_ci(None)
    assert not skip_allowed_in_ci("")


def test_no_test_file_skips_outside_a_cuda_condition():
    files = sorted(p for p in TESTS.rglob("*.py") if ".venv" not in p.parts)
    assert len(files) > 50, files  # the whole suite is read, sglang and deploy included
    found = {str(p.relative_to(TESTS.parent)): [str(v) for v in find_violations(p.read_text())] for p in files}
    found = {k: v for k, v in found.items() if v}
    assert not found, ("skips that would run in CI (use tests.support.skips.require, or a CUDA/GPU condition):\n"
                       + "\n".join(f"{k}: {v}" for k, v in found.items()))
