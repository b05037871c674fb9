"""The test-control service of the test worker (tests/support/worker_main.py): hold the engine, inject
faults, read the engine's own event log. Test-only; `fairshare worker` never loads it.

It is installed through the worker's extension point (`worker.server.serve(configure=...)`) and
wraps, on that one process's objects:

- `engine.scheduler.schedule`: while the engine is *held* it schedules nothing, yet every iteration
  still drains the engine's inbox, so new requests appear as ``waiting`` in GetLoad and aborts are
  carried out (their blocks freed). A hold can be armed to engage by itself right after the N-th
  committed token (of each of M requests) or finished request of a tenant (`HoldWhen`), on the
  engine thread, so that the engine stops at an exact point of the work whatever the machine's speed.
- `engine.runner.forward`: raises on its N-th call, or when its batch holds a request of a given
  tenant / id (optionally once that request has N output tokens): the engine's real failure path.
- `engine.abort` and `engine.recorder`: an ordered event log (arrival, admit, token, abort_requested,
  finish, held, released, and ``fault``: an injected forward failure, with the request ids of its
  batch) with the engine's clock (``time.monotonic``) and one sequence number across
  all kinds, so tests assert on order ("no token after the cancel reached the worker") instead of time.
- the servicer's `Generate`: per matching request (tenant and/or prompt text), refuse it with
  INVALID_ARGUMENT (``reject``: a refusal after the gateway admitted it), fail it with INTERNAL after
  N output messages (``error_after``: an upstream error mid-stream), or stop relaying after N messages
  until released or cancelled (``stall_after``: a stream that stays open, for gateway-side tests).

The service, ``fairshare.test.v1.Control``, is plain generic gRPC with JSON payloads (no .proto);
its client is `tests.support.control_client.WorkerControl`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections import deque

import grpc

SERVICE = "fairshare.test.v1.Control"
MAX_EVENTS = 500_000
SERVICER_FAULTS = ("reject", "error_after", "stall_after")


def _dumps(obj) -> bytes:
    return json.dumps(obj).encode()


def _loads(data: bytes):
    return json.loads(data or b"{}")


class _Recorder:
    """The engine's recorder (worker/engine/engine.py's hooks): logs events and fires hold triggers;
    forwards every hook to the recorder the engine had before, if any."""

    def __init__(self, control: "TestControl", inner) -> None:
        self.control = control
        self.inner = inner

    def _forward(self, name: str, *args) -> None:
        if self.inner is not None:
            getattr(self.inner, name)(*args)

    def on_arrival(self, request_id, tenant_id, weight, arrival_time, prompt_tokens, max_tokens, *rest) -> None:
        self.control.tenant_of[request_id] = tenant_id
        self.control.record("arrival", request_id, arrival_time, prompt_tokens=prompt_tokens, max_tokens=max_tokens)
        self._forward("on_arrival", request_id, tenant_id, weight, arrival_time, prompt_tokens, max_tokens, *rest)

    def on_admit(self, request_id, t, *rest) -> None:
        self.control.record_admit(request_id, t)
        self._forward("on_admit", request_id, t, *rest)

    def on_token(self, request_id, t, units, *rest) -> None:
        self.control.record("token", request_id, t)
        self.control.fire("token", request_id)
        self._forward("on_token", request_id, t, units, *rest)

    def on_finish(self, request_id, t, reason, *rest) -> None:
        self.control.record("finish", request_id, t, reason=reason)
        self.control.fire("finish", request_id)
        self._forward("on_finish", request_id, t, reason, *rest)

    def __getattr__(self, name: str):  # other hooks (on_step, on_prefill_charge, later ones): forwarded only
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda *args: self._forward(name, *args)


class TestControl:
    """State and wrappers of the test-control service for one engine and its servicer."""

    def __init__(self, engine, servicer) -> None:
        self.engine = engine
        self.servicer = servicer
        self.clock = engine.clock
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self.events: deque = deque(maxlen=MAX_EVENTS)
        self.tenant_of: dict[str, str] = {}
        self._admitted: set[str] = set()
        self.held = False
        self.triggers: list[dict] = []
        self.forward_faults: list[dict] = []
        self.servicer_faults: list[dict] = []
        self.forward_calls = 0
        self._chunks: list = []
        self._stall_rules: list[dict] = []  # every stall rule not released yet (matched or not)
        self._install()

    # ---- wrappers -----------------------------------------------------------------------------
    def _install(self) -> None:
        engine = self.engine
        schedule, forward, abort = engine.scheduler.schedule, engine.runner.forward, engine.abort

        def held_schedule(*args, **kwargs):
            if self.held:
                self._chunks = []
                return []
            chunks = schedule(*args, **kwargs)
            self._chunks = list(chunks)
            return chunks

        def faulty_forward(items, *args, **kwargs):
            self.forward_calls += 1
            fault = self._forward_fault()
            if fault is not None:
                self.record("fault", "", self.clock(), request_ids=[c.seq.request_id for c in self._chunks])
                raise RuntimeError(f"injected test fault: model forward failed ({fault})")
            return forward(items, *args, **kwargs)

        def logged_abort(request_id: str) -> bool:
            self.record("abort_requested", request_id, self.clock())
            return abort(request_id)

        engine.scheduler.schedule = held_schedule
        engine.runner.forward = faulty_forward
        engine.abort = logged_abort
        engine.recorder = _Recorder(self, engine.recorder)
        inner_generate = self.servicer.Generate

        async def generate(request, context):
            rule = self._servicer_fault(request)
            if rule is not None and rule["kind"] == "reject":
                self.record("rejected", request.request_id, self.clock(), tenant=request.tenant.id)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "injected test fault: request rejected")
            stream = inner_generate(request, context)
            sent = 0
            try:
                async for msg in stream:
                    if rule is not None and sent >= rule["after"]:
                        if rule["kind"] == "error_after":
                            await context.abort(grpc.StatusCode.INTERNAL, "injected test fault: error mid-stream")
                        if rule["kind"] == "stall_after":
                            if not rule["released"].is_set():
                                self.record("stalled", request.request_id, self.clock(), tenant=request.tenant.id)
                                await rule["released"].wait()
                            rule = None  # released: relay the rest
                    yield msg
                    sent += 1
            finally:
                await stream.aclose()  # the servicer's own clean-up: aborts the engine request if unfinished

        self.servicer.Generate = generate

    # ---- events and triggers (engine thread and server thread) ---------------------------------
    def record(self, kind: str, request_id: str, t: float, **extra) -> None:
        with self._lock:
            tenant = extra.pop("tenant", None) or self.tenant_of.get(request_id)
            self.events.append({"seq": next(self._seq), "t": t, "kind": kind, "request_id": request_id,
                                "tenant": tenant, **extra})

    def record_admit(self, request_id: str, t: float) -> None:
        if request_id not in self._admitted:  # the engine calls on_admit at every step of a request
            self._admitted.add(request_id)
            self.record("admit", request_id, t)

    def fire(self, kind: str, request_id: str) -> None:
        """Count `kind` events for the armed hold triggers; engage the hold when one is reached: for
        "token", once `requests` of the tenant's requests each have `count` tokens since arming; for
        "finish", at the tenant's `count`-th finished request."""
        tenant = self.tenant_of.get(request_id)
        engaged = False
        with self._lock:
            for trig in list(self.triggers):
                if trig["event"] != kind or (trig["tenant"] is not None and trig["tenant"] != tenant):
                    continue
                if kind == "token":
                    per = trig["per_request"]
                    per[request_id] = per.get(request_id, 0) + 1
                    engaged = sum(1 for n in per.values() if n >= trig["count"]) >= trig["requests"]
                else:
                    trig["seen"] += 1
                    engaged = trig["seen"] >= trig["count"]
                if engaged:
                    self.triggers.remove(trig)
                    self.held = True
                    break
        if engaged:
            self.record("held", request_id, self.clock(), trigger=kind)

    def _forward_fault(self) -> str | None:
        with self._lock:
            for rule in list(self.forward_faults):
                if rule["nth"] is not None:
                    rule["calls"] += 1
                    hit = rule["calls"] == rule["nth"]
                else:
                    hit = any(self._chunk_matches(rule, c.seq) for c in self._chunks)
                if hit:
                    rule["times"] -= 1
                    if rule["times"] <= 0:
                        self.forward_faults.remove(rule)
                    return json.dumps({k: rule[k] for k in ("tenant", "request_id", "nth", "after") if rule[k]})
        return None

    @staticmethod
    def _chunk_matches(rule: dict, seq) -> bool:
        return ((rule["tenant"] is None or seq.tenant_id == rule["tenant"])
                and (rule["request_id"] is None or seq.request_id == rule["request_id"])
                and len(seq.output_token_ids) >= rule["after"])

    def _servicer_fault(self, request) -> dict | None:
        text = None
        with self._lock:
            for rule in list(self.servicer_faults):
                if rule["tenant"] is not None and request.tenant.id != rule["tenant"]:
                    continue
                if rule["prompt_contains"] is not None:
                    if text is None:
                        text = self._prompt_text(request)
                    if rule["prompt_contains"] not in text:
                        continue
                if rule["times"] is not None:
                    rule["times"] -= 1
                    if rule["times"] <= 0:
                        self.servicer_faults.remove(rule)
                return rule  # (a stall rule's `released` event is shared by the requests it stalls)
        return None

    def _prompt_text(self, request) -> str:
        tok = getattr(self.engine.model, "tokenizer", None)
        return "" if tok is None else tok.decode(list(request.prompt_token_ids), skip_special_tokens=False)

    def _wake(self) -> None:
        wake = getattr(self.engine, "_wake", None)  # the loop's idle wait: end it now
        if wake is not None:
            wake.set()

    # ---- the RPCs ------------------------------------------------------------------------------
    def state(self, _req=None) -> dict:
        with self._lock:
            return {"held": self.held, "triggers": len(self.triggers), "forward_faults": len(self.forward_faults),
                    "servicer_faults": len(self.servicer_faults), "forward_calls": self.forward_calls,
                    "events": len(self.events), "now": self.clock()}

    def hold(self, _req=None) -> dict:
        with self._lock:
            self.held = True
        self.record("held", "", self.clock(), trigger="rpc")
        return self.state()

    def release(self, _req=None) -> dict:
        with self._lock:
            was, self.held = self.held, False
        if was:
            self.record("released", "", self.clock())
        self._wake()
        return self.state()

    def hold_when(self, req: dict) -> dict:
        event, count, requests = req.get("event", "token"), int(req.get("count", 1)), int(req.get("requests", 1))
        if event not in ("token", "finish") or count < 1 or requests < 1:
            raise ValueError(f"hold_when: event must be token or finish, count and requests >= 1; got {req}")
        with self._lock:
            self.triggers.append({"event": event, "tenant": req.get("tenant"), "count": count, "requests": requests,
                                  "seen": 0, "per_request": {}})
        return self.state()

    def inject(self, req: dict) -> dict:
        kind = req.get("kind")
        times = req.get("times")
        if kind == "forward_error":
            rule = {"tenant": req.get("tenant"), "request_id": req.get("request_id"), "nth": req.get("nth"),
                    "after": int(req.get("after", 0)), "times": int(times or 1), "calls": 0}
            with self._lock:
                self.forward_faults.append(rule)
        elif kind in SERVICER_FAULTS:
            rule = {"kind": kind, "tenant": req.get("tenant"), "prompt_contains": req.get("prompt_contains"),
                    "after": int(req.get("after", 0)), "times": None if times is None else int(times),
                    "released": asyncio.Event()}  # (created and set on the server's event loop)
            with self._lock:
                self.servicer_faults.append(rule)
                if kind == "stall_after":
                    self._stall_rules.append(rule)
        else:
            raise ValueError(f"inject: unknown kind {kind!r} (forward_error, {', '.join(SERVICER_FAULTS)})")
        return self.state()

    def release_stalled(self, _req=None) -> dict:
        """Resume every stream a stall rule stopped (or is about to stop) and disarm the stall rules."""
        with self._lock:
            self.servicer_faults = [r for r in self.servicer_faults if r["kind"] != "stall_after"]
            rules, self._stall_rules = self._stall_rules, []
        for rule in rules:
            rule["released"].set()
        return self.state()

    def reset(self, _req=None) -> dict:
        self.release_stalled()
        with self._lock:
            self.triggers.clear()
            self.servicer_faults.clear()
            self.forward_faults.clear()
            self.events.clear()
        return self.release()

    def events_of(self, req: dict) -> dict:
        tenant, rid, since = req.get("tenant"), req.get("request_id"), int(req.get("since", -1))
        with self._lock:
            out = [e for e in self.events if e["seq"] > since and (tenant is None or e["tenant"] == tenant)
                   and (rid is None or e["request_id"] == rid)]
        return {"events": out}


def install(server, engine, servicer) -> TestControl:
    """`serve(configure=...)` hook: wrap `engine` and `servicer` and add the Control service to `server`."""
    control = TestControl(engine, servicer)
    methods = {"State": control.state, "Hold": control.hold, "Release": control.release,
               "HoldWhen": control.hold_when, "Inject": control.inject, "ReleaseStalled": control.release_stalled,
               "Reset": control.reset, "Events": control.events_of}

    def handler(fn):
        async def call(request, context):
            try:
                return fn(request)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=_loads, response_serializer=_dumps)

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {name: handler(fn) for name, fn in methods.items()}),))
    print(f"test control service {SERVICE} installed (tests/support/worker_control.py)", flush=True)
    return control
