"""The engine loop: schedule → forward → sample → commit, one iteration at a time.

`Engine` owns the scheduler, the block manager, the model runner and the per-request
detokenizers. It runs in one dedicated thread (`start()`); other threads talk to it only through
`add_request` and `abort`, which are thread-safe, and hear back through each request's
`on_output` callback (called on the engine thread; adapters must hand results over to their own
thread, e.g. `loop.call_soon_threadsafe`).

Charging (DESIGN.md, "Service unit"): the scheduler charges each prefill chunk when it is
scheduled into the step that computes it; this loop charges each decode token when it is
committed. A request that is aborted or fails keeps what it consumed.

Pluggable for the simulator (loadtests/sim): `clock` (seconds; default `time.monotonic`) is read for
every timestamp, so a virtual clock makes runs deterministic; a runner whose `returns_token_ids`
is true returns one token id per item instead of logits (no torch sampling, no tokenizer needed:
a model whose `tokenizer` is None gets no detokenizer and empty text); `recorder` (e.g.
`worker.scheduling.metrics.EventLog`) hears arrivals, admissions, tokens, ends and per-iteration
service, from which the fairness metrics are computed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from worker.cache.namespace import GLOBAL_NAMESPACE, derive_namespace, load_secret
from worker.cache.radix import RadixCache
from worker.engine.block_manager import BlockManager
from worker.scheduling.quota import KVQuota, KVQuotaConfig
from worker.engine.detokenizer import IncrementalDetokenizer, stop_string_holdback
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence
from worker.faults import DEFAULT_FAULT_LIMIT, DEFAULT_FAULT_WINDOW_S, FaultWindow
from worker.scheduling.cost import QuadraticFit, make_cost
from worker.scheduling.decode_share import (DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET, DEFAULT_LOWER_TIER_TOKEN_TARGET,
                                             DEFAULT_TIER_GRACE_ITERATIONS)
from worker.scheduling.handback import DEFAULT_HAND_BACK_AFTER_S, HandBackRule
from worker.scheduling.policy import make_policy
from worker.scheduling.pool import PoolCounters
from worker.scheduling.tiers import TierShares

log = logging.getLogger("fairshare.engine")


@dataclass
class EngineConfig:
    """Engine settings. Token counts in tokens, memory in MiB.

    policy: `vtc`, `vtc-pred`, `drr` or `fcfs`. cost: `linear` (alpha, beta, cached_rate: see
    LinearCost) or `profiled` (profile: its `QuadraticFit`, None: the VTC paper's; see
    ProfiledCost). drr_quantum: DRR quantum, service units. max_num_batched_tokens: token budget per iteration = prefill chunk
    size. prefill_slice: tokens per policy pick when the prefill budget is split among tenants.
    max_partial_prefills: most requests in partial (chunked) prefill at once (None: no limit;
    worker/scheduling/core.py; SGLang's scheduler has 1). max_skips: memory skips before KV is reserved for a tenant's head request. max_running: most
    admitted sequences. block_size: tokens per KV block. num_kv_blocks: pool size (None: from
    kv_cache_mb, and without it from max_running and the context: `plan_kv_pool` in
    worker/engine/model_runner.py). max_model_len: context limit (None: the model's).
    dtype / quantization: the runner's activation dtype and weight format ("auto": as the
    checkpoint ships; worker/engine/weights.py). argmax_head: steps whose requests all decode
    greedily without logprobs or a grammar use the runner's screened LM head
    (worker/engine/weights.py `ArgmaxHead`; False: always the dense head).
    returning_preemption: a tenant returning below its slot share gets a running slot at once,
    preempting an over-share tenant (worker/scheduling/returning.py; never under FCFS).
    tier_scheduling: strict priority across tiers with minimum shares (False: tier-blind, every
    tenant in one tier; worker/scheduling/tiers.py). tier_min_shares: lower tier -> minimum share
    of service (missing tiers: 5 %). iteration_token_target: tokens per contended iteration beyond
    which they are shared by tier and weight (None: the token budget, so nothing changes;
    worker/scheduling/decode_share.py). lower_tier_token_target: tokens per iteration the lower
    tiers together may take while a higher tier has work, unless owed their minimum share (None or
    0: no limit; default 1, docs/fairness.md "Tiers"). tier_grace_iterations /
    lower_tier_idle_token_target: for that many iterations after the higher tier last had work, the
    lower tiers still take at most that many tokens an iteration (defaults 1024 / 16).
    kv_quota: the per-tenant KV quota settings (`KVQuotaConfig`: watermark, headroom, shared
    buffer, hard caps and soft quotas, fractions of the pool; worker/scheduling/quota.py and
    docs/memory-isolation.md). Default: `KVQuotaConfig(enabled=False)`, the quota-less behaviour.
    prefix_cache: the tenant-namespaced radix prefix cache on. cache_isolation: False only for
    experiments (one global namespace shared by all tenants: the unsafe baseline). public_prefixes:
    token-id lists shared across tenants (whole blocks only). ttft_floor_s: tier -> seconds; a
    request's first token is held back until that long after its arrival. cache_secret: key of the
    namespace derivation (None: $FAIRSHARE_CACHE_SECRET, else random per process). cached_rate:
    fraction of the prompt-token rate charged per cached prompt token. See docs/cache-isolation.md.
    fault_limit / fault_window_s: engine steps that raise this many times in a row within this many
    seconds fail the engine (worker/faults.py; docs/reliability.md).
    hand_back_after_s: seconds a never-admitted request the gateway lets go (`add_request`'s
    may_hand_back) waits while this worker has no room before it is handed back to be re-routed
    (0: never; worker/scheduling/handback.py).
    """

    policy: str = "vtc"
    alpha: float = 1.0
    beta: float = 2.0
    cached_rate: float = 0.0
    cost: str = "linear"
    profile: QuadraticFit | None = None
    drr_quantum: float = 512.0
    max_num_batched_tokens: int = 512
    prefill_slice: int = 16
    max_partial_prefills: int | None = None
    max_skips: int = 8
    max_running: int = 64
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_mb: float | None = None
    max_model_len: int | None = None
    device: str = "cpu"
    dtype: str = "auto"
    quantization: str = "auto"
    argmax_head: bool = True
    returning_preemption: bool = True
    tier_scheduling: bool = True
    tier_min_shares: dict = field(default_factory=dict)
    iteration_token_target: int | None = None
    lower_tier_token_target: int | None = DEFAULT_LOWER_TIER_TOKEN_TARGET
    tier_grace_iterations: int = DEFAULT_TIER_GRACE_ITERATIONS
    lower_tier_idle_token_target: int = DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET
    kv_quota: KVQuotaConfig = field(default_factory=lambda: KVQuotaConfig(enabled=False))
    prefix_cache: bool = True
    cache_isolation: bool = True
    public_prefixes: list = field(default_factory=list)
    ttft_floor_s: dict = field(default_factory=dict)
    cache_secret: bytes | None = None
    fault_limit: int = DEFAULT_FAULT_LIMIT
    fault_window_s: float = DEFAULT_FAULT_WINDOW_S
    hand_back_after_s: float = DEFAULT_HAND_BACK_AFTER_S


@dataclass(frozen=True)
class RequestTimings:
    """How long a request took to reach its first scheduling and its first token: the worker's
    `Timings` message (proto/fairshare/v1/worker.proto) but for `iteration`. None: not reached yet.

    queued_s / first_token_s: seconds from arrival at the worker to first scheduling / first output
    token (the first token as the client sees it, TTFT floor included). queued_iterations /
    first_token_iterations: the same in engine iterations (how many iterations started after the
    request reached the engine until it was first scheduled / its first token committed).
    """

    queued_s: float | None = None
    first_token_s: float | None = None
    queued_iterations: int | None = None
    first_token_iterations: int | None = None


@dataclass
class RequestOutput:
    """What one request gained in one iteration (or its final message).

    token_ids: tokens committed since the last output. text_delta: complete UTF-8 text since the
    last output. finish_reason: set once, on the last output. timings: how long it took to be
    first scheduled and to its first token, so far (`RequestTimings`). error: set when the
    engine failed the request (then finish_reason is ABORT).
    iteration: the engine iteration (counted as `snapshot()["iterations"]`) whose step produced it.
    logprobs: with `SamplingParams.logprobs`, one (token id, logprob, [(id, logprob), ...top]) per
    token in token_ids (worker/engine/sampler.py).
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: RequestTimings = field(default_factory=RequestTimings)
    iteration: int = 0
    error: str | None = None
    logprobs: list = field(default_factory=list)


OutputCallback = Callable[[RequestOutput], None]


class EngineFailed(RuntimeError):
    """The engine has failed (repeated step faults, worker/faults.py) and takes no more requests."""


class Engine:
    """Continuous-batching engine over one model runner.

    model: a `worker.models.LoadedModel` (tokenizer, eos ids, context length), or any object with
    `tokenizer` (None: no text), `eos_token_ids` and `max_context_tokens`.
    runner: object with `forward(items) -> logits[n, vocab]`, `block_size`, `num_kv_blocks` and
    `vocab_size` (default: a `ModelRunner` built from `model` and `config`); with
    `returns_token_ids = True`, `forward` returns one token id per item, and `item_class`, when
    present, replaces `ForwardItem`.
    clock: () -> seconds (default time.monotonic). recorder: event sink (see module docstring).
    Raises ValueError for an unknown policy or cost function.
    """

    def __init__(self, model, config: EngineConfig | None = None, runner=None, *, clock=None, recorder=None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.kv_plan = None  # how the default KV pool was sized (worker.engine.model_runner.KVPoolPlan)
        if runner is None:
            import torch

            from worker.engine.model_runner import ModelRunner, plan_kv_pool
            from worker.engine.weights import resolve_format

            c = self.config
            fmt = resolve_format(model.state_dict, torch.device(c.device), c.dtype, c.quantization)
            num_blocks = c.num_kv_blocks
            if num_blocks is None:
                self.kv_plan = plan_kv_pool(model, c.block_size, fmt.dtype, c.max_running, c.max_model_len,
                                            c.kv_cache_mb)
                num_blocks = self.kv_plan.num_blocks
            runner = ModelRunner(model, num_kv_blocks=num_blocks, block_size=c.block_size, device=c.device,
                                 dtype=fmt.dtype, quantization=fmt.quantization, argmax_head=c.argmax_head)
        self.runner = runner
        self.clock = clock or time.monotonic
        self.recorder = recorder
        cfg = self.config
        self.cache = RadixCache(runner.block_size, cfg.public_prefixes) if cfg.prefix_cache else None
        self.cache_secret = cfg.cache_secret or load_secret()
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size, cache=self.cache)
        self.cost = make_cost(cfg.cost, alpha=cfg.alpha, beta=cfg.beta, cached_rate=cfg.cached_rate, profile=cfg.profile)
        options = {"quantum": cfg.drr_quantum} if cfg.policy == "drr" else {}
        self.policy = make_policy(cfg.policy, self.cost, **options)
        self.quota = KVQuota(cfg.kv_quota, runner.num_kv_blocks) if cfg.kv_quota.enabled else None
        self.tiers = TierShares(cfg.tier_min_shares, floor_units=self.cost.max_prefill_rate * cfg.max_num_batched_tokens / 2,
                                enabled=cfg.tier_scheduling)
        self.scheduler = Scheduler(self.policy, self.cost, self.block_manager, cfg.max_num_batched_tokens,
                                   cfg.max_running, prefill_slice=cfg.prefill_slice, max_skips=cfg.max_skips,
                                   clock=self.clock, quota=self.quota,
                                   returning_preemption=cfg.returning_preemption and cfg.policy != "fcfs",
                                   tiers=self.tiers, iteration_token_target=cfg.iteration_token_target,
                                   lower_tier_token_target=cfg.lower_tier_token_target or None,
                                   max_partial_prefills=cfg.max_partial_prefills,
                                   tier_grace_iterations=cfg.tier_grace_iterations,
                                   lower_tier_idle_token_target=cfg.lower_tier_idle_token_target)
        self.pool = PoolCounters()  # pool-wide counters; inert until another worker's report arrives
        self.hand_back_rule = HandBackRule(cfg.hand_back_after_s)
        self._returns_token_ids = bool(getattr(runner, "returns_token_ids", False))
        self._item_class = getattr(runner, "item_class", None)
        pool_tokens = runner.num_kv_blocks * runner.block_size
        self.max_model_len = min(self.config.max_model_len or model.max_context_tokens, pool_tokens)
        self.eos_token_ids = set(model.eos_token_ids)
        self._callbacks: dict[str, OutputCallback] = {}
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()          # guards the inbox and callbacks
        self._state_lock = threading.RLock()   # guards scheduler state (held except during forward)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.idle_kv_blocks_used = 0
        # TTFT floor: first outputs held back until their tier's floor, request id -> (until, seq, error)
        self._first_tokens_held: dict[str, tuple[float, Sequence, str | None]] = {}
        # engine faults (worker/faults.py): a step that raises fails its batch; repeated ones fail the engine
        self.faults = FaultWindow(self.config.fault_limit, self.config.fault_window_s)
        self.on_failed: Callable[[str], None] | None = None  # called (engine thread) once, when it fails
        self._recorded = False  # this step's charges went to the recorder
        self._grammars = None  # worker/engine/grammar.GrammarCompiler, built on first use

    def compile_grammar(self, kind: str, source: str = ""):
        """A compiled grammar for `SamplingParams.grammar` (worker/engine/grammar.py; kinds json_schema,
        json_object, regex, ebnf, structural_tag). Thread-safe and slow the first time (it builds the
        vocabulary's token tables): call it off the engine loop. Raises InvalidGrammar (ValueError)."""
        from worker.engine.grammar import GrammarCompiler

        with self._lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.model.tokenizer, self.runner.vocab_size,
                                                 sorted(self.eos_token_ids))
        return self._grammars.compile(kind, source)

    # ---- thread-safe entry points -------------------------------------------------------------
    def add_request(self, request_id: str, tenant_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    on_output: OutputCallback, weight: float = 1.0, tier: str = "interactive",
                    cache_namespace: str = "", arrival_time: float | None = None, cache_salt: str = "",
                    may_hand_back: bool = False, final_only: bool = False) -> None:
        """Queue a request. arrival_time: when it arrived, on the engine's clock (default: now).
        cache_salt: the client's salt, splitting the tenant's prefix-cache namespace. The namespace
        is derived here from the tenant id and the salt under the engine's secret
        (`worker.cache.namespace.derive_namespace`); `cache_namespace`, when given, replaces it
        (trusted in-process callers only, e.g. experiments; servers never pass client input there).
        may_hand_back: while never admitted it may be handed back (`EngineConfig.hand_back_after_s`):
        its output then ends, before any token, with `FinishReason.HANDED_BACK` and its caller
        routes it elsewhere (the gateway sets it only when another worker exists).
        final_only: `on_output` gets one call, the final output (all tokens and text at once), not one
        per iteration (for callers that only count finished requests: the simulator).
        Raises ValueError when it can never run (empty or too long prompt, bad sampling values,
        token ids outside the vocabulary, duplicate id), EngineFailed once the engine has failed."""
        if self.faults.tripped:
            raise EngineFailed(f"the engine has failed: {self.faults.reason}")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.runner.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens, including at least one output token")
        if not weight > 0:
            raise ValueError("tenant weight must be > 0")
        sampling.validate()
        if not self.config.cache_isolation:
            cache_namespace = GLOBAL_NAMESPACE  # experiment only: every tenant shares one namespace
        elif not cache_namespace:
            cache_namespace = derive_namespace(self.cache_secret, tenant_id, cache_salt)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        seq = Sequence(request_id=request_id, tenant_id=tenant_id, prompt_token_ids=list(prompt_token_ids),
                       sampling=sampling, weight=weight, tier=tier, cache_namespace=cache_namespace,
                       max_tokens=max_tokens, arrival_time=self.clock() if arrival_time is None else arrival_time,
                       may_hand_back=bool(may_hand_back), final_only=bool(final_only))
        with self._lock:
            if request_id in self._callbacks:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._callbacks[request_id] = on_output
            self._inbox.append(("add", seq))
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Abort a request (idempotent). Returns whether it was still live. Its blocks are freed
        at the start of the next iteration (at once when the loop is idle)."""
        with self._lock:
            live = request_id in self._callbacks
            if live:
                self._inbox.append(("abort", request_id))
        self._wake.set()
        return live

    # ---- the loop -------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the loop in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="fairshare-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread; live requests are aborted."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._state_lock:
            self._drain_inbox()
            for seq in list(self.scheduler.by_id.values()):
                self._finish(seq, FinishReason.ABORT)
            for request_id, (_, seq, error) in list(self._first_tokens_held.items()):  # finished, first token held
                del self._first_tokens_held[request_id]
                self._emit(seq, final=seq.is_finished, error=error, release=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                worked = self.step()
            except Exception as exc:  # raised before a batch was formed (step() fails its own batches)
                log.exception("engine step failed before forming a batch")
                with self._state_lock:
                    self._note_fault(exc)
                # a fault that repeats must not spin the loop: back off 10 ms, doubled per fault, at most 1 s
                self._wake.wait(min(1.0, 0.01 * 2 ** min(self.faults.consecutive, 7)))
                self._wake.clear()
                continue
            if not worked:
                wait = 0.05
                if self._first_tokens_held:  # wake up in time to release a held first token (TTFT floor)
                    wait = min(wait, max(0.0, min(u for u, _, _ in self._first_tokens_held.values()) - self.clock()))
                self._wake.wait(wait)
                self._wake.clear()

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                item.arrival_iteration = self.scheduler.core.iteration
                self._prepare(item)
                if self.cache is not None:
                    self.cache.set_weight(item.tenant_id, item.weight)  # its share of the cache
                self.scheduler.add(item)
                if self.recorder is not None:
                    self.recorder.on_arrival(item.request_id, item.tenant_id, item.weight, item.arrival_time,
                                             len(item.prompt_token_ids), item.max_tokens)
            else:
                seq = self.scheduler.by_id.get(item)
                if seq is not None:
                    self._finish(seq, FinishReason.ABORT)

    def _prepare(self, seq: Sequence) -> None:
        if self.model.tokenizer is not None:
            skip = self.eos_token_ids | set(seq.sampling.stop_token_ids)
            seq.detokenizer = IncrementalDetokenizer(self.model.tokenizer, seq.prompt_token_ids, skip)
        if not self._returns_token_ids:
            from worker.engine.sampler import make_generator

            seq.generator = make_generator(seq.sampling.seed)
        if seq.sampling.grammar is not None and seq.constraint is None:
            from worker.engine.grammar import Constraint

            seq.constraint = Constraint(seq.sampling.grammar)

    def step(self) -> bool:
        """Run one iteration. Returns False when there was nothing to do. A fault once the batch is
        formed (building the forward items, the forward, sampling, committing) fails exactly that
        batch's requests and counts one engine fault (`_fail_batch`); one raised before (scheduling)
        propagates to the caller (the loop counts it too and backs off)."""
        item_class = self._item_class
        own_items = item_class is None  # ForwardItem (a runner's own item class takes three fields)
        if own_items:
            from worker.engine.model_runner import ForwardItem as item_class

        with self._state_lock:
            if self.faults.tripped:  # a failed engine runs nothing: whatever still arrives fails at once
                self._drain_inbox()
                self._fail_all(f"the engine has failed: {self.faults.reason}")
                return False
            if self._first_tokens_held:
                self._release_first_tokens()
            self._drain_inbox()
            started = self.clock()
            chunks = self.scheduler.schedule()
            if self.hand_back_rule.enabled:
                self._hand_back()
            if not chunks:
                return False
        self._recorded = False
        try:  # from here on, a fault fails exactly this batch's requests
            with self._state_lock:
                items = []
                for c in chunks:
                    start = c.seq.num_computed_tokens
                    item = item_class(_token_slice(c.seq, start, c.num_tokens), start, list(c.seq.block_table))
                    if own_items:
                        item.argmax_only = _argmax_only(c.seq)
                    items.append(item)
            logits = self.runner.forward(items)
            with self._state_lock:
                self._commit_step(chunks, logits, started)
        except Exception as exc:
            with self._state_lock:
                self._fail_batch(chunks, started, exc)
            return True
        self.faults.success()
        return True

    # ---- engine faults (worker/faults.py) --------------------------------------------------------
    def _fail_batch(self, chunks, started: float, exc: Exception) -> None:
        """A step raised after forming its batch: fail exactly the batch's requests (their KV blocks
        are freed; the service they consumed stays charged), count the fault, keep serving the rest."""
        live = [c.seq for c in chunks if self.scheduler.by_id.get(c.seq.request_id) is c.seq]
        log.error("engine step failed (%s: %s); failing the %d request(s) of its batch: %s", type(exc).__name__, exc,
                  len(live), ", ".join(s.request_id for s in live[:8]) + (" ..." if len(live) > 8 else ""),
                  exc_info=exc)
        if self.recorder is not None and not self._recorded:  # failed requests keep what they consumed
            service: dict[str, float] = {}
            prefill: dict[str, int] = {}
            for c in chunks:
                if c.prefill_units:
                    service[c.seq.tenant_id] = service.get(c.seq.tenant_id, 0.0) + c.prefill_units
                    prefill[c.seq.tenant_id] = prefill.get(c.seq.tenant_id, 0) + c.prefill_tokens
                    self.recorder.on_prefill_charge(c.seq.request_id, c.prefill_units)
            self.recorder.on_step(started, self.clock(), service, prefill, {})
        error = f"engine step failed: {type(exc).__name__}: {exc}"
        for seq in live:
            self._finish(seq, FinishReason.ABORT, error=error)
        self._note_fault(exc)

    def _note_fault(self, exc: Exception) -> None:
        """Count one fault; when it trips the window, fail the engine (once)."""
        if not self.faults.failure(f"{type(exc).__name__}: {exc}"):
            return
        reason = self.faults.reason
        log.critical("engine failed: %s; failing every request and reporting NOT_SERVING", reason)
        self._fail_all(f"the engine has failed: {reason}")
        if self.on_failed is not None:
            try:
                self.on_failed(reason)
            except Exception:
                log.exception("engine failure callback failed")

    def _fail_all(self, error: str) -> None:
        for seq in list(self.scheduler.by_id.values()):
            self._finish(seq, FinishReason.ABORT, error=error)
        for request_id, (_, seq, held_error) in list(self._first_tokens_held.items()):  # finished, first token held back
            del self._first_tokens_held[request_id]
            self._emit(seq, final=True, error=held_error, release=True)

    @property
    def failed(self) -> str | None:
        """Why the engine has failed (repeated faults), or None while it serves."""
        return self.faults.reason

    def _commit_step(self, chunks, logits, started: float) -> None:
        rows, seqs = [], []
        for i, c in enumerate(chunks):
            c.seq.num_computed_tokens += c.num_tokens
            self.block_manager.cache_computed(c.seq)  # completed whole blocks join the prefix cache
            if c.seq.num_computed_tokens == c.seq.num_tokens:
                rows.append(i)
                seqs.append(c.seq)
        now = self.clock()
        rec = self.recorder
        service: dict[str, float] = {}
        prefill: dict[str, int] = {}
        outputs: dict[str, int] = {}
        if rec is not None:
            for c in chunks:
                seq = c.seq
                if seq.first_scheduled_time is not None:  # idempotent: the first call counts
                    rec.on_admit(seq.request_id, seq.first_scheduled_time)
                if c.prefill_units:
                    t = seq.tenant_id
                    service[t] = service.get(t, 0.0) + c.prefill_units
                    prefill[t] = prefill.get(t, 0) + c.prefill_tokens
                    rec.on_prefill_charge(seq.request_id, c.prefill_units)
        self._recorded = True  # (a fault from here on must not record these charges again)
        if seqs:
            if self._returns_token_ids:
                tokens = [logits[i] for i in rows]
            else:
                from worker.engine.sampler import sample

                batch = logits[rows]
                if any(s.constraint is not None for s in seqs):  # per-row grammar masks, same iteration
                    batch, seqs = self._masked(batch, seqs)
                tokens = sample(batch, [s.sampling for s in seqs], [s.generator for s in seqs])
            for seq, tok in zip(seqs, tokens):
                units = self._commit(seq, tok, now)
                if rec is not None:
                    t = seq.tenant_id
                    service[t] = service.get(t, 0.0) + units
                    outputs[t] = outputs.get(t, 0) + 1
        if rec is not None:
            rec.on_step(started, now, service, prefill, outputs)

    def _masked(self, batch, seqs: list[Sequence]):
        """Apply the grammar masks to `batch` (logits [len(seqs), vocab]); a request whose grammar allows
        no next token at all (a dead end: nothing can be sampled) ends here with STOP and what it has
        produced, alone, and leaves the batch. Returns (masked logits, the sequences still to sample)."""
        from worker.engine.grammar import apply_masks, no_allowed_token

        batch = apply_masks(batch, [s.constraint for s in seqs])
        dead = no_allowed_token(batch, [s.constraint for s in seqs])
        if not dead:
            return batch, seqs
        for i in dead:
            log.warning("request %s: its grammar allows no next token after %d; stopping", seqs[i].request_id,
                        len(seqs[i].output_token_ids))
            if seqs[i].detokenizer is not None:
                seqs[i].output_text += seqs[i].detokenizer.flush()
            self._finish(seqs[i], FinishReason.STOP)
        gone = set(dead)
        keep = [i for i in range(len(seqs)) if i not in gone]
        return batch[keep], [seqs[i] for i in keep]

    def _commit(self, seq: Sequence, token, now: float) -> float:
        """Commit one sampled token (an id, or a `sampler.Sample` with its logprobs): charge it,
        advance its grammar, detokenize, check stop conditions, emit. Returns the service units
        charged for it."""
        if not isinstance(token, int):
            if token.logprob is not None:
                seq.output_logprobs.append((token.token, token.logprob, token.top or []))
            token = token.token
        units = self.cost.decode(1, len(seq.prompt_token_ids), len(seq.output_token_ids))
        seq.output_token_ids.append(token)
        self.policy.charge(seq.tenant_id, units, output_tokens=1, request_id=seq.request_id)
        if self.recorder is not None:
            self.recorder.on_token(seq.request_id, now, units)
        if seq.first_token_time is None:
            seq.first_token_time = now
            seq.first_token_iteration = self.scheduler.core.iteration
        reason = None
        params = seq.sampling
        done_grammar = False  # the grammar is complete (it accepted an end-of-sequence token)
        if seq.constraint is not None:
            done_grammar = not seq.constraint.accept(token) or seq.constraint.terminated
            if done_grammar and token not in self.eos_token_ids:
                log.warning("request %s: token %d outside its grammar; stopping", seq.request_id, token)
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos) or done_grammar:
            reason = FinishReason.STOP
        elif seq.detokenizer is not None:
            seq.output_text += seq.detokenizer.add(token)
            if params.stop:
                reason = self._apply_stop_strings(seq)
        if reason is None and (len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            if reason is FinishReason.LENGTH and seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.flush()
                if params.stop:
                    reason = self._apply_stop_strings(seq) or reason
            self._finish(seq, reason)
        else:
            self._emit(seq, final=False)
        return units

    def _apply_stop_strings(self, seq: Sequence) -> FinishReason | None:
        """Cut `output_text` at the first stop string; return STOP when one was found."""
        longest = max(len(s) for s in seq.sampling.stop)
        start = max(0, seq.emitted_text_len - longest + 1)
        hits = [i for i in (seq.output_text.find(s, start) for s in seq.sampling.stop) if i >= 0]
        if not hits:
            return None
        seq.output_text = seq.output_text[:min(hits)]
        return FinishReason.STOP

    # ---- TTFT floor ------------------------------------------------------------------------------
    def _ttft_floor_until(self, seq: Sequence) -> float | None:
        """When `seq`'s first token may be released (arrival + its tier's floor), or None."""
        floor = self.config.ttft_floor_s.get(seq.tier, 0.0) if self.config.ttft_floor_s else 0.0
        return seq.arrival_time + floor if floor > 0 else None

    def _hold_first_token(self, seq: Sequence, final: bool, error: str | None) -> bool:
        """Whether to hold this output back: nothing emitted yet, a token (or a normal finish) to
        emit and the tier's TTFT floor not reached. Errors and aborts are never held."""
        if error is not None or seq.emitted_token_count or not seq.output_token_ids:
            return False
        if final and seq.finish_reason is FinishReason.ABORT:
            return False
        until = self._ttft_floor_until(seq)
        if until is None or self.clock() >= until:
            return False
        self._first_tokens_held[seq.request_id] = (until, seq, error)
        return True

    def _release_first_tokens(self) -> None:
        """Emit held outputs whose floor has passed (everything committed since, in one message)."""
        now = self.clock()
        for request_id, (until, seq, error) in list(self._first_tokens_held.items()):
            if now >= until:
                del self._first_tokens_held[request_id]
                self._emit(seq, final=seq.is_finished, error=error, release=True)

    def next_release_time(self) -> float | None:
        """Earliest time (engine clock) a held first token is due, or None (for virtual-clock drivers)."""
        with self._state_lock:
            return min((u for u, _, _ in self._first_tokens_held.values()), default=None)

    def _emit(self, seq: Sequence, final: bool, error: str | None = None, release: bool = False) -> None:
        if seq.final_only and not final and error is None:
            return  # its caller takes the final output only: nothing to build per iteration
        held = self._first_tokens_held
        if not release and (seq.request_id in held or self._hold_first_token(seq, final, error)):
            if seq.request_id in held and (error is not None or (final and seq.finish_reason is FinishReason.ABORT)):
                del held[seq.request_id]  # errors and aborts go out at once
            else:
                return
        holdback = 0 if final else stop_string_holdback(seq.output_text, seq.sampling.stop)
        end = max(seq.emitted_text_len, len(seq.output_text) - holdback)
        delta = seq.output_text[seq.emitted_text_len:end]
        seq.emitted_text_len = end
        new_tokens = seq.output_token_ids[seq.emitted_token_count:]
        new_logprobs = seq.output_logprobs[seq.emitted_token_count:] if seq.output_logprobs else []
        seq.emitted_token_count = len(seq.output_token_ids)
        out = RequestOutput(
            request_id=seq.request_id, token_ids=new_tokens, text_delta=delta,
            finish_reason=seq.finish_reason if final else None,
            prompt_tokens=len(seq.prompt_token_ids), completion_tokens=len(seq.output_token_ids),
            cached_tokens=seq.num_cached_tokens, timings=self._timings(seq),
            iteration=self.scheduler.core.iteration, error=error, logprobs=new_logprobs,
        )
        if final:
            with self._lock:
                callback = self._callbacks.pop(seq.request_id, None)
        else:
            callback = self._callbacks.get(seq.request_id)
        if callback is not None:
            try:
                callback(out)
            except Exception:
                log.exception("output callback for %s failed", seq.request_id)

    def _timings(self, seq: Sequence) -> RequestTimings:
        """`seq`'s timings so far, from its arrival, first scheduling and first token."""
        return RequestTimings(
            queued_s=None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time,
            first_token_s=None if seq.first_token_time is None else self._first_token_s(seq),
            queued_iterations=None if seq.first_scheduled_iteration is None
            else seq.first_scheduled_iteration - seq.arrival_iteration,
            first_token_iterations=None if seq.first_token_iteration is None
            else seq.first_token_iteration - seq.arrival_iteration)

    def _first_token_s(self, seq: Sequence) -> float:
        """Seconds from arrival to the first token as the client sees it (the TTFT floor included)."""
        t = seq.first_token_time
        until = self._ttft_floor_until(seq)
        return (t if until is None else max(t, until)) - seq.arrival_time

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        if self.recorder is not None:
            self.recorder.on_finish(seq.request_id, seq.finish_time, reason.value)
        self._emit(seq, final=True, error=error)

    # ---- hand-back (worker/scheduling/handback.py) --------------------------------------------------
    def _hand_back(self) -> None:
        """Hand back what the rule picks this iteration: each request's output ends before any token
        with `FinishReason.HANDED_BACK` (not recorded as finished: it goes on elsewhere)."""
        pool = self.pool
        room = None
        if pool.workers:
            accounts = self.policy.accounts

            def room(tenant_id: str, tier: str) -> bool:
                acct = accounts.get(tenant_id)
                return pool.room_elsewhere(tenant_id, tier, acct.virtual_counter if acct is not None else 0.0)
        for seq in self.scheduler.hand_back(self.hand_back_rule, room):
            self._emit(seq, final=True)

    # ---- the pool (worker/scheduling/pool.py) -------------------------------------------------------
    def pool_report(self) -> dict:
        """What this worker publishes to the pool board, per tenant: (charged service units, weight,
        tier, backlogged, counter, running requests). Safe on any thread."""
        with self._state_lock:
            running: dict[str, int] = {}
            for seq in self.scheduler.running:
                running[seq.tenant_id] = running.get(seq.tenant_id, 0) + 1
            return self.pool.report(self.policy, running)

    def pool_apply(self, reports) -> None:
        """Take the other workers' reports (`fairshare.pool_board.WorkerReport`s) into the policy's
        counters (pool-wide VTC; `worker.scheduling.pool`). Safe on any thread."""
        with self._state_lock:
            self.pool.apply(reports, self.policy)

    # ---- introspection --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Load figures for GetLoad / metrics (safe on any thread; may be one step stale)."""
        with self._state_lock:
            return self._with_pool(self._with_cache(self._snapshot()))

    def _with_pool(self, snap: dict) -> dict:
        """Add the pool counters' figures: other workers in the last board read (pool_workers), and
        per tenant the service units charged to it elsewhere as seen so far (pool_service)."""
        snap["pool_workers"] = self.pool.workers
        for t in snap["tenants"]:
            t["pool_service"] = self.pool.elsewhere.get(t["tenant_id"], 0.0)
        return snap

    def _with_cache(self, snap: dict) -> dict:
        """Add the prefix cache's figures: pool-wide (cache_blocks, cache_public_blocks,
        cache_hit_tokens, cache_lookup_tokens, cache_evictable_blocks) and per tenant (cache_blocks:
        its footprint; cached_prompt_tokens: prompt tokens it was served from the cache)."""
        cache = self.cache
        snap["prefix_cache"] = cache is not None
        if cache is None:
            snap.update(cache_blocks=0, cache_public_blocks=0, cache_hit_tokens=0, cache_lookup_tokens=0,
                        cache_evictable_blocks=0)
            for t in snap["tenants"]:
                t.update(cache_blocks=0, cached_prompt_tokens=0)
            return snap
        st = cache.stats
        snap.update(cache_blocks=cache.num_blocks, cache_public_blocks=cache.num_public_blocks,
                    cache_hit_tokens=st.tokens.hit_tokens, cache_lookup_tokens=st.tokens.lookup_tokens,
                    cache_evictable_blocks=cache.num_evictable)
        for t in snap["tenants"]:
            tid = t["tenant_id"]
            t["cache_blocks"] = cache.footprint(tid)
            t["cached_prompt_tokens"] = st.by_tenant[tid].hit_tokens if tid in st.by_tenant else 0
        return snap

    def _snapshot(self) -> dict:
        counts = self.scheduler.tenant_counts()
        stats = self.scheduler.core.stats  # per-tenant counters (worker/scheduling/core.py, CoreStats)
        tenants = []
        for tid, acct in sorted(self.policy.accounts.items()):
            c = counts.get(tid, {"waiting": 0, "running": 0, "kv_blocks": 0})
            tenants.append({
                "tenant_id": tid, "weight": acct.weight, "tier": acct.tier,
                "virtual_counter": acct.virtual_counter, "charged_service": acct.charged_service,
                "prompt_tokens": acct.prompt_tokens, "output_tokens": acct.output_tokens,
                "waiting": c["waiting"], "running": c["running"], "kv_blocks": c["kv_blocks"],
                "finished": stats.finished_by_tenant.get(tid, 0),
                "preemptions": stats.preemptions_by_tenant.get(tid, 0),
                "quota_waits": stats.quota_waits.get(tid, 0),
                "handed_back": stats.handed_back_by_tenant.get(tid, 0),
                "backlogged": acct.backlogged,
            })
            if self.quota is not None:
                tenants[-1].update(self.quota.state(tid, c["kv_blocks"]))
        inflight = sum(len(s.prompt_token_ids) + s.max_tokens - len(s.output_token_ids)
                       for s in list(self.scheduler.by_id.values()))
        core = self.scheduler.core
        return {
            "waiting": self.scheduler.num_waiting(), "running": len(self.scheduler.running),
            "kv_blocks_used": self.block_manager.num_used, "kv_blocks_total": self.block_manager.num_blocks,
            "kv_block_size": self.block_manager.block_size, "tenants": tenants, "policy": self.policy.name,
            "iterations": self.scheduler.stats.iterations, "inflight_tokens": inflight,
            "kv_quota": self.quota is not None, "preemptions": self.scheduler.stats.preemptions,
            "reclaim_preemptions": self.scheduler.reclaim_preemptions,
            "returning_preemptions": core.stats.preemptions["returning"],
            "preemptions_by_reason": dict(core.stats.preemptions),
            "tier_scheduling": self.tiers.enabled, "tiers": core.tier_snapshot(),
            "iteration_token_target": core.iteration_token_target,
            "lower_tier_token_target": core.lower_tier_token_target,
        }


def _argmax_only(seq: Sequence) -> bool:
    """Whether only the argmax of this sequence's logits is used: greedy, no logprobs, no grammar."""
    p = seq.sampling
    return p.temperature <= 0.0 and not p.logprobs and seq.constraint is None and p.grammar is None


def _token_slice(seq: Sequence, start: int, n: int) -> list[int]:
    """`seq.all_token_ids[start:start + n]` without building the whole list."""
    prompt = seq.prompt_token_ids
    p = len(prompt)
    if start + n <= p:
        return prompt[start:start + n]
    if start >= p:
        return seq.output_token_ids[start - p:start - p + n]
    return prompt[start:] + seq.output_token_ids[:start + n - p]
