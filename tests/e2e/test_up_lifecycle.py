"""`fairshare up` itself: first run, second run, Ctrl-C, a dying child restarted, edits of the
tenants file announced, ports already taken (all reported at once).

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

from fairshare.ports import free_port, port_in_use
from tests.e2e.conftest import ROOT, fairshare_command, start_up, stop_cleanly


def write_atomically(path, text: str) -> None:
    """Replace `path` with `text` in one step (temporary file, then os.replace), as an editor or a
    config tool does: the gateway's reload never sees a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

pytestmark = pytest.mark.e2e

TINY_START_TIMEOUT_S = 180.0


def test_first_run_second_run_sigterm_and_a_dying_child(tmp_path):
    """Run 1 (fresh state dir): demo tenants, keys printed once, SIGTERM stops everything (Ctrl-C is
    what stops the SmolLM2 platform in test_platform.py). Run 2 (same state dir): no keys printed, the
    first key still works; the worker dies and is restarted (announced in one line each way), a
    broken edit of the tenants file is refused with a notice and the fix is taken; SIGTERM stops
    everything. (Three deaths in the window stopping everything: test_up_supervision.py.)"""
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
        assert set(info["metrics"]) == {"gateway", "workers"}
        assert "metrics (loopback): gateway http://127.0.0.1:" in up.output and "fairshare top" in up.output
        # the printed key works
        c = openai.OpenAI(base_url=up.base_url, api_key=keys["acme"], max_retries=0)
        resp = c.chat.completions.create(model=up.model, max_tokens=5,
                                         messages=[{"role": "user", "content": "hi"}])
        assert resp.usage.completion_tokens >= 1
    except BaseException:
        up.kill()
        raise
    stop_cleanly(up, info)
    assert not (state / "run.json").exists()

    up2 = start_up(state, model="random-tiny", timeout_s=TINY_START_TIMEOUT_S)
    info2 = up2.run_info()
    try:
        assert up2.keys == {}, up2.output[-2000:]
        assert "sk-fs-" not in up2.output
        c = openai.OpenAI(base_url=up2.base_url, api_key=keys["globex"], max_retries=0)
        assert c.models.list().data
        os.kill(info2["children"]["worker"], signal.SIGKILL)
        died = up2.wait_for_line("the worker died", 60, "the notice of the worker's death")
        assert "killed by SIGKILL (signal 9); restarting it in" in died, died
        back = up2.wait_for_line("the worker is back", 300, "the worker's restart")
        info3 = up2.run_info()
        assert info3["children"]["worker"] != info2["children"]["worker"] and f"pid {info3['children']['worker']}" in back
        resp = c.chat.completions.create(model=up2.model, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert resp.usage.completion_tokens >= 1
        # the gateway reloads the tenants file live; a broken edit is refused, with a notice here
        tenants_file = state / "tenants.yaml"
        good = tenants_file.read_text()
        write_atomically(tenants_file, "tenants:\n  - id: [unclosed\n")
        refused = up2.wait_for_line("the gateway rejected an edit of the tenants/keys files", 60,
                                    "the notice of the rejected edit")
        assert "keeping the previous configuration" in refused and "\n" not in refused
        assert c.models.list().data  # still served with the previous tenants
        more = yaml.safe_load(good)
        more["tenants"].append({"id": "initech", "weight": 2.0})
        write_atomically(tenants_file, yaml.safe_dump(more, sort_keys=False))
        reloaded = up2.wait_for_line("the gateway reloaded", 60, "the notice of the accepted edit")
        assert "3 tenant(s)" in reloaded, reloaded
    except BaseException:
        up2.kill()
        raise
    stop_cleanly(up2, info3)


@pytest.mark.parametrize("which", [("--port",), ("--worker-port", "--redis-port"),
                                   ("--port", "--gateway-metrics-port", "--worker-metrics-port")])
def test_taken_ports_are_refused_at_once_before_anything_starts(tmp_path, which):
    blockers, taken = [], {}
    for flag in which:
        b = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        b.bind(("127.0.0.1", 0))
        b.listen()
        blockers.append(b)
        taken[flag] = b.getsockname()[1]
    ports = {"--port": free_port(), "--worker-port": free_port(), "--redis-port": free_port()}
    ports.update(taken)
    args = [x for kv in ports.items() for x in (kv[0], str(kv[1]))]
    try:
        res = subprocess.run([*fairshare_command(), "up", *args, "--state-dir", str(tmp_path / "state")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        for b in blockers:
            b.close()
    assert res.returncode == 1, (res.stdout, res.stderr)
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "in use" in err, err
    for flag, port in taken.items():  # every taken port in the one line, with the flag to change
        assert f"{port} on 127.0.0.1" in err and f"pass {flag} N" in err, err
    assert "Traceback" not in res.stdout + res.stderr
    assert res.stdout == ""  # nothing started, nothing announced
    for flag, port in ports.items():
        if flag not in taken:
            assert not port_in_use("127.0.0.1", port), f"{flag} {port} was started"
    assert not (tmp_path / "state" / "run.json").exists()  # refused before anything was started or recorded
