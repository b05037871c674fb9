"""Hand-back through a real gateway and two real workers (worker/scheduling/handback.py,
gateway/routing.py): a request queued on a full worker, never admitted there, is handed back and
completes on the other worker; the official `openai` client sees one normal completion (no error,
no duplicate token), the worker that handed it back stays healthy and no retry is counted.

The full worker is made full by construction: one running slot (`--max-running 1`), taken by a
stream that the test control holds right after its first token (the engine then schedules nothing,
but it still asks the hand-back rule every iteration)."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.conftest import start_worker, stop_worker
from tests.support.control_client import WorkerControl
from tests.support.waits import wait_for

MODEL = "random-tiny"
MESSAGES = [{"role": "user", "content": "Hand it back"}]  # the same prompt: the same home worker
METRICS_TOKEN = "hand-back-metrics-token"


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Two test workers with one running slot each that hand back after 0.2 s in the queue."""
    d = tmp_path_factory.mktemp("hand-back")
    started = [start_worker("--max-running", "1", "--hand-back-after-s", "0.2", log_path=d / f"w{i}.log")
               for i in range(2)]
    yield [addr for _, addr in started]
    for proc, _ in started:
        stop_worker(proc)


def test_a_request_handed_back_completes_on_the_other_worker(gateway_factory, two_workers):
    controls = {addr: WorkerControl(addr) for addr in two_workers}
    try:
        for c in controls.values():
            c.reset()
            c.hold_when("token", tenant="hb", count=1)  # whichever runs the first request holds after its token
        gw = gateway_factory([{"id": "hb", "limits": {"tpm": 100000}}], workers=two_workers, health_interval_s=30.0,
                             metrics_token=METRICS_TOKEN)
        client = gw.client("hb")
        first: dict = {}

        def hold_the_slot() -> None:  # streams until the test releases the worker it runs on
            stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, stream=True)
            first["chunks"] = list(stream)

        holder = threading.Thread(target=hold_the_slot, daemon=True)
        holder.start()
        wait_for(lambda: any(c.state()["held"] for c in controls.values()),
                 "a worker held after the first request's first token")
        full = next(addr for addr, c in controls.items() if c.state()["held"])
        other = next(addr for addr in two_workers if addr != full)
        controls[other].reset()  # disarm its hold: the handed-back request runs there to its end
        assert controls[full].tenant_load("hb")["running"] == 1

        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)

        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
        assert r.choices[0].message.content is not None
        on_full = controls[full].requests(tenant="hb")
        on_other = controls[other].requests(tenant="hb")
        (handed,) = [e for e in on_full.values() if e.admit is None]  # the second request, never admitted there
        assert handed.tokens == [] and controls[full].tenant_load("hb")["waiting"] == 0
        (ran,) = on_other.values()
        assert ran.request_id.startswith(handed.request_id) and ran.reason == "length" and len(ran.tokens) == 5
        metrics = httpx.get(gw.base_url + "/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}).text
        assert f'fairshare_gateway_hand_backs_total{{worker="{full}"}} 1.0' in metrics
        assert "fairshare_gateway_worker_retries_total{" not in metrics  # a hand-back is no failure
        ready = httpx.get(gw.base_url + "/readyz").json()
        assert all(w["healthy"] for w in ready["workers"])  # the full worker was not marked failed

        controls[full].reset()  # the first request runs to its end
        holder.join(120)
        assert not holder.is_alive(), "the first stream never ended after its worker was released"
        assert first["chunks"][-1].choices[0].finish_reason == "length"
        wait_for(lambda: gw.leases("hb") == {}, "the tenant's in-flight leases released")
    finally:
        for c in controls.values():
            c.reset()
            c.close()
