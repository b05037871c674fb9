"""The gateway's measured output rate and remaining-time estimates (gateway/progress.py), and the
worker pool's retry hint while no worker serves a model (gateway/routing.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from gateway.progress import OutputRates
from gateway.routing import WorkerClient, WorkerPool


@dataclass
class Job:
    max_tokens: int
    completion_tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None
    first_tokens: int = 0


def test_rate_is_a_moving_mean_of_finished_streams():
    r = OutputRates(alpha=0.5)
    assert r.rate("m") is None and r.seconds_for("m", 100) is None
    r.observe("m", 100, 1.0)
    assert r.rate("m") == 100
    r.observe("m", 100, 2.0)  # 50 tokens/s
    assert r.rate("m") == pytest.approx(75)
    r.observe("m", 2, 0.001)  # too few tokens to measure: ignored
    assert r.rate("m") == pytest.approx(75) and r.rates() == {"m": pytest.approx(75)}


def test_jobs_are_measured_from_their_first_token_and_remaining_is_the_slowest_choice():
    r = OutputRates()
    # first message carried 3 tokens at t=10, 103 tokens in all by t=11: 100 tokens in 1 s
    r.observe_jobs("m", [Job(200, completion_tokens=103, first_at=10.0, last_at=11.0, first_tokens=3),
                         Job(200)])  # a choice that never started is not measured
    assert r.rate("m") == 100
    assert r.remaining_s("m", [Job(300, completion_tokens=250), Job(300, completion_tokens=100)]) == pytest.approx(2.0)
    assert r.remaining_s("m", [Job(300, completion_tokens=300)]) == 0
    assert r.remaining_s("other", [Job(300)]) is None


def _usable(addr: str, model: str) -> WorkerClient:
    from fairshare.v1 import worker_pb2 as pb

    w = WorkerClient(addr)
    w.healthy, w.agrees, w.info = True, True, pb.ModelInfo(model_name=model)
    return w


def test_no_worker_hint_is_the_rest_of_the_last_outage_never_below_the_poll_interval():
    pool = WorkerPool([], health_interval_s=1.0)
    w = _usable("w0", "m")
    pool.workers = [w]
    pool._gauge(w)
    assert pool.retry_after_s("m") == 1.0  # no outage seen
    pool.mark_failed(w, "gone")
    assert w.down_since is not None
    assert pool.retry_after_s("m") == 1.0  # no outage of this model has ended yet: the poll interval
    w.down_since -= 6.0  # it came back after 6 s ...
    w.healthy = True
    pool._gauge(w)
    assert pool.recovery_s["m"] == pytest.approx(6.0, abs=0.5) and w.down_since is None
    pool.mark_failed(w, "gone again")  # ... and is gone again: expect ~6 s
    assert 5.0 <= pool.retry_after_s("m") <= 6.5
    w.down_since = time.monotonic() - 20  # longer than last time: check back at the poll interval
    assert pool.retry_after_s("m") == 1.0
