"""`loadtests.up_process.UpProcess` when `fairshare up` cannot start: the error carries its output.

(The started platform is covered by tests/e2e, which start it through this class, and by
`fairshare loadtest` in test_loadtest_noisy_neighbour.py.)
"""

from __future__ import annotations

import socket

import pytest

from loadtests.up_process import UpNotReady, UpProcess


def test_exit_before_the_banner_raises_with_its_output_and_logs_it(tmp_path):
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    up = UpProcess(tmp_path / "state", model="random-tiny", log_path=tmp_path / "logs" / "up.log")
    assert len({up.port, up.worker_port, up.redis_port}) == 3
    up.port = blocker.getsockname()[1]  # `fairshare up` checks its ports before starting anything
    try:
        with pytest.raises(UpNotReady) as err:
            up.start(timeout_s=60)
    finally:
        blocker.close()
    msg = str(err.value)
    assert "exited with 1 before it was ready" in msg and f"port {up.port}" in msg and "in use" in msg, msg
    assert up.proc is not None and up.proc.returncode == 1
    assert up.keys == {} and up.model == ""
    assert f"port {up.port}" in (tmp_path / "logs" / "up.log").read_text()
    assert up.stop() == 1  # already exited: stop only reports its status
