"""deploy/gpu/*.sh: what can be checked without a GPU.

reference-check's Python part runs end to end on CPU with a tiny config; sglang-check's model
config and plugin discovery shim are checked (its engine runs need a GPU with SGLang).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "deploy" / "gpu"


def test_reference_check_runs_on_cpu_with_a_tiny_model():
    cmd = [sys.executable, str(GPU / "reference_check.py"), "--preset", "tiny", "--device", "cpu",
           "--batches", "1,4", "--prompt-len", "16", "--output-len", "6", "--kv-blocks", "256", "--chunk", "64",
           "--fair-iters", "30", "--fair-warmup", "5", "--fair-queue", "3", "--fair-max-running", "4",
           "--fair-prompt-len", "32", "--fair-output-len", "6"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert float(lines["1"][1]) > 0 and float(lines["4"][1]) > 0           # output tok/s at batch 1 and 4
    vtc, fcfs = lines["vtc"], lines["fcfs"]
    vtc_light, fcfs_light = float(vtc[4].rstrip("%")), float(fcfs[4].rstrip("%"))
    assert 40.0 <= vtc_light <= 60.0        # VTC: equal weights -> about half each
    assert fcfs_light < vtc_light - 10.0    # FCFS: the heavier tenant takes most of the service
    assert "scheduler time per iteration" in text


def test_gpu_scripts_parse_and_refuse_without_cuda():
    for script in ("reference-check.sh", "sglang-check.sh"):
        assert subprocess.run(["bash", "-n", str(GPU / script)]).returncode == 0
    r = subprocess.run(["bash", str(GPU / "reference-check.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "needs torch with a CUDA device" in r.stderr


def test_sglang_check_dummy_model_and_plugin_discovery(tmp_path, monkeypatch):
    sys.path.insert(0, str(GPU))
    try:
        import sglang_check
    finally:
        sys.path.remove(str(GPU))
    cfg = json.loads((sglang_check.write_dummy_model(tmp_path / "m") / "config.json").read_text())
    assert cfg["hidden_size"] == 2048 and cfg["num_hidden_layers"] == 16 and cfg["num_key_value_heads"] == 8
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert sglang_check.prepare_plugin_path(tmp_path, force_shim=True) == "entry point shim on PYTHONPATH"
    assert sglang_check.plugin_registered()
    # the shim alone declares the entry point, and spawned processes get its folder via PYTHONPATH
    from importlib.metadata import distributions

    shim = [d for d in distributions(path=[str(tmp_path / "site")])]
    assert [ep.value for d in shim for ep in d.entry_points if ep.group == "sglang.srt.plugins"] == [
        "worker.sglang_plugin:register"]
    assert os.environ["PYTHONPATH"].split(os.pathsep)[:2] == [str(tmp_path / "site"), str(ROOT)]
