"""The one way a test may skip for a missing prerequisite: `require(ok, msg)`.

In CI (the `CI` environment variable set) a missing prerequisite is a failure, never a skip: CI
installs everything (`make install`, `.ci/run`), so a skip there would hide missing work. Elsewhere
(a developer's partial install) the test skips with `msg`, which says how to install what is missing.
Tests that need CUDA skip with a condition or reason naming CUDA/GPU instead (see
tests/unit/test_skip_rule.py, which checks every test file for this rule).
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def in_ci() -> bool:
    """Whether this run is CI's (`CI` set to anything but "", "0" or "false")."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def require(ok: bool, msg: str) -> None:
    """Fail (in CI) or skip (elsewhere) the current test with `msg` unless `ok`."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"{msg} (CI must run this test, never skip it)")
    pytest.skip(msg)


def require_module(name: str, install_hint: str) -> None:
    """`require` that module `name` can be imported (found without importing it)."""
    require(importlib.util.find_spec(name) is not None, f"{name} is not installed: {install_hint}")
