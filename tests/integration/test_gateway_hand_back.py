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


class FullWorker:
    """The first request streaming on one of the two workers, that worker held right after its first
    token with its one slot taken (`full`); the other worker free (`other`)."""

    def __init__(self, gateway_factory, workers: list[str], tenant: str) -> None:
        self.controls = {addr: WorkerControl(addr) for addr in workers}
        for c in self.controls.values():
            c.reset()
            c.hold_when("token", tenant=tenant, count=1)  # whichever runs the first request holds after its token
        self.gw = gateway_factory([{"id": tenant, "limits": {"tpm": 100000}}], workers=workers,
                                  health_interval_s=30.0, metrics_token=METRICS_TOKEN)
        self.client = self.gw.client(tenant)
        self.first: dict = {}
        self.holder = threading.Thread(target=self._hold_the_slot, daemon=True)
        self.holder.start()
        wait_for(lambda: any(c.state()["held"] for c in self.controls.values()),
                 "a worker held after the first request's first token")
        self.full = next(addr for addr, c in self.controls.items() if c.state()["held"])
        self.other = next(addr for addr in workers if addr != self.full)
        self.controls[self.other].reset()  # disarm its hold: a handed-back request runs there to its end
        assert self.controls[self.full].tenant_load(tenant)["running"] == 1

    def _hold_the_slot(self) -> None:  # streams until the test releases the worker it runs on
        stream = self.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, stream=True)
        self.first["chunks"] = list(stream)

    def metrics(self) -> str:
        return httpx.get(self.gw.base_url + "/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}).text

    def release_and_finish(self, tenant: str) -> None:
        """Release the full worker; the first request runs to its end; the tenant's leases are released."""
        self.controls[self.full].reset()
        self.holder.join(120)
        assert not self.holder.is_alive(), "the first stream never ended after its worker was released"
        assert self.first["chunks"][-1].choices[0].finish_reason == "length"
        wait_for(lambda: self.gw.leases(tenant) == {}, "the tenant's in-flight leases released")

    def close(self) -> None:
        for c in self.controls.values():
            c.reset()
            c.close()


def test_a_request_handed_back_completes_on_the_other_worker(gateway_factory, two_workers):
    pool = FullWorker(gateway_factory, two_workers, "hb")
    try:
        full, other, controls = pool.full, pool.other, pool.controls
        r = pool.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)

        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
        assert r.choices[0].message.content is not None
        on_full = controls[full].requests(tenant="hb")
        on_other = controls[other].requests(tenant="hb")
        (handed,) = [e for e in on_full.values() if e.admit is None]  # the second request, never admitted there
        assert handed.tokens == [] and controls[full].tenant_load("hb")["waiting"] == 0
        (ran,) = on_other.values()
        assert ran.request_id.startswith(handed.request_id) and ran.reason == "length" and len(ran.tokens) == 5
        metrics = pool.metrics()
        assert f'fairshare_gateway_hand_backs_total{{worker="{full}"}} 1.0' in metrics
        assert "fairshare_gateway_worker_retries_total{" not in metrics  # a hand-back is no failure
        ready = pool.gw.readyz()
        assert all(w["healthy"] for w in ready["workers"])  # the full worker was not marked failed
        pool.release_and_finish("hb")
    finally:
        pool.close()


def test_a_handed_back_request_whose_other_worker_fails_waits_where_it_was(gateway_factory, two_workers):
    """The other worker fails it before its first token: no worker is left but the one that handed it
    back, which is healthy, so the request goes back there (not to be handed back again) and runs once
    a slot frees."""
    pool = FullWorker(gateway_factory, two_workers, "hb-fail")
    try:
        full, other, controls = pool.full, pool.other, pool.controls
        controls[other].inject("error_after", tenant="hb-fail", after=0, times=1)  # INTERNAL before its first token
        second: dict = {}

        def send() -> None:
            second["r"] = pool.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)

        t = threading.Thread(target=send, daemon=True)
        t.start()
        back = lambda: [e for e in controls[full].requests(tenant="hb-fail").values() if e.admit is None]  # noqa: E731
        wait_for(lambda: len(back()) == 2, lambda: f"the second request back on the full worker; arrivals there: "
                 f"{[e.request_id for e in back()]}")
        # The failed attempt leaves nothing running on the other worker. Its abort reaches that engine's
        # thread after the stream has already ended, so this waits on the engine state, not a snapshot.
        gone = lambda: (controls[other].tenant_load("hb-fail") or {"running": 0, "waiting": 0})  # noqa: E731
        wait_for(lambda: not any(gone()[k] for k in ("running", "waiting")),  # one GetLoad a poll
                 lambda: f"the failed attempt gone from the other worker; its load there: {gone()}")
        pool.release_and_finish("hb-fail")
        t.join(120)
        assert not t.is_alive(), "the second request never finished after the full worker was released"
        r = second["r"]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
        metrics = pool.metrics()
        assert f'fairshare_gateway_hand_backs_total{{worker="{full}"}} 1.0' in metrics
        assert f'fairshare_gateway_worker_retries_total{{worker="{other}"}} 1.0' in metrics
    finally:
        pool.close()
