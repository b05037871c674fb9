"""`fairshare worker --kv-*` flags: parsed into EngineConfig.kv_quota (a KVQuotaConfig); bad values are argparse errors
(exit 2, one `error:` line, no traceback) before any model is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.unit.cli_checks import assert_worker_usage_error
from worker.cli import build_parser, kv_quota_settings
from worker.engine.engine import EngineConfig
from worker.scheduling.quota import KVQuotaConfig


def settings(*argv: str) -> KVQuotaConfig:
    p = build_parser()
    return kv_quota_settings(p, p.parse_args(list(argv)))


def test_defaults_keep_quotas_off_with_the_documented_values():
    s = settings()
    assert s == KVQuotaConfig(enabled=False, watermark=0.8, headroom=0.05, shared_buffer=0.0, hard_cap=1.0,
                              soft={}, hard={})
    assert EngineConfig().kv_quota == s  # the CLI's defaults are the engine's


def test_flags_reach_the_engine_config():
    s = settings("--kv-quota", "--kv-watermark", "0.9", "--kv-headroom", "0.1", "--kv-shared-buffer", "0.2",
                 "--kv-hard-cap", "0.6", "--kv-soft-quota", "acme=0.3", "--kv-soft-quota", "batch=0.1",
                 "--kv-hard-cap-for", "acme=0.5")
    q = EngineConfig(kv_quota=s).kv_quota
    assert (q.enabled, q.watermark, q.headroom, q.shared_buffer, q.hard_cap) == (True, 0.9, 0.1, 0.2, 0.6)
    assert q.soft == {"acme": 0.3, "batch": 0.1} and q.hard == {"acme": 0.5}
    assert settings("--kv-quota", "--no-kv-quota").enabled is False


@pytest.mark.parametrize("argv,message", [
    (["--kv-watermark", "0.9"], "--kv-watermark needs --kv-quota"),
    (["--kv-soft-quota", "a=0.5", "--kv-hard-cap", "0.5"], "need --kv-quota"),
    (["--kv-quota", "--kv-watermark", "1.5"], "argument --kv-watermark: 1.5 is not in (0, 1]"),
    (["--kv-quota", "--kv-watermark", "0"], "is not in (0, 1]"),
    (["--kv-quota", "--kv-headroom", "1"], "argument --kv-headroom: 1 is not in [0, 1)"),
    (["--kv-quota", "--kv-shared-buffer", "-0.1"], "argument --kv-shared-buffer"),
    (["--kv-quota", "--kv-hard-cap", "nan"], "argument --kv-hard-cap"),
    (["--kv-quota", "--kv-hard-cap", "x"], "'x' is not a number"),
    (["--kv-quota", "--kv-headroom", "0.6", "--kv-shared-buffer", "0.5"], "--kv-headroom + --kv-shared-buffer must be < 1"),
    (["--kv-quota", "--kv-soft-quota", "acme"], "is not KEY=FRAC"),
    (["--kv-quota", "--kv-soft-quota", "=0.2"], "is not KEY=FRAC"),
    (["--kv-quota", "--kv-soft-quota", "acme=0"], "argument --kv-soft-quota: 0 is not in (0, 1]"),
    (["--kv-quota", "--kv-hard-cap-for", "acme=2"], "argument --kv-hard-cap-for"),
    (["--kv-quota", "--kv-soft-quota", "a=0.1", "--kv-soft-quota", "a=0.2"], "'a' given twice"),
])
def test_bad_values_are_argparse_errors(argv, message, capsys):
    assert_worker_usage_error(argv, message, capsys)


def test_bad_value_from_the_command_line_exits_2_without_traceback():
    res = subprocess.run([sys.executable, "-m", "fairshare.cli", "worker", "--kv-quota", "--kv-soft-quota", "x=3"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "--kv-soft-quota" in res.stderr


def test_fairshare_up_passes_kv_quota_to_its_worker():
    from fairshare.cli.up import build_parser as up_parser
    from fairshare.cli.up import worker_command

    def worker_args(*argv: str) -> list[str]:
        cmd = worker_command(up_parser().parse_args(list(argv)))
        return cmd[cmd.index("worker") + 1:]

    assert not [a for a in worker_args() if "kv-quota" in a]  # the worker's own default
    on, off = worker_args("--kv-quota"), worker_args("--no-kv-quota")
    assert "--kv-quota" in on and "--no-kv-quota" in off
    p = build_parser()
    assert kv_quota_settings(p, p.parse_args(on)).enabled is True
    assert kv_quota_settings(p, p.parse_args(off)).enabled is False
