"""`fairshare up --workers 2`: two worker children behind one gateway, each supervised on its own, and
the worker-auth key the state directory holds (fairshare/worker_auth.py).

While worker-1 is dead (the supervisor held with SIGSTOP, so it stays dead while the test looks),
every request is answered by worker-2; once resumed, the supervisor restarts worker-1 and announces
it back only when the gateway routes to it again. A raw gRPC call to a worker without the gateway's
token is refused: `fairshare up` wired the key into both tiers.
"""

from __future__ import annotations

import os
import signal
import stat

import grpc
import openai
import pytest

from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from fairshare.cli.up import METRICS_TOKEN_FILE
from tests.conftest import readyz_detail
from tests.e2e.conftest import assert_all_stopped, start_up
from tests.reliability.conftest import wait_until

pytestmark = pytest.mark.e2e


def routed(up) -> dict[str, bool]:
    """The gateway's workers, as `fairshare up`'s metrics token reads them in /readyz: addr -> usable."""
    token = (up.state_dir / METRICS_TOKEN_FILE).read_text().strip()
    return {w["addr"]: w["healthy"] and w["agrees"] for w in readyz_detail(up.url, token)["workers"]}


def finished(addr: str, tenant: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        load = pb_grpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10)
    return next((t.finished for t in load.tenants if t.tenant_id == tenant), 0)


def test_two_workers_supervised_apart_and_worker_auth_wired(tmp_path, monkeypatch):
    # least-loaded routing takes turns between idle workers, so sequential requests go to both by
    # construction (the default, fair, keeps a prompt on the worker that has its prefix cached)
    monkeypatch.setenv("FAIRSHARE_ROUTING", "least-loaded")
    state = tmp_path / "state"
    up = start_up(state, "--restart-window-s", "600", model="random-tiny", timeout_s=300, workers=2)
    info = up.run_info()
    try:
        w1, w2 = up.worker_addrs
        assert set(info["children"]) == {"redis", "worker-1", "worker-2", "gateway"}
        assert info["ports"]["workers"] == [up.worker_port, up.worker_port + 1]
        assert len(info["metrics"]["workers"]) == 2
        assert routed(up) == {w1: True, w2: True}
        keys = state / "worker-keys"
        assert stat.S_IMODE(keys.stat().st_mode) == 0o600
        # a raw call to a worker, without the gateway's token: refused, nothing scheduled
        with grpc.insecure_channel(w1) as ch:
            req = pb.GenerateRequest(request_id="raw", tenant=pb.Tenant(id="intruder", weight=100.0),
                                     prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=2))
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.WorkerStub(ch).Generate(req, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        tenant = next(iter(up.keys))
        client = openai.OpenAI(base_url=up.base_url, api_key=up.keys[tenant], max_retries=0, timeout=120)

        def ask() -> None:
            r = client.chat.completions.create(model=up.model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
            assert r.choices[0].finish_reason == "length"

        for _ in range(4):
            ask()
        assert finished(w1, tenant) >= 1 and finished(w2, tenant) >= 1  # routed over both

        # worker-1 dies; the supervisor is held so that it stays dead while we look
        os.kill(up.proc.pid, signal.SIGSTOP)
        try:
            os.kill(info["children"]["worker-1"], signal.SIGKILL)
            wait_until(lambda: routed(up)[w1] is False, "the gateway stops routing to the dead worker-1")
            before = finished(w2, tenant)
            for _ in range(4):
                ask()  # all answered by worker-2
            assert finished(w2, tenant) == before + 4
        finally:
            os.kill(up.proc.pid, signal.SIGCONT)
        back = up.wait_for_line("the worker-1 is back", timeout_s=300, what="worker-1 restarted")
        assert "the gateway routes to it again" in back
        assert routed(up) == {w1: True, w2: True}
        assert "worker-2 died" not in up.output
        new_pid = up.run_info()["children"]["worker-1"]
        assert new_pid != info["children"]["worker-1"]
        ask()
        info = up.run_info()  # (the restarted worker's pid)
    finally:
        rc = up.stop()
    assert rc == 0, up.output[-3000:]
    assert_all_stopped(up, info)
