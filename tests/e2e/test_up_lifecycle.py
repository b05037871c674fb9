"""`fairshare up` itself: first run, second run, Ctrl-C, a dying child, ports already taken.

These use the seeded random tiny model (starts in seconds); the SmolLM2 platform is in test_platform.py.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import time

import openai
import pytest
import yaml

from fairshare.procs import free_port, port_in_use
from tests.e2e.conftest import ROOT, assert_all_stopped, fairshare_command, kill_everything, start_up

pytestmark = pytest.mark.e2e

TINY_START_TIMEOUT_S = 180.0


def test_first_run_creates_demo_tenants_and_ctrl_c_stops_everything(tmp_path):
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
        kill_everything(up)
        raise
    assert up.stop(signal.SIGINT) == 0, up.output[-2000:]
    assert_all_stopped(up, info)
    assert not (state / "run.json").exists()

    # second run: same tenants, no new keys printed; the first key still works; SIGTERM stops it too
    up2 = start_up(state, model="random-tiny", timeout_s=TINY_START_TIMEOUT_S)
    info2 = up2.run_info()
    try:
        assert up2.keys == {}, up2.output[-2000:]
        assert "sk-fs-" not in up2.output
        c = openai.OpenAI(base_url=up2.base_url, api_key=keys["globex"], max_retries=0)
        assert c.models.list().data
    except BaseException:
        kill_everything(up2)
        raise
    assert up2.stop(signal.SIGTERM) == 0, up2.output[-2000:]
    assert_all_stopped(up2, info2)


def test_a_dying_child_stops_the_rest_and_exits_nonzero(tmp_path):
    up = start_up(tmp_path / "state", model="random-tiny", timeout_s=TINY_START_TIMEOUT_S)
    info = up.run_info()
    try:
        os.kill(info["children"]["worker"], signal.SIGKILL)
        up.proc.wait(60)
    except BaseException:
        kill_everything(up)
        raise
    if up.reader:
        up.reader.join(5)
    assert up.proc.returncode != 0
    assert "worker exited unexpectedly" in up.output, up.output[-2000:]
    assert "Traceback" not in up.output
    assert_all_stopped(up, info)


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
        t0 = time.monotonic()
        res = subprocess.run([*fairshare_command(), "up", *args, "--state-dir", str(tmp_path / "state")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
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
    assert took < 15
