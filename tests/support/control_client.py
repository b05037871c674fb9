"""Client of the test worker's control service (tests/support/worker_control.py).

    control = WorkerControl(addr)
    with control.held():                 # the engine schedules nothing; requests queue as `waiting`
        ...send requests, wait until GetLoad shows them...
    control.hold_when("token", tenant="t", count=8)   # hold right after t's 8th committed token
    control.inject("reject", tenant="t", times=1)     # refuse t's next request after admission
    log = control.requests(tenant="t")                # per-request view of the engine's event log

Times in events are the worker's `time.monotonic()` (CLOCK_MONOTONIC: the same clock as this
process's `time.monotonic()` on Linux); `seq` orders every event of the worker.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from fairshare.v1 import worker_pb2 as pb
from fairshare.v1 import worker_pb2_grpc as pb_grpc
from tests.support.waits import wait_for
from tests.support.worker_control import SERVICE


@dataclass
class RequestEvents:
    """One request as the worker's engine saw it. Each event is (seq, t): t on the worker's clock."""

    request_id: str
    tenant: str | None = None
    arrival: tuple[int, float] | None = None
    admit: tuple[int, float] | None = None
    tokens: list[tuple[int, float]] = field(default_factory=list)
    abort_requested: tuple[int, float] | None = None
    finish: tuple[int, float] | None = None
    reason: str | None = None

    @property
    def first_token(self) -> tuple[int, float] | None:
        return self.tokens[0] if self.tokens else None

    def tokens_after(self, seq: int) -> int:
        """Tokens committed after the event with sequence number `seq`."""
        return sum(1 for s, _ in self.tokens if s > seq)


class WorkerControl:
    """Calls the Control service of a test worker at `addr` ("host:port")."""

    def __init__(self, addr: str, timeout_s: float = 30.0) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(addr)
        self._worker = pb_grpc.WorkerStub(self._channel)

    def _call(self, method: str, **req) -> dict:
        fn = self._channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=lambda o: json.dumps(o).encode(),
                                       response_deserializer=lambda b: json.loads(b or b"{}"))
        return fn(req, timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()

    # ---- holding the engine -------------------------------------------------------------------
    def state(self) -> dict:
        """{"held", "triggers", "forward_faults", "servicer_faults", "forward_calls", "events", "now"}."""
        return self._call("State")

    def hold(self) -> dict:
        """From the next iteration on, the engine schedules nothing (it still takes in requests and aborts)."""
        return self._call("Hold")

    def release(self) -> dict:
        """Let the engine schedule again (armed `hold_when` triggers stay armed)."""
        return self._call("Release")

    @contextmanager
    def held(self):
        self.hold()
        try:
            yield self
        finally:
            self.release()

    def hold_when(self, event: str = "token", tenant: str | None = None, count: int = 1, requests: int = 1) -> dict:
        """Arm a one-shot hold that engages on the engine thread, in the iteration that reaches it:
        event "token": once `requests` requests of `tenant` (None: any) have each committed `count`
        output tokens since now; "finish": at the `count`-th request of `tenant` to finish from now."""
        return self._call("HoldWhen", event=event, tenant=tenant, count=count, requests=requests)

    def run_until_tokens(self, tenant: str, requests: int, tokens: int = 1) -> None:
        """With the engine held and `requests` of `tenant`'s requests waiting: let it run until each has
        committed `tokens` tokens (they are admitted together when they fit one batch), then hold again;
        returns once held. The requests are then live on the worker, mid-generation, on any machine."""
        waiting = lambda: (self.tenant_load(tenant) or {}).get("waiting", 0)  # noqa: E731
        wait_for(lambda: waiting() >= requests, lambda: f"{requests} requests of {tenant} waiting; {waiting()} are")
        self.hold_when("token", tenant=tenant, count=tokens, requests=requests)
        self.release()
        wait_for(lambda: self.state()["held"], f"engine held after {requests} requests of {tenant} had {tokens} tokens")

    def tenant_load(self, tenant: str) -> dict | None:
        """The worker's GetLoad figures of `tenant` (waiting, running, kv_blocks, output_tokens, ...)."""
        load = self._worker.GetLoad(pb.GetLoadRequest(), timeout=self.timeout_s)
        t = next((t for t in load.tenants if t.tenant_id == tenant), None)
        if t is None:
            return None
        return {k: getattr(t, k) for k in ("waiting", "running", "kv_blocks", "output_tokens", "finished")}

    # ---- faults -------------------------------------------------------------------------------
    def inject(self, kind: str, *, tenant: str | None = None, prompt_contains: str | None = None,
               request_id: str | None = None, after: int = 0, times: int | None = None,
               nth: int | None = None) -> dict:
        """Arm a fault. Servicer faults, for requests matching `tenant` and/or `prompt_contains` (a
        substring of the decoded prompt), `times` of them (None: every one until `reset`):
        ``reject`` (INVALID_ARGUMENT before the engine sees it), ``error_after`` (INTERNAL after `after`
        messages), ``stall_after`` (no message after the first `after` until `release_stalled` or the
        client cancels). Runner fault ``forward_error``: the model forward raises on its `nth` call from
        now, or when its batch holds a request of `tenant` / `request_id` with >= `after` output tokens;
        `times` (default 1) forwards fail."""
        return self._call("Inject", kind=kind, tenant=tenant, prompt_contains=prompt_contains, request_id=request_id,
                          after=after, times=times, nth=nth)

    def release_stalled(self) -> dict:
        """Resume every stalled stream and disarm the stall rules."""
        return self._call("ReleaseStalled")

    def reset(self) -> dict:
        """Release the engine and stalled streams, disarm every trigger and fault, clear the event log."""
        return self._call("Reset")

    # ---- the event log --------------------------------------------------------------------------
    def events(self, tenant: str | None = None, request_id: str | None = None, since: int = -1) -> list[dict]:
        """Events (dicts: seq, t, kind, request_id, tenant, ...) in order, filtered."""
        return self._call("Events", tenant=tenant, request_id=request_id, since=since)["events"]

    def requests(self, tenant: str | None = None, request_id: str | None = None) -> dict[str, RequestEvents]:
        """Per-request view of `events(...)`: request id -> RequestEvents (in arrival order)."""
        out: dict[str, RequestEvents] = {}
        for e in self.events(tenant=tenant, request_id=request_id):
            rid = e["request_id"]
            if not rid:
                continue
            r = out.setdefault(rid, RequestEvents(rid, e["tenant"]))
            at = (e["seq"], e["t"])
            kind = e["kind"]
            if kind == "token":
                r.tokens.append(at)
            elif kind == "finish":
                r.finish, r.reason = at, e.get("reason")
            elif kind in ("arrival", "admit", "abort_requested"):
                if getattr(r, kind) is None:
                    setattr(r, kind, at)
        return out
