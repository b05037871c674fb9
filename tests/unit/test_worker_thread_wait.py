"""worker.cli.passive_thread_wait: torch's OpenMP threads sleep at barriers unless the operator chose."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker.cli import passive_thread_wait


@pytest.mark.parametrize("preset,expected", [
    ({}, "PASSIVE"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),   # an operator's choice is kept
    ({"GOMP_SPINCOUNT": "10000"}, None),          # so is a spin count (no policy forced beside it)
])
def test_passive_unless_set(monkeypatch, preset, expected):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in preset.items():
        monkeypatch.setenv(name, value)
    passive_thread_wait()
    import os

    assert os.environ.get("OMP_WAIT_POLICY") == expected


def test_worker_entry_sets_it_before_torch_loads():
    """`fairshare worker`'s entry imports torch only after the policy is set: importing worker.cli
    does not load torch (libgomp reads the policy once, when torch loads it)."""
    code = "import sys, worker.cli, fairshare.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
