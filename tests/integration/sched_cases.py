"""Shared helpers of the scheduling cases on the real worker over gRPC (SC3, SC4, SC5).

States are reached by construction: the work is sized in tokens so that a state, once reached,
lasts for many iterations (e.g. 256-token outputs hold their slots for 256 iterations), and the
tests wait on the worker's own state (`GetLoad`) with a wait that fails naming the state that
never came. Orders of events across streams are read from the engine iteration each message carries
(`Timings.iteration`), never from wall-clock times.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field

import grpc

from fairshare.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import start_worker, stop_worker
from tests.support import waits
from tests.support.auth import signed_channel

TIER = {"interactive": worker_pb2.TIER_INTERACTIVE, "batch": worker_pb2.TIER_BATCH,
        "background": worker_pb2.TIER_BACKGROUND}
WAIT_S = 300.0  # a generous bound: the waits end as soon as the state is there


def request(tenant: str, tier: str, prompt: list[int], max_tokens: int, weight: float = 1.0):
    return worker_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        tenant=worker_pb2.Tenant(id=tenant, weight=weight, tier=TIER[tier]),
        prompt_token_ids=prompt,
        sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def prompt(n: int, seed: int) -> list[int]:
    """`n` token ids, distinct per seed (no two requests share a cached prefix)."""
    return [100 + seed % 20000] + [1 + (seed * 7 + 13 * j) % 30000 for j in range(1, n)]


@dataclass
class Stream:
    """One Generate call read on its own thread. messages: (tokens, engine iteration) per message."""

    stub: object
    req: object
    messages: list = field(default_factory=list)
    first_token_iterations: int | None = None
    first_token_s: float | None = None
    finish_reason: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        self.call = self.stub.Generate(self.req)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                if msg.token_ids:
                    self.messages.append((len(msg.token_ids), msg.timings.iteration))
                    if self.first_token_iterations is None:
                        self.first_token_iterations = msg.timings.first_token_iterations
                        self.first_token_s = msg.timings.first_token_s
                if msg.finish_reason:
                    self.finish_reason = msg.finish_reason
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = f"{exc.code()}: {exc.details()}"

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.messages)

    def first_iteration(self) -> int | None:
        """The iteration of the first token. A message of n tokens carries those of n consecutive
        iterations ending at its own (the worker coalesces up to a pause, worker/server.py)."""
        return self.messages[0][1] - self.messages[0][0] + 1 if self.messages else None

    def resumed_after_gap(self) -> int | None:
        """The iteration at which tokens came again after the longest pause (a preemption shows as
        one: its decodes stop until it is re-admitted and recomputed), or None without a pause."""
        starts = [(it - n + 1, it) for n, it in self.messages]  # (first, last) iteration of each message
        gaps = [(b0 - a1, b0) for (_, a1), (b0, _) in zip(starts, starts[1:]) if b0 - a1 > 1]
        return max(gaps)[1] if gaps else None

    def join(self, timeout_s: float = WAIT_S) -> "Stream":
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"stream {self.req.request_id} of {self.req.tenant.id} never finished"
        assert self.error is None, self.error
        return self

    def cancel(self) -> None:
        self.call.cancel()


def stub_for(addr: str):
    """A stub whose Generate/Abort calls are signed as the gateway signs them (worker authentication)."""
    return worker_pb2_grpc.WorkerStub(signed_channel(addr))


def load(stub):
    return stub.GetLoad(worker_pb2.GetLoadRequest())


def tenants(ld) -> dict:
    return {t.tenant_id: t for t in ld.tenants}


def tiers(ld) -> dict:
    names = {v: k for k, v in TIER.items()}
    return {names[t.tier]: t for t in ld.tiers}


def wait_for(stub, cond, state: str, timeout_s: float = WAIT_S):
    """GetLoad until `cond(load)` holds and return that load; fail naming `state` (and the last
    GetLoad) when it never comes (tests/support/waits.py)."""
    last = [None]

    def reached():
        last[0] = load(stub)
        return last[0] if cond(last[0]) else None

    return waits.wait_for(reached, lambda: f"the worker's state: {state}; last GetLoad:\n{last[0]}", timeout_s)


def worker(tmp_path_factory, name: str, *flags: str):
    """Start `fairshare worker --model random-tiny FLAGS` (a fixture body: yields the address)."""
    log = tmp_path_factory.mktemp(name) / "worker.log"
    proc, addr = start_worker(*flags, log_path=log)
    try:
        yield addr
    finally:
        stop_worker(proc)


def cancel_all(stub, streams: list[Stream]) -> None:
    """Cancel every stream and wait until the worker holds nothing (every KV block freed)."""
    for s in streams:
        s.cancel()
    for s in streams:
        s.thread.join(60)
    wait_for(stub, lambda ld: ld.running == 0 and ld.waiting == 0 and ld.kv_blocks_used == 0,
             "idle after cancelling every stream (no KV block leaked)")
