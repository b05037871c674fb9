"""Step SGLang 0.5.23's own scheduler on CPU, with the FairShare plugin installed, through a
scripted workload (`tests/parity/workloads.py`), recording the same `Trace` as the reference driver.

What runs for real (SGLang's code, unmodified, as installed in .venv-sglang):
- `Scheduler` methods, on a `Scheduler` object built without its `__init__` (see below), one loop
  pass per iteration exactly as `Scheduler.event_loop_normal` (scheduler.py l. 2026-2059) runs it:
  `get_next_batch_to_run` (l. 3894: merge the last prefill batch into the running batch, filter
  finished requests, `get_new_batch_prefill` → `_get_new_batch_prefill_raw` l. 4079, or
  `update_running_batch` l. 4459 for a decode step), then `process_batch_result` (l. 5074), then
  `last_batch` is updated; arrivals enter through `Scheduler._add_request_to_queue` (l. 3480);
- inside those: `SchedulePolicy.calc_priority` (the waiting-queue order), `PrefillAdder`
  (`add_chunked_req`, `add_one_req`, its `PrefillBudget` memory check with the running requests'
  reserved decode tokens, `AddReqResult`), chunked prefill (one `Scheduler.chunked_req` at a time),
  mixed chunked prefill when `mixed_chunk` is on (`ScheduleBatch.mix_with_running`),
  `ScheduleBatch.init_new` / `prepare_for_extend` / `prepare_for_decode` / `filter_batch` /
  `merge_batch`, decode retraction (`ScheduleBatch.check_decode_mem`, `retract_decode`,
  `_get_decode_retraction_order`, `release_req`), `NewTokenRatioTracker`, and the batch-result
  processor (`SchedulerBatchResultProcessor.process_batch_result_prefill` / `_decode`: output
  tokens appended, `Req.update_finish_state`, `release_kv_cache` / `checkpoint_kv_cache` into the
  radix tree);
- the memory: a real `ReqToTokenPool` (one row per running slot), a real
  `TokenToKVPoolAllocator` (page size 1) or `PagedTokenToKVPoolAllocator` (page size > 1) on CPU,
  and a real `RadixCache` over them (prefix matching, locking, insertion, LRU eviction);
- the plugin: loaded through SGLang's `load_plugins()` (entry point `sglang.srt.plugins`), its five
  hooks applied by `HookRegistry`, so every hook fires from SGLang's own call sites; the driver
  installs its own `FairShareState` for the run (policy and cost of the run) and restores the
  process's afterwards.

What is simulated (and why):
- `Scheduler.__init__` is not run: it loads a model (`init_model_worker`: a `TpModelWorker` with a
  torch model on an accelerator), builds torch.distributed / gloo groups and ZMQ IPC channels,
  a tokenizer, CUDA graphs and the KV tensors. The driver sets the attributes `__init__` would
  derive from `ServerArgs` (published with `RuntimeContext.override_server_args`) and builds the
  pools itself; SGLang's own `init_running_status`, `init_schedule_policy`,
  `init_beam_coordinator`, `init_dp_attn_adapter` and `init_batch_result_processor` run.
- `Scheduler.run_batch` (the forward) is replaced by its bookkeeping only (forward counter,
  `forward_iter` / `launch_ts`, `processed_tokens_counter`) and a result whose next token is
  `OUTPUT_TOKEN` for every request (`GenerationBatchResult.next_token_ids`); no logits.
- Stand-ins with no scheduling effect: the metrics reporter (counters only), the output streamer
  (records finished requests), the load publisher and inquirer, the grammar manager (no
  constrained decoding), the model config (vocabulary size, no EOS, no reasoning tokens), the
  model runner's attention backend attributes; the `KVCache` tensors (the allocator only hands out
  indices; no K/V is stored). `Scheduler.on_idle` is reduced to what changes scheduling
  (`new_token_ratio_tracker.reset()` when `is_fully_idle()`).
- Requests are `Req` objects built as `Scheduler._handle_generate_request` builds them from a
  tokenized request (rid, input ids, normalized `SamplingParams` with the signed tenant token in
  `custom_params`, `extra_key`, `cache_salt`, vocabulary size, no EOS); the tokenizer-manager →
  scheduler IPC is not stepped.
Overlap scheduling (`event_loop_overlap`) is off: it needs CUDA streams.

Usage: `trace = run_sglang(workload, policy="vtc")`; `SGLangDriver(...)` for step-by-step use.
"""

from __future__ import annotations

import inspect
import os
import time
from array import array
from collections import deque
from types import SimpleNamespace

from tests.sglang import cpu_sglang

cpu_sglang.prepare()

import torch  # noqa: E402
import sglang.srt.managers.scheduler as scheduler_mod  # noqa: E402  (plugins hook only where it is imported)
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers.schedule_batch import ScheduleBatch, Req  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import (  # noqa: E402
    NgramEmbeddingManager,
)
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.runtime_context import get_context, get_schedule  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from tests.parity.driver import ScriptedDriver  # noqa: E402
from tests.parity.trace import IterationRecord, Trace  # noqa: E402
from tests.parity.workloads import ScriptedWorkload  # noqa: E402
from worker.scheduling.cost import LinearCost  # noqa: E402
from worker.sglang_plugin import hooks  # noqa: E402
from worker.sglang_plugin import tenant as tenant_mod  # noqa: E402
from worker.sglang_plugin.state import FairShareState  # noqa: E402

Scheduler = scheduler_mod.Scheduler

# Scheduler attributes __init__ copies by the same name from the schedule config (`get_schedule()`).
_FROM_SCHEDULE_CONFIG = ("schedule_policy", "enable_priority_scheduling", "schedule_low_priority_values_first",
                         "abort_on_priority_when_disabled", "priority_scheduling_preemption_threshold")

# Scheduler attributes __init__ sets that are the same in every driver run: a generation model with no
# LoRA, speculative decoding, hierarchical / session / sparse caches, hybrid attention, queue limit or
# overlap; the collaborators for those absent; the step counters at zero.
_FEATURES_OFF = {
    "is_generation": True, "max_queued_requests": None, "enable_overlap": False, "enable_overlap_mlx": False,
    "dllm_config": None, "enable_lora": False, "enable_hierarchical_cache": False, "enable_hicache_storage": False,
    "enable_lmcache": False, "enable_unified_cache_external_linker": False, "enable_hisparse": False,
    "enable_session_radix_cache": False, "is_hybrid_swa": False, "is_hybrid_ssm": False,
    "hisparse_coordinator": None, "decode_offload_manager": None, "draft_worker": None,
    "truncation_align_size": None, "dynamic_chunk_sizer": None, "min_free_slots_delayer": None,
    "require_mlp_sync": False, "scheduler_stage_metrics": None, "forward_ct": 0, "processed_tokens_counter": 0,
    "_sched_idled": False, "future_map": None,
}
OUTPUT_TOKEN = 7        # what the fake model emits (the same in the reference driver)
VOCAB_SIZE = 32000
DEFAULT_SECRET = "sglang-driver-secret"


class PluginNotInstalled(RuntimeError):
    """The FairShare hooks are not on SGLang's classes (the entry point is not registered)."""


def ensure_plugin() -> None:
    """Load SGLang's general plugins (idempotent) and check that every FairShare hook sits on its
    target, so the driver never runs SGLang without the plugin. Raises PluginNotInstalled."""
    load_plugins()
    for h in hooks.HOOKS:
        owner_path, attr = h.target.rsplit(".", 1)
        module_path, cls_name = owner_path.rsplit(".", 1)
        owner = getattr(__import__(module_path, fromlist=[cls_name]), cls_name)
        fn = owner.__dict__[attr]
        fn = getattr(fn, "__func__", fn)
        while fn is not None and _closure(fn).get("hook") is not h.fn:  # other wrappers may sit outside
            fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            raise PluginNotInstalled(f"{h.target}: FairShare hook not installed (pip install -e . in .venv-sglang)")


def _closure(fn) -> dict:
    try:
        return inspect.getclosurevars(fn).nonlocals
    except TypeError:  # not a Python function
        return {}


# ---- stand-ins for the parts of a Scheduler that only report ------------------------------------
class _MetricsReporter:
    """`SchedulerMetricsReporter` without a collector: the counters the processors write."""

    enable_metrics = False
    num_generated_tokens = 0
    forward_ct_decode = 0
    num_retracted_reqs = 0

    def report_prefill_stats(self, **_kw) -> None:
        return None

    def report_decode_stats(self, *_a, **_kw) -> None:
        return None

    def log_batch_result_stats(self, *_a, **_kw) -> None:
        return None

    def update_device_timer(self) -> None:
        return None

    def record_scheduler_active(self, *_a) -> None:
        return None


class _OutputStreamer:
    """`SchedulerOutputStreamer` without the detokenizer socket: records finished requests."""

    def __init__(self) -> None:
        self.finished: list[str] = []
        self._seen: set[str] = set()

    def stream_output(self, reqs, return_logprob, skip_req=None) -> None:
        for r in reqs:
            if r.finished() and r.rid not in self._seen:
                self._seen.add(r.rid)
                self.finished.append(r.rid)


def _model_config(context_len: int):
    """What the scheduling path reads of `ModelConfig`."""
    return SimpleNamespace(vocab_size=VOCAB_SIZE, is_multimodal=False, is_encoder_decoder=False,
                           context_len=context_len, hf_eos_token_id=None, self_opened_think_start_ids=None,
                           think_end_ids=None, num_key_value_heads=1)


class SGLangDriver(ScriptedDriver):
    """SGLang's scheduler on `workload.engine`'s shape, with the plugin's `policy` (`vtc`,
    `vtc-pred`, `drr`, `fcfs`) and `LinearCost(alpha, beta)`.

    sglang_policy: SGLang's own `--schedule-policy` (`fcfs`, `lpm`, ...): the order the plugin's
    AFTER hook on `SchedulePolicy.calc_priority` starts from. mixed_chunk: `--enable-mixed-chunk`
    (decodes ride along in prefill batches, as in the reference engine's iterations).
    conservativeness: `--schedule-conservativeness` (scales the decode tokens the prefill adder
    reserves for running requests: `new_token_ratio`). kv_quota: the worker's KV quota settings
    (`KVQuotaConfig`, None: off) for the plugin's core. Use as a context manager, or call `close()`:
    it publishes SGLang's runtime config and the plugin state for the run and restores both.
    Raises PluginNotInstalled when the FairShare hooks are missing.
    """

    def __init__(self, workload: ScriptedWorkload, policy: str = "vtc", *, alpha: float = 1.0, beta: float = 2.0,
                 sglang_policy: str = "fcfs", mixed_chunk: bool = True, conservativeness: float = 1.0,
                 drr_quantum: float = 512.0, secret: str | None = None, kv_quota=None) -> None:
        super().__init__(workload, f"sglang/{policy}")
        shape = workload.engine
        self.secret = secret or os.environ.get(tenant_mod.SECRET_ENV) or DEFAULT_SECRET
        self._override = get_context().override_server_args(
            chunked_prefill_size=shape.chunk_tokens, max_prefill_tokens=shape.chunk_tokens, page_size=shape.page_size,
            max_running_requests=shape.max_running, pp_max_micro_batch_size=shape.max_running,
            disable_overlap_schedule=True, enable_mixed_chunk=mixed_chunk, schedule_policy=sglang_policy,
            schedule_conservativeness=conservativeness)
        self.server_args = self._override.install()
        self._previous_state = hooks.get_state()
        self._closed = False
        try:
            ensure_plugin()
            options = {"quantum": drr_quantum} if policy == "drr" else {}
            self.state = FairShareState(policy, LinearCost(alpha, beta), secret=self.secret, kv_quota=kv_quota,
                                        **options)
            hooks.set_state(self.state)
            self.scheduler = self._build_scheduler()
        except BaseException:
            self.close()
            raise
        self.reqs: dict[str, Req] = {}
        self._finished_seen = 0

    # ---- building the Scheduler -----------------------------------------------------------------
    def _build_scheduler(self) -> Scheduler:
        """A real `Scheduler` object whose `__init__` did not run (see the module docstring)."""
        shape = self.workload.engine
        sched_cfg = get_schedule()
        s = Scheduler.__new__(Scheduler)
        s.server_args = self.server_args
        # memory: the pools kv_cache_builder.build_kv_cache would build, on CPU, without KV tensors
        s.req_to_token_pool = ReqToTokenPool(shape.max_running, shape.max_context + shape.chunk_tokens, "cpu", False)
        if shape.page_size == 1:
            alloc = TokenToKVPoolAllocator(shape.kv_tokens, torch.float16, "cpu", None, False)
        else:
            alloc = PagedTokenToKVPoolAllocator(shape.kv_tokens, shape.page_size, torch.float16, "cpu", None, False)
        s.token_to_kv_pool_allocator = alloc
        s.tree_cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=s.req_to_token_pool,
                                                  token_to_kv_pool_allocator=alloc, page_size=shape.page_size))
        s.disable_radix_cache = False
        # what __init__ reads from ServerArgs and the model worker (get_worker_info)
        for name in _FROM_SCHEDULE_CONFIG:
            setattr(s, name, getattr(sched_cfg, name))
        for name, value in _FEATURES_OFF.items():
            setattr(s, name, value)
        s.page_size = shape.page_size
        s.max_running_requests = shape.max_running
        s.max_prefill_tokens = shape.chunk_tokens
        s.max_req_len = s.max_req_input_len = shape.max_context
        s.model_config = _model_config(shape.max_context)
        s.spec_algorithm = SpeculativeAlgorithm.from_string(None)
        s.disaggregation_mode = DisaggregationMode.NULL
        # SGLang's own initialisers for the scheduling state
        s.init_running_status()
        # init_chunked_prefill's attributes (it also resolves the model class, to turn chunking off
        # for multimodal models with the Transformers backend: no model here)
        s.chunked_prefill_size = sched_cfg.chunked_prefill_size
        s.prefill_decode_interval = sched_cfg.prefill_decode_interval or 0
        s._prefill_decode_interval_remaining = 0
        s.prefill_decode_interval_min_bs = sched_cfg.prefill_decode_interval_min_bs
        s.chunked_req = s._pending_chunked_abort_req = None
        s.is_mixed_chunk = s.chunked_prefill_size is not None and sched_cfg.enable_mixed_chunk
        s.init_schedule_policy()
        # the model worker's scheduling-visible attributes (no model)
        s.ngram_embedding_manager = NgramEmbeddingManager(enabled=False, table=None, n=0)
        s.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=SimpleNamespace(), prefill_aware_swa=False,
                                                                   ngram_embedding_manager=s.ngram_embedding_manager))
        s.model_worker = s.tp_worker
        s.weight_updater = SimpleNamespace(offload_tags=set())
        s.init_dp_attn_adapter()
        s.metrics_reporter = _MetricsReporter()
        s.metrics_collector = None
        s.output_streamer = _OutputStreamer()
        s.init_batch_result_processor()
        # reporting-only collaborators
        s.grammar_manager = SimpleNamespace(has_waiting_grammars=lambda: False, grammar_queue=[])
        s.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
        s.load_inquirer = SimpleNamespace(_get_num_pending_tokens=lambda chunk_deduct=0: 0, get_loads=None)
        s.load_snapshot_writer = None
        s.load_publisher = SimpleNamespace(publish_load_stat=lambda *a, **k: None)
        s.enable_fpm = False
        s.rust_server = None
        s._prev_step = s._prev_prefill_end_ts = s._pause_started_at = None
        s._pause_intervals = deque()
        s.total_prefill_busy_us = s.total_prefill_uncached_tokens = 0
        s.decode_moment_totals = [0] * 8
        return s

    # ---- requests ---------------------------------------------------------------------------------
    def make_req(self, r) -> Req:
        """The `Req` SGLang's scheduler builds for scripted request `r` sent by
        `fairshare worker --engine sglang` (`worker.sglang_server`): signed tenant token in
        `custom_params`, the worker-derived `extra_key`."""
        tenant = self.workload.tenant(r.tenant_id)
        custom = {tenant_mod.CUSTOM_PARAM_KEY: tenant_mod.sign(tenant.tenant_id, tenant.weight, tenant.tier, self.secret,
                                                                 rid=r.request_id)}
        sp = SamplingParams(max_new_tokens=r.output_tokens, custom_params=custom)
        sp.normalize(None)
        sp.verify(VOCAB_SIZE)
        return Req(r.request_id, "", array("q", self.workload.prompt(r)), sp,
                   eos_token_ids=None, vocab_size=VOCAB_SIZE,
                   extra_key=tenant_mod.extra_key_for(tenant.tenant_id, None, self.secret))

    # ---- one loop pass ----------------------------------------------------------------------------
    def _run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """`Scheduler.run_batch` without the forward: its bookkeeping, and one token per request."""
        s = self.scheduler
        s.forward_ct += 1
        batch.forward_iter = s.forward_ct
        batch.launch_ts = time.monotonic()
        batch.after_idle_gap = s._sched_idled
        s._sched_idled = False
        if batch.extend_num_tokens:
            s.processed_tokens_counter += batch.extend_num_tokens
        return GenerationBatchResult(next_token_ids=torch.full((batch.batch_size(),), OUTPUT_TOKEN, dtype=torch.int64))

    def step(self) -> IterationRecord:
        """Arrivals of this iteration, then one pass of `Scheduler.event_loop_normal`."""
        s = self.scheduler
        for r in self._arrivals.get(self.iteration, ()):
            req = self.make_req(r)
            self.reqs[r.request_id] = req
            s._add_request_to_queue(req)
        held = {r.rid for r in s.running_batch.reqs}
        if s.last_batch is not None:
            held.update(r.rid for r in s.last_batch.reqs if not r.finished())
        if s.chunked_req is not None:
            held.add(s.chunked_req.rid)
        retractions = {rid: r.retraction_count for rid, r in self.reqs.items() if not r.finished()}
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        s.cur_batch_for_debug = batch
        rec = IterationRecord()
        # retracted: SGLang counts them itself (Req.reset_for_retract), whichever path retracted
        rec.retracted = [rid for rid, n in retractions.items() if self.reqs[rid].retraction_count > n]
        if batch is not None:
            riding = {id(r) for r in (batch.decoding_reqs or ())}
            for req in batch.reqs:
                t = req.fairshare_tag.tenant_id
                if batch.forward_mode.is_extend() and id(req) not in riding:
                    n = req.extend_end - req.prefix_len
                    if req.rid not in held or req.rid in rec.retracted:
                        rec.admitted.append(req.rid)
                else:
                    n = 1
                rec.tokens[t] = rec.tokens.get(t, 0) + n
            result = self._run_batch(batch)
            s.process_batch_result(batch, result)
        else:
            s._sched_idled = True
            if s.is_fully_idle():
                s.new_token_ratio_tracker.reset()  # what Scheduler.on_idle changes for scheduling
        s.last_batch = batch
        rec.finished = s.output_streamer.finished[self._finished_seen:]
        self._finished_seen = len(s.output_streamer.finished)
        rec.tenant_of = {rid: self.reqs[rid].fairshare_tag.tenant_id for rid in rec.admitted + rec.retracted}
        rec.service = {t: v["charged_service"] for t, v in self.state.snapshot().items()}
        return self._close_step(rec, (r.fairshare_tag.tenant_id for r in s.waiting_queue))

    def leaked_tokens(self) -> int:
        """KV tokens neither free, nor evictable in the radix tree, once every request finished
        (0 when none leaked); also checks that every request-to-token row is back."""
        s = self.scheduler
        if any(not r.finished() for r in self.reqs.values()):
            raise RuntimeError("requests still live: run longer before checking for leaks")
        if s.req_to_token_pool.available_size() != s.req_to_token_pool.size:
            raise AssertionError("request-to-token rows leaked")
        held = s.token_to_kv_pool_allocator.size - s.token_to_kv_pool_allocator.available_size()
        return held - s.tree_cache.evictable_size() - s.tree_cache.protected_size()

    # ---- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Restore the plugin state and SGLang's runtime config of before the driver."""
        if self._closed:
            return
        self._closed = True
        hooks.set_state(self._previous_state)
        self._override.restore()

    def __enter__(self) -> "SGLangDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_sglang(workload: ScriptedWorkload, policy: str = "vtc", **options) -> Trace:
    """Run `workload` through SGLang's scheduler with the plugin; see `SGLangDriver`."""
    with SGLangDriver(workload, policy, **options) as driver:
        return driver.run()


