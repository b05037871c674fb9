"""`fairshare up` itself: first run, second run, Ctrl-C, a dying child, ports already taken.

These use the seeded random tiny model (starts in seconds); the SmolLM2 platform is in test_platform.py.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess

import openai
import pytest
import yaml

from fairshare.procs import free_port, port_in_use
from tests.e2e.conftest import ROOT, assert_all_stopped, fairshare_command, start_up

pytestmark = pytest.mark.e2e

TINY_START_TIMEOUT_S = 180.0


def test_first_run_second_run_sigterm_and_a_dying_child(tmp_path):
    """Run 1 (fresh state dir): demo tenants, keys printed once, SIGTERM stops everything (Ctrl-C is
    what stops the SmolLM2 platform in test_platform.py). Run 2 (same state dir): no keys printed, the
    first key still works; then the worker dies: `fairshare up` stops the rest and exits non-zero."""
    state = tmp_path / "state"
    up = start_up(state, model="random-tiny", timeout_s=TINY_START_TIMEOUT_S)
    info = up.run_info()
    try:
        keys = up.keys
        assert set(keys) == {"acme", "globex"}, up.output[-2000:]
        tenants = {t["id"]: t for t in yaml.safe_load((state / "tenants.yaml").read_text())["tenants"]}
        assert tenants["acme"]["weight"] == 1 and tenants["globex"]["weight"] == 3
        assert stat.S_IMODE((state / "secret").stat().st_mode) == 0o600
        for k in keys.values():
            assert k not in (state / "tenants.keys.yaml").read_text()
        assert set(info["children"]) == {"redis", "worker", "gateway"}
        # the printed key works
        c = openai.OpenAI(base_url=up.base_url, api_key=keys["acme"], max_retries=0)
        resp = c.chat.completions.create(model=up.model, max_tokens=5,
                                         messages=[{"role": "user", "content": "hi"}])
        assert resp.usage.completion_tokens >= 1
    except BaseException:
        up.kill()
        raise
    assert up.stop(signal.SIGTERM) == 0, up.output[-2000:]
    assert "Traceback" not in up.output
    assert_all_stopped(up, info)
    assert not (state / "run.json").exists()

    up2 = start_up(state, model="random-tiny", timeout_s=TINY_START_TIMEOUT_S)
    info2 = up2.run_info()
    try:
        assert up2.keys == {}, up2.output[-2000:]
        assert "sk-fs-" not in up2.output
        c = openai.OpenAI(base_url=up2.base_url, api_key=keys["globex"], max_retries=0)
        assert c.models.list().data
        os.kill(info2["children"]["worker"], signal.SIGKILL)
        up2.wait(60)
    except BaseException:
        up2.kill()
        raise
    assert up2.proc.returncode == 1, up2.output[-2000:]
    assert "worker exited unexpectedly" in up2.output, up2.output[-2000:]
    assert "Traceback" not in up2.output
    assert_all_stopped(up2, info2)


@pytest.mark.parametrize("which", ["--port", "--worker-port", "--redis-port"])
def test_port_taken_is_refused_before_anything_starts(tmp_path, which):
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    ports = {"--port": free_port(), "--worker-port": free_port(), "--redis-port": free_port()}
    ports[which] = taken
    args = [x for kv in ports.items() for x in (kv[0], str(kv[1]))]
    try:
        res = subprocess.run([*fairshare_command(), "up", *args, "--state-dir", str(tmp_path / "state")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        blocker.close()
    assert res.returncode == 1, (res.stdout, res.stderr)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert str(taken) in err and "in use" in err, err
    assert "Traceback" not in res.stdout + res.stderr
    assert res.stdout == ""  # nothing started, nothing announced
    for flag, port in ports.items():
        if flag != which:
            assert not port_in_use("127.0.0.1", port), f"{flag} {port} was started"
    assert not (tmp_path / "state" / "run.json").exists()  # refused before anything was started or recorded
