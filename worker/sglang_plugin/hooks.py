"""The hook functions and the table of SGLang 0.5.23 names they attach to.

Each hook has the calling convention of `sglang.srt.plugins.hook_registry.HookRegistry` (read from
SGLang 0.5.23's `hook_registry._wrap_fn`): BEFORE `fn(*args, **kwargs) -> (args, kwargs) | None`,
AFTER `fn(result, *args, **kwargs) -> new_result | None`, REPLACE `fn(*args, **kwargs)` (a
replaced staticmethod stays a staticmethod). `args[0]` is `self` for methods.

`HOOKS` lists every target with the parameters the hook relies on; tests/sglang checks each one
against the installed SGLang, so an SGLang upgrade that renames or reshapes a target fails loudly.

Targets (SGLang 0.5.23):

| target | type | what the hook does |
|---|---|---|
| `sglang.srt.managers.scheduler.Scheduler._add_request_to_queue(self, req, is_retracted=False)` | BEFORE | verify the tenant, enforce its namespace, lift on arrival (not for retracted requests) |
| `sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority(self, waiting_queue, running_batch=None, processed_tokens=0)` | AFTER | order the waiting queue: the core's plan for the pass, then `SchedulingCore.admission_order()` |
| `sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill(self, running_batch)` | BEFORE | one iteration of the scheduling core (`FairShareState.begin_pass`): its preemptions, carried out with SGLang's release functions, and its prefill plan |
| `sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class(self) -> type` | REPLACE | `FairSharePrefillAdder`: admits exactly the plan (tokens per request) on the room there is now, skips the rest, parks the chunk |
| `sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill(self, running_batch) -> NextBatchPlan` | AFTER | charge the prefill (uncached prompt tokens) of the new batch; planned admissions SGLang refused go back to the core's queue; retire requests aborted while waiting |
| `sglang.srt.managers.scheduler.Scheduler.process_batch_result(self, batch, result)` | AFTER | charge output tokens as `output_ids` grow; retire finished requests |
| `sglang.srt.managers.scheduler.Scheduler.get_internal_state(self, recv_req) -> GetInternalStateReqOutput` | AFTER | add the scheduler's FairShare figures (`internal_state["fairshare"]`) |
| `sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order(reqs) -> List[int]` (staticmethod) | REPLACE | retraction order: the core's victim rule (`RoomMaker.victims_in_order`: lowest tier, over-quota tenant, newest admission) |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from worker.sglang_plugin.state import FairShareState

log = logging.getLogger("fairshare.sglang_plugin")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SCHEDULE_POLICY = "sglang.srt.managers.schedule_policy.SchedulePolicy"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"

_state: FairShareState | None = None


def set_state(state: FairShareState | None) -> None:
    """Install the process's FairShare state (done by `register`; tests install their own)."""
    global _state
    _state = state


def get_state() -> FairShareState | None:
    return _state


def _arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


# ---- the hooks -----------------------------------------------------------------------------------
def before_add_request_to_queue(*args, **kwargs):
    """BEFORE `Scheduler._add_request_to_queue(self, req, is_retracted=False)`."""
    state = _state
    if state is not None:
        state.bind(args[0] if args else None)
        req = _arg(args, kwargs, 1, "req")
        state.on_arrival(req, bool(_arg(args, kwargs, 2, "is_retracted", False)))
    return None


def after_calc_priority(result, *args, **kwargs):
    """AFTER `SchedulePolicy.calc_priority(self, waiting_queue, running_batch=None,
    processed_tokens=0) -> None` (it sorts `waiting_queue` in place; so does this hook)."""
    state = _state
    if state is not None:
        waiting_queue = _arg(args, kwargs, 1, "waiting_queue")
        if waiting_queue:
            state.order_waiting(waiting_queue)
    return None


def before_get_new_batch_prefill(*args, **kwargs):
    """BEFORE `Scheduler.get_new_batch_prefill(self, running_batch)`: the core's iteration
    (preemptions carried out with SGLang's release functions, then the prefill plan the adder
    follows)."""
    state = _state
    scheduler = args[0] if args else None
    if state is not None and scheduler is not None and _reconcilable(scheduler):
        state.begin_pass(scheduler, _arg(args, kwargs, 1, "running_batch"))
    return None


def after_get_new_batch_prefill(result, *args, **kwargs):
    """AFTER `Scheduler.get_new_batch_prefill(self, running_batch) -> NextBatchPlan`."""
    state = _state
    if state is None:
        return None
    scheduler = args[0] if args else None
    batch = getattr(result, "batch_to_run", None)
    if batch is not None:
        state.charge_prefill(batch.reqs, skip=getattr(batch, "decoding_reqs", None) or ())
    state.end_pass(batch)
    if scheduler is not None and _reconcilable(scheduler):
        state.reconcile(_live_requests(scheduler, result))
    return None


def replace_get_prefill_adder_class(*args, **kwargs):
    """REPLACE `Scheduler.get_prefill_adder_class(self) -> type`: FairShare's `PrefillAdder`."""
    return prefill_adder_class()


_adder_class = None


def prefill_adder_class():
    """`FairSharePrefillAdder`, a subclass of SGLang's `PrefillAdder` that carries out the core's
    plan for the pass (`FairShareState.begin_pass`): it admits exactly the planned requests with
    the planned tokens, skips (`AddReqResult.CONTINUE`) any other, and parks the chunked request
    when the core serves other work first. Without a plan it is SGLang's adder. Built on first use
    (this module must import without SGLang)."""
    global _adder_class
    if _adder_class is not None:
        return _adder_class
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    class FairSharePrefillAdder(PrefillAdder):
        """With a plan, KV admission is the core's (docs/sglang-backend.md "cannot" 4, now done):
        on SGLang's token pool (`PrefillBudget` itself, not its SWA / Mamba variants) the
        adder keeps only what a pass physically needs, room now for the extends, one page each and
        the decodes riding along, and drops SGLang's estimates of future decode tokens (the running
        batch's `max_new_tokens × new_token_ratio` in `total_offset`, each admission's own
        `max_new_tokens`): the core admitted on the room there is now, as the reference engine
        does, and a decode that runs short is SGLang's retraction (`retract_decode`, victims from
        the core), as it is the reference's recompute preemption."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            state = _state
            self._room_now = (state is not None and state.plan is not None
                              and type(self.memory_budget) is PrefillBudget)
            if self._room_now:
                self.memory_budget.total_offset = self.memory_budget.current_offset

        def _check_prefill_budget(self, req, *, extend_input_len, total_tokens, swa_host_hit_length, chunk_limit):
            if self._room_now:
                total_tokens -= self._swa_new_tokens(req)  # add_one_req's own max_new, left out
            return super()._check_prefill_budget(req, extend_input_len=extend_input_len, total_tokens=total_tokens,
                                                 swa_host_hit_length=swa_host_hit_length, chunk_limit=chunk_limit)

        def _update_prefill_budget(self, prefix_len, extend_input_len, max_new_tokens, *args, **kwargs):
            return super()._update_prefill_budget(prefix_len, extend_input_len, 0 if self._room_now else max_new_tokens,
                                                  *args, **kwargs)

        def add_chunked_req(self, req):
            state = _state
            if state is None or state.plan is None:
                return super().add_chunked_req(req)
            n = state.planned_tokens(req)
            if n is None:
                req.extend_end = req.prefix_len  # parked: nothing computed this pass
                return req
            self.chunked_req_limit = n if self.chunked_req_limit is None else min(self.chunked_req_limit, n)
            return super().add_chunked_req(req)

        def add_one_req(self, req, has_chunked_req, truncation_align_size):
            state = _state
            if state is None or state.plan is None:
                return super().add_one_req(req, has_chunked_req, truncation_align_size)
            n = state.planned_tokens(req)
            if n is None:
                return AddReqResult.CONTINUE  # not the core's choice for this pass: skip it
            extend = len(req.full_untruncated_fill_ids) - req.prefix_len
            if n < extend and has_chunked_req:
                # a second partial prefill while the chunk is parked (sglang-backend.md "cannot" 1)
                return AddReqResult.CONTINUE
            saved = self.rem_chunk_tokens
            self.rem_chunk_tokens = n if saved is None else min(saved, n)
            before = self.rem_chunk_tokens
            try:
                res = super().add_one_req(req, has_chunked_req, truncation_align_size)
            finally:
                used = before - self.rem_chunk_tokens
                self.rem_chunk_tokens = None if saved is None else saved - used
            # whatever SGLang's own checks said (a refusal is heard by the core after the pass,
            # `FairShareState.end_pass`), go on while planned requests remain
            admitted = {id(r) for r in self.can_run_list}
            if any(id(r) not in admitted for r in state.plan.admitted):
                return AddReqResult.CONTINUE
            return AddReqResult.OTHER

    _adder_class = FairSharePrefillAdder
    return _adder_class


def after_process_batch_result(result, *args, **kwargs):
    """AFTER `Scheduler.process_batch_result(self, batch, result)`."""
    state = _state
    if state is not None:
        batch = _arg(args, kwargs, 1, "batch")
        if batch is not None:
            state.charge_outputs(batch.reqs)
    return None


def after_get_internal_state(result, *args, **kwargs):
    """AFTER `Scheduler.get_internal_state(self, recv_req) -> GetInternalStateReqOutput`: the
    scheduler's FairShare figures (`FairShareState.engine_snapshot`) under
    `internal_state["fairshare"]`, which the worker reads through
    `tokenizer_manager.get_internal_state()` and exports under the reference worker's names."""
    state = _state
    internal = getattr(result, "internal_state", None)
    if state is not None and isinstance(internal, dict):
        internal["fairshare"] = state.engine_snapshot()
    return None


def replace_decode_retraction_order(reqs):
    """REPLACE `ScheduleBatch._get_decode_retraction_order(reqs) -> List[int]` (staticmethod)."""
    state = _state
    if state is None:
        raise RuntimeError("fairshare: retraction order hook called without plugin state")
    return state.retraction_order(reqs)


# ---- helpers -------------------------------------------------------------------------------------
def _reconcilable(scheduler) -> bool:
    """Reconciling against the scheduler's queues is only sound where every live request sits in
    them: no PD disaggregation (its own queues), no diffusion-LM manager."""
    mode = getattr(scheduler, "disaggregation_mode", None)
    if mode is not None and getattr(mode, "value", mode) != "null":
        return False
    if getattr(scheduler, "dllm_config", None) is not None or not hasattr(scheduler, "waiting_queue"):
        return False
    try:  # pipeline parallelism keeps micro-batches of its own
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().pp_size <= 1
    except Exception:
        return True


def _live_requests(scheduler, plan):
    """Every request the scheduler still holds: waiting, running, being prefilled (chunked), in the
    batch just formed, in the last batch, or queued for result processing (overlap)."""
    yield from scheduler.waiting_queue
    yield getattr(scheduler, "chunked_req", None)
    for batch in (getattr(plan, "batch_to_run", None), getattr(plan, "running_batch", None),
                  getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None),
                  getattr(scheduler, "cur_batch_for_debug", None)):
        if batch is not None:
            yield from batch.reqs
    for item in getattr(scheduler, "result_queue", ()) or ():
        batch = item[0] if isinstance(item, tuple) else item
        yield from getattr(batch, "reqs", ())


@dataclass(frozen=True)
class Hook:
    """One hook: target path, HookRegistry hook type name, the function, and the parameters of the
    target (in order, `self` included for methods) that the hook relies on, with the defaults it
    relies on (`...` = required). `static`: the target is a staticmethod."""

    target: str
    hook_type: str
    fn: object
    params: tuple[tuple[str, object], ...]
    static: bool = False


HOOKS: tuple[Hook, ...] = (
    Hook(f"{SCHEDULER}._add_request_to_queue", "BEFORE", before_add_request_to_queue,
         (("self", ...), ("req", ...), ("is_retracted", False))),
    Hook(f"{SCHEDULE_POLICY}.calc_priority", "AFTER", after_calc_priority,
         (("self", ...), ("waiting_queue", ...), ("running_batch", None), ("processed_tokens", 0))),
    Hook(f"{SCHEDULER}.get_new_batch_prefill", "BEFORE", before_get_new_batch_prefill,
         (("self", ...), ("running_batch", ...))),
    Hook(f"{SCHEDULER}.get_new_batch_prefill", "AFTER", after_get_new_batch_prefill,
         (("self", ...), ("running_batch", ...))),
    Hook(f"{SCHEDULER}.get_prefill_adder_class", "REPLACE", replace_get_prefill_adder_class,
         (("self", ...),)),
    Hook(f"{SCHEDULER}.process_batch_result", "AFTER", after_process_batch_result,
         (("self", ...), ("batch", ...), ("result", ...))),
    Hook(f"{SCHEDULER}.get_internal_state", "AFTER", after_get_internal_state,
         (("self", ...), ("recv_req", ...))),
    Hook(f"{SCHEDULE_BATCH}._get_decode_retraction_order", "REPLACE", replace_decode_retraction_order,
         (("reqs", ...),), static=True),
)
