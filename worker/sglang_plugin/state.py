"""Scheduler-side FairShare state for one SGLang scheduler process.

Imports neither sglang nor torch. It works on SGLang 0.5.23 `Req` objects by duck typing, reading
only these fields: `rid`, `origin_input_ids`, `output_ids`, `prefix_len`, `extend_end`,
`is_retracted`, `finished()`, `extra_key`, `cache_salt`, `lora_id`, `sampling_params` (`custom_params`,
`max_new_tokens`) — and it writes `extra_key` (namespace enforcement) and one attribute of its own,
`fairshare_tag`.

Every scheduling decision is the reference engine's scheduling core's
(`worker.scheduling.core.SchedulingCore`): queues, tiers, the fairness policy's picks, admission,
preemption; this module reports SGLang's state to it (as its `Executor`) and carries out its plan
through the hooks (`worker.sglang_plugin.hooks`). Charges go to the policy (`policy.charge`), which
the core hears.

Determinism: each tensor-parallel rank runs its own scheduler on the same inputs, so every
decision here is a function of the requests and of the order of hook calls only: no clocks, no
randomness, no iteration over sets of strings (whose order depends on the per-process hash seed);
ties break by tenant id and by queue position.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from worker.scheduling.core import OUT_OF_BLOCKS, SchedulingCore
from worker.scheduling.cost import CostFunction, LinearCost
from worker.scheduling.policy import SchedulingPolicy, make_policy
from worker.scheduling.quota import KVQuota, KVQuotaConfig
from worker.scheduling.tiers import TierShares, validate_min_shares
from worker.sglang_plugin import tenant as tenant_mod
from worker.sglang_plugin.tenant import TenantTag

log = logging.getLogger("fairshare.sglang_plugin")

TAG_ATTR = "fairshare_tag"


@dataclass
class TrackedRequest:
    """One live request as the plugin accounts it.

    prompt_len: prompt tokens. arrival: arrival sequence number in this process. prompt_accounted:
    prompt positions [0, prompt_accounted) already charged (computed or cached; recomputation after
    a retraction is never charged again). outputs_charged: output tokens charged (a high-water mark
    of `len(output_ids)`, so a step seen twice or several tokens per step are charged once).
    """

    rid: str
    tag: TenantTag
    prompt_len: int
    max_new_tokens: int
    arrival: int
    prompt_accounted: int = 0
    outputs_charged: int = 0
    admitted: bool = False


class FairShareState:
    """Tenant accounts, per-request charging and the scheduling core for one SGLang scheduler.

    Every scheduling decision is the scheduling core's (`worker.scheduling.core.SchedulingCore`,
    the reference engine's own): this object is the core's `Executor` over SGLang `Req`s and turns
    the core's plan for a scheduling pass into what SGLang's hooks can impose (the waiting-queue
    order, the requests the prefill adder may admit and how many tokens each, the chunk to park,
    the requests to release before the pass). docs/sglang-backend.md maps each decision.

    policy: a policy name for `make_policy` (`vtc`, `vtc-pred`, `drr`, `fcfs`) or a
    `SchedulingPolicy`. cost: the cost function (default `LinearCost()`; ignored when a policy
    object is given). secret: HMAC secret for tenant tokens (None: every request is unverified).
    kv_quota: the reference worker's KV quota settings (`KVQuotaConfig`: soft quotas, hard caps,
    watermark, headroom, in fractions of SGLang's KV pool; None or disabled: off), enforced by the
    core's admission and victim rules. tier_min_shares / tier_scheduling: the tiers' minimum
    shares of service and strict priority (`TierShares`, as `fairshare worker` flags them).
    returning: returning-tenant preemption (default: every policy but FCFS, as the reference
    engine builds it). max_skips: memory skips before a reservation.
    """

    def __init__(self, policy: str | SchedulingPolicy = "vtc", cost: CostFunction | None = None, *,
                 secret: str | None = None, kv_quota: KVQuotaConfig | None = None,
                 tier_min_shares: dict[str, float] | None = None, tier_scheduling: bool = True,
                 returning: bool | None = None, max_skips: int = 8, **policy_options) -> None:
        if isinstance(policy, SchedulingPolicy):
            self.policy = policy
        else:
            self.policy = make_policy(policy, cost or LinearCost(), **policy_options)
        self.cost = self.policy.cost
        self.secret = secret
        if kv_quota is not None:
            kv_quota.validate()
        self.kv_quota = kv_quota if kv_quota is not None and kv_quota.enabled else None
        self.tier_min_shares = validate_min_shares(tier_min_shares or {})
        self.tier_scheduling = tier_scheduling
        self.returning = self.policy.name != "fcfs" if returning is None else returning
        self.max_skips = max_skips
        self.tracked: dict[str, TrackedRequest] = {}
        self.live: dict[str, int] = {}          # tenant -> tracked requests
        self.finished: dict[str, int] = {}      # tenant -> requests ended (any reason)
        self.retractions: dict[str, int] = {}   # tenant -> requests retracted
        self.plan_refusals = 0                  # planned admissions SGLang did not carry out
        self._arrivals = 0
        self._used_rids: dict[str, int] = {}   # rid -> expiry of the token it was verified with (replay)
        self._token_expiries: list[tuple[int, str]] = []
        self._core: SchedulingCore | None = None
        self.scheduler = None                   # the SGLang Scheduler this state serves
        self._batch = None                      # the running batch of the pass being planned
        self._sglang_retracted = False          # a preemption SGLang already carried out
        self._cached: dict[str, int] = {}       # rid -> cached prefix matched for this pass's plan
        self.plan: PassPlan | None = None

    # ---- the core -----------------------------------------------------------------------------
    @property
    def core(self) -> SchedulingCore:
        """The scheduling core, built on first use with the bound scheduler's sizes (KV pool,
        running slots, chunk) or, unbound, an unbounded pool."""
        if self._core is None:
            s = self.scheduler
            page = self.page_size
            chunk = int(getattr(s, "chunked_prefill_size", None) or 0) if s is not None else 0
            if chunk <= 0:
                chunk = int(getattr(s, "max_prefill_tokens", 0) or 0) if s is not None else 0
            chunk = chunk if chunk > 0 else 8192
            if s is not None:
                total = max(1, int(s.token_to_kv_pool_allocator.size) // page)
                slots = max(1, int(getattr(s, "max_running_requests", None) or 1 << 20))
            else:
                total, slots = 1 << 40, 1 << 20
            # SGLang admits whole requests and truncates only the last one (sglang-backend.md
            # "cannot" 1): the core picks at that granularity, a slice = the chunk
            quota = KVQuota(self.kv_quota, total) if self.kv_quota is not None else None
            tiers = TierShares(self.tier_min_shares, floor_units=self.cost.max_prefill_rate * chunk / 2,
                               enabled=self.tier_scheduling)
            self._core = SchedulingCore(self.policy, self.cost, self, total_blocks=total, max_running=slots,
                                        chunk_tokens=chunk, prefill_slice=chunk, max_skips=self.max_skips,
                                        quota=quota, returning=self.returning, tiers=tiers,
                                        max_partial_prefills=1)
        return self._core

    def bind(self, scheduler) -> None:
        """Serve `scheduler` (an SGLang `Scheduler`; the hooks call this with `self`)."""
        if (scheduler is not None and self.scheduler is None and self._core is None
                and hasattr(scheduler, "token_to_kv_pool_allocator") and hasattr(scheduler, "tree_cache")):
            self.scheduler = scheduler

    @property
    def page_size(self) -> int:
        return max(1, int(getattr(self.scheduler, "page_size", 1) or 1)) if self.scheduler is not None else 1

    def _pages(self, tokens: int) -> int:
        p = self.page_size
        return -(-max(0, int(tokens)) // p)

    # ---- the core's Executor protocol (handles are SGLang Reqs) ---------------------------------
    @staticmethod
    def _total(req) -> int:
        return len(req.origin_input_ids) + len(req.output_ids)

    def _computed(self, req) -> int:
        """Tokens of `req` whose KV is there: committed, or, for a request the current plan
        admits, the cached prefix SGLang's radix tree matched (`_match_prefix`)."""
        kv = getattr(req, "kv", None)
        done = int(getattr(kv, "kv_committed_len", 0) or 0) if kv is not None else int(getattr(req, "extend_end", 0) or 0)
        return max(done, self._cached.get(req.rid, 0))

    def _match_prefix(self, req) -> None:
        """On the core's admission of waiting `req` in a pass plan: match its prompt against
        SGLang's radix tree as the prefill loop is about to (`Req.init_next_round_input`, called
        again by `_get_new_batch_prefill_raw` before `add_one_req`), so that the plan gives it only
        the tokens the tree does not hold, as the reference engine attaches a cached prefix on
        admission (`BlockManager.attach_prefix`)."""
        s = self.scheduler
        cache = getattr(s, "tree_cache", None)
        if cache is None or getattr(s, "disable_radix_cache", False) or not hasattr(req, "init_next_round_input"):
            return
        req.init_next_round_input(cache)
        cached = int(getattr(req, "prefix_len", 0) or 0)
        if cached > 0:
            self._cached[req.rid] = cached

    def admission_need(self, req) -> int:
        """Pages a waiting request takes from SGLang's prefill budget to be admitted whole: its
        prompt and outputs so far, plus what `PrefillAdder.add_one_req` reserves beside them (its
        remaining new tokens, clipped at `CLIP_MAX_NEW_TOKENS`, and one page of overhead). Unbound:
        its prompt and outputs only."""
        return self._pages(self._total(req))

    def mixed_decode_tokens(self) -> int:
        """Tokens the pass's decodes take beside the prefill: one per running request when they
        ride along with mixed chunked prefill (`PrefillAdder.__init__`'s
        `num_mixed_decode_tokens`, in `memory_budget.current_offset`), else none."""
        s = self.scheduler
        if not getattr(s, "is_mixed_chunk", False):
            return 0
        batch = self._batch if self._batch is not None else getattr(s, "running_batch", None)
        return len(getattr(batch, "reqs", None) or ())

    def blocks_held(self, req) -> int:
        kv = getattr(req, "kv", None)
        return self._pages(getattr(kv, "kv_allocated_len", 0) or 0) if kv is not None else 0

    def blocks_promised(self, req) -> int:
        return max(0, self._pages(self._total(req)) - self.blocks_held(req))

    def prefill_left(self, req) -> int:
        n = self._total(req) - self._computed(req)
        return n if n > 1 else 0

    def prefill_room(self, req, have: int) -> int:
        """Tokens a running prefill can take this pass: its pages and the free room (`free_blocks`),
        as `PrefillAdder.add_chunked_req` limits a continued chunk; when that is
        used up, what the pool physically has (SGLang continues a chunk regardless, so that it
        finishes and frees its KV: `PrefillBudget.available_chunk_tokens`)."""
        held, computed, page = self.blocks_held(req), self._computed(req), self.page_size
        room = (held + self.free_blocks()) * page - computed - have
        if room <= 0 and have == 0 and self.scheduler is not None:
            room = (held + self._physical_free() // page) * page - computed
        return room

    def _physical_free(self) -> int:
        s = self.scheduler
        return int(s.token_to_kv_pool_allocator.available_size()) + int(s.tree_cache.evictable_size())

    def free_blocks(self) -> int:
        """Pages an admission can get now: free plus evictable, less the decodes riding along with
        mixed chunked prefill (`mixed_decode_tokens`) and one token (SGLang admits while a
        request's tokens are strictly below its budget). SGLang's estimates of future decode tokens
        are not held back: with a plan, `FairSharePrefillAdder` drops them from its budget, so
        admission is the core's rule on the room there is now, the reference engine's (a decode
        that runs short is retracted). Unbound: the whole pool."""
        if self.scheduler is None:
            return self.core.ledger.total_blocks
        return max(0, self._physical_free() - self.mixed_decode_tokens() - 1) // self.page_size

    def preempt(self, req) -> None:
        """Carry out the core's recompute preemption with SGLang's own functions (as
        `Scheduler.update_running_batch` does after `retract_decode`): `release_req`,
        `filter_batch`, then `_add_request_to_queue(req, is_retracted=True)`."""
        if self._sglang_retracted:
            return  # SGLang retracted it itself; the core only records it
        s, batch = self.scheduler, self._batch
        if s is None or batch is None:
            raise RuntimeError("fairshare: a preemption outside a scheduling pass")
        if req is getattr(s, "chunked_req", None):
            from sglang.srt.managers.schedule_batch import release_req

            release_req(req=req, remaing_req_count=len(batch.reqs), req_to_token_pool=s.req_to_token_pool,
                        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, tree_cache=s.tree_cache,
                        hisparse_coordinator=None)
            s.chunked_req = None
        else:
            idx = next(i for i, r in enumerate(batch.reqs) if r is req)
            batch.release_req(idx, len(batch.reqs) - 1)
            batch.filter_batch(keep_indices=[i for i in range(len(batch.reqs)) if i != idx])
        batch.batch_is_full = False
        self._sglang_retracted = True  # the core requeues it itself once this returns
        try:
            s._add_request_to_queue(req, is_retracted=True)
        finally:
            self._sglang_retracted = False

    # ---- identity ---------------------------------------------------------------------------
    def tag_of(self, req) -> TenantTag:
        """The request's tenant (verified once, then cached on the request). Also enforces the
        namespace: a verified request's `extra_key` is set to the one the worker derives from its
        tenant and `cache_salt` (`tenant.extra_key_for`, plus SGLang's own LoRA id or
        `|`-separated suffixes); an unverified request's is moved under `fsu|`."""
        tag = getattr(req, TAG_ATTR, None)
        if tag is not None:
            return tag
        verified = tenant_mod.verify(tenant_mod.custom_params_token(getattr(req, "sampling_params", None)),
                                     self.secret, rid=str(getattr(req, "rid", "")))
        tag = None
        if verified is not None and self._first_use(str(req.rid), verified[1]):
            tag = verified[0]
        current = getattr(req, "extra_key", None) or ""
        if tag is not None:
            expected = (tenant_mod.extra_key_for(tag.tenant_id, getattr(req, "cache_salt", None), self.secret)
                        + (getattr(req, "lora_id", None) or ""))
            if current != expected and not current.startswith(expected + "|"):
                req.extra_key = expected
        else:
            tag = tenant_mod.unverified_tag()
            if not current.startswith(tenant_mod.UNVERIFIED_PREFIX):
                req.extra_key = tenant_mod.UNVERIFIED_PREFIX + current
        setattr(req, TAG_ATTR, tag)
        return tag

    def _first_use(self, rid: str, expiry: int) -> bool:
        """Whether this is the first request object carrying a valid token for `rid` (remembered
        until the token's expiry): a second one is a replay."""
        now = time.time()
        while self._token_expiries and self._token_expiries[0][0] < now:
            exp, old = heapq.heappop(self._token_expiries)
            if self._used_rids.get(old) == exp:
                del self._used_rids[old]
        if rid in self._used_rids:
            log.warning("fairshare: the tenant token of request %s was already used; accounting it as unverified", rid)
            return False
        self._used_rids[rid] = expiry
        heapq.heappush(self._token_expiries, (expiry, rid))
        return True

    # ---- events -----------------------------------------------------------------------------
    def on_arrival(self, req, is_retracted: bool = False) -> None:
        """Before SGLang queues `req` (`Scheduler._add_request_to_queue`). A new request is queued
        in the core (its tenant backlogged, lifted by VTC); a request SGLang retracted is a
        recompute preemption for the core (`SchedulingCore.preempt`: back at the front of its
        tenant's queue, its counter lifted as for any arrival when the tenant was not backlogged)."""
        tag = self.tag_of(req)
        tr = self.tracked.get(req.rid)
        if tr is None:
            self._track(req, tag)
            if is_retracted:
                self.retractions[tag.tenant_id] = self.retractions.get(tag.tenant_id, 0) + 1
            return
        if is_retracted:
            self.retractions[tag.tenant_id] = self.retractions.get(tag.tenant_id, 0) + 1
        e = self.core.entries.get(req.rid)
        if e is not None and e.running and not self._sglang_retracted:
            # SGLang's own retraction (ScheduleBatch.retract_decode): the core requeues it
            self._sglang_retracted = True
            try:
                self.core.preempt(e, OUT_OF_BLOCKS)
            finally:
                self._sglang_retracted = False

    def _track(self, req, tag: TenantTag) -> TrackedRequest:
        params = getattr(req, "sampling_params", None)
        max_new = getattr(params, "max_new_tokens", None)
        tr = TrackedRequest(rid=req.rid, tag=tag, prompt_len=len(req.origin_input_ids),
                            max_new_tokens=int(max_new) if max_new is not None else 0, arrival=self._arrivals)
        self._arrivals += 1
        self.tracked[req.rid] = tr
        self.live[tag.tenant_id] = self.live.get(tag.tenant_id, 0) + 1
        self.core.add(req.rid, tag.tenant_id, req, weight=tag.weight, tier=tag.tier, arrival=float(tr.arrival),
                      prompt_tokens=tr.prompt_len, max_tokens=tr.max_new_tokens)
        return tr

    def _get(self, req) -> TrackedRequest:
        tr = self.tracked.get(req.rid)
        if tr is None:  # queued by a path that bypassed _add_request_to_queue: account it
            tr = self._track(req, self.tag_of(req))
        return tr

    def _end(self, tr: TrackedRequest) -> None:
        t = tr.tag.tenant_id
        self.core.finish(tr.rid, tr.prompt_len, tr.outputs_charged)
        del self.tracked[tr.rid]
        self.finished[t] = self.finished.get(t, 0) + 1
        n = self.live[t] = self.live.get(t, 1) - 1
        if n <= 0:
            del self.live[t]

    # ---- one scheduling pass: the core's plan ---------------------------------------------------
    def begin_pass(self, scheduler, running_batch) -> "PassPlan":
        """Before `Scheduler.get_new_batch_prefill(self, running_batch)`: one iteration of the
        core, as the reference engine runs it (`worker/engine/scheduler.py` `schedule`).

        `begin_iteration` (tier, reclaim and returning-tenant preemptions, carried out by
        `preempt`), then the prefill round over the pass's token budget (SGLang's chunk less the
        decodes riding along with mixed chunked prefill): each pick admits a waiting head or
        continues the running partial prefill, takes up to the budget, and is charged at once, so
        the policy's counters move between picks exactly as in the reference. The plan (requests
        and tokens, in order) is what the prefill adder then carries out. Returns it."""
        self.bind(scheduler)
        if self.scheduler is not scheduler:
            raise RuntimeError("fairshare: one plugin state serves one SGLang scheduler")
        core = self.core
        self._batch = running_batch
        try:
            for req in list(scheduler.waiting_queue):
                self._get(req)
            core.begin_iteration(self.free_blocks(), self._promised())
            decodes = sum(1 for e in core.running.values() if self.prefill_left(e.handle) == 0)
            budget = core.chunk_tokens - (decodes if getattr(scheduler, "is_mixed_chunk", False) else 0)
            plan = PassPlan()
            if budget > 0:
                core.begin_prefill(budget, self.free_blocks(), self._promised())
                while (e := core.next_prefill()) is not None:
                    req = e.handle
                    if not e.running:
                        core.admit(e)
                        self.tracked[e.request_id].admitted = True
                        plan.admitted.append(req)
                        self._match_prefix(req)
                    have = core.allocated(e)
                    n = min(core.prefill_slice, self._total(req) - self._computed(req) - have, core.prefill_budget,
                            self.prefill_room(req, have))
                    if n <= 0:
                        core.cannot_serve(e)
                        continue
                    self._charge_planned(req, self._computed(req) + have, n)
                    plan.tokens[req.rid] = plan.tokens.get(req.rid, 0) + n
                    core.served(e, n)
                core.end_prefill()
            core.end_iteration()
        finally:
            self._batch = None
        if plan.tokens:
            running_batch.batch_is_full = False  # the core has admissible work: undo SGLang's latch
        self.plan = plan
        return plan

    def _promised(self) -> int:
        return sum(self.blocks_promised(e.handle) for e in self.core.running.values())

    def _charge_planned(self, req, start: int, n: int) -> None:
        """Charge the prompt positions in [start, start+n) never charged before (as the reference
        charges a slice when it is scheduled; `charge_prefill` then finds them accounted). Prompt
        positions below `start` never charged before are the cached prefix the plan matched: charged
        at the cost function's cached rate, as the reference charges an attached prefix."""
        tr = self.tracked[req.rid]
        done = tr.prompt_accounted
        cached = max(0, min(start, tr.prompt_len) - done)
        lo = max(start, done)
        hi = min(start + n, tr.prompt_len)
        computed = max(0, hi - lo)
        if computed or cached:
            units = self.cost.prefill(computed, cached, start=done)
            self.policy.charge(tr.tag.tenant_id, units, prompt_tokens=computed, request_id=tr.rid)
            tr.prompt_accounted = max(done, hi, min(start, tr.prompt_len))

    def planned_tokens(self, req) -> int | None:
        """Tokens the current pass's plan gives `req` (None: not in the plan, or no plan)."""
        return None if self.plan is None else self.plan.tokens.get(req.rid)

    def end_pass(self, batch) -> list[str]:
        """After `get_new_batch_prefill`: planned admissions SGLang did not carry out (its own
        memory check refused them, sglang-backend.md "cannot" 4, or a second partial prefill,
        "cannot" 1) go back to the front of their tenant's queue in the core. Returns their ids."""
        plan, self.plan = self.plan, None
        self._cached = {}
        if plan is None:
            return []
        ran = {r.rid for r in (batch.reqs if batch is not None else ())}
        missed = [r for r in plan.admitted if r.rid not in ran and not r.finished()]
        for req in missed:
            e = self.core.entries.get(req.rid)
            if e is not None and e.running:
                self._sglang_retracted = True
                try:
                    self.core.preempt(e, OUT_OF_BLOCKS)
                finally:
                    self._sglang_retracted = False
        self.plan_refusals += len(missed)
        return [r.rid for r in missed]

    # ---- ordering ---------------------------------------------------------------------------
    def order_waiting(self, waiting_queue: list) -> None:
        """Reorder SGLang's waiting queue in place (after `SchedulePolicy.calc_priority`): the
        current pass's planned admissions first, in the plan's order, then every other waiting
        request in the core's admission order (`SchedulingCore.admission_order`: owed tiers first,
        then tiers by priority, within a tier the policy's projected order, a tenant's retracted
        requests ahead of its newer work)."""
        for req in waiting_queue:
            self._get(req)
        if len(waiting_queue) < 2:
            return
        rank: dict[str, int] = {}
        for req in (self.plan.admitted if self.plan is not None else ()):
            rank.setdefault(req.rid, len(rank))
        for req in self.core.admission_order():
            rank.setdefault(req.rid, len(rank))
        last = len(rank)
        keyed = [(rank.get(r.rid, last), i, r) for i, r in enumerate(waiting_queue)]
        keyed.sort(key=lambda k: (k[0], k[1]))
        waiting_queue[:] = [r for _, _, r in keyed]

    # ---- charging ---------------------------------------------------------------------------
    def charge_prefill(self, reqs: Iterable, skip: Sequence = ()) -> float:
        """Charge the prefill a new batch will compute (after `Scheduler.get_new_batch_prefill`).

        For each request, this round extends positions [prefix_len, extend_end). Prompt positions
        not yet accounted are charged: those SGLang computes at α each, those it found in the radix
        cache (below prefix_len, first time only) at the cost function's cached rate. Output
        positions recomputed after a retraction, and prompt positions recomputed after one, are not
        charged again. `skip`: requests riding along as decodes (mixed chunked prefill), charged
        per output token instead. Returns the units charged.
        """
        skip_ids = {id(r) for r in skip}
        total = 0.0
        for req in reqs:
            if id(req) in skip_ids or getattr(req, "extend_end", None) is None:
                continue
            tr = self._get(req)
            t = tr.tag.tenant_id
            if not tr.admitted:  # admitted outside the core's plan (no plan was made for the pass)
                tr.admitted = True
                e = self.core.entries.get(tr.rid)
                if e is not None and not e.admitted_once:
                    e.admitted_once = True
                    self.policy.on_admit(t, tr.rid, tr.prompt_len, tr.max_new_tokens)
            lo, hi, p = int(req.prefix_len), int(req.extend_end), tr.prompt_len
            done = tr.prompt_accounted
            cached = max(0, min(lo, p) - done)
            start = max(lo, done)
            computed = max(0, min(hi, p) - start)
            if cached or computed:
                units = self.cost.prefill(computed, cached, start=done)
                self.policy.charge(t, units, prompt_tokens=computed, request_id=tr.rid)
                tr.prompt_accounted = max(done, min(hi, p))
                total += units
        return total

    def charge_outputs(self, reqs: Iterable) -> float:
        """Charge committed output tokens and retire finished requests (after
        `Scheduler.process_batch_result`). Idempotent per step: a request is charged for
        `len(output_ids)` minus what it was already charged, so several tokens in one step
        (speculative decoding) are all charged and a step processed twice (overlap scheduling) is
        charged once. Returns the units charged."""
        total = 0.0
        for req in reqs:
            tr = self.tracked.get(req.rid)
            if tr is None:
                if req.finished():
                    continue
                tr = self._get(req)
            n = len(req.output_ids) - tr.outputs_charged
            if n > 0:
                units = self.cost.decode(n, tr.prompt_len, tr.outputs_charged)
                self.policy.charge(tr.tag.tenant_id, units, output_tokens=n, request_id=tr.rid)
                tr.outputs_charged += n
                total += units
            if req.finished():
                self._end(tr)
        return total

    def reconcile(self, live_reqs: Iterable) -> list[str]:
        """Retire tracked requests that are no longer anywhere in the scheduler (aborted while
        waiting: SGLang pops them from the queue without a batch result). Returns their ids."""
        live = {r.rid for r in live_reqs if r is not None}
        gone = [rid for rid in self.tracked if rid not in live]
        for rid in gone:
            self._end(self.tracked[rid])
        return gone

    # ---- retraction -------------------------------------------------------------------------
    def retraction_order(self, reqs: list) -> list[int]:
        """Indices of `reqs` from most- to least-preferred to keep (SGLang's
        `ScheduleBatch.retract_decode` retracts from the end): the scheduling core's victim rule,
        the reference engine's own (`RoomMaker.victims_in_order`, reason out of blocks, for nobody
        in particular: the whole decode batch needs room). So the first request retracted is the
        core's first victim: the lowest tier (of those it may take), with KV quotas the tenant
        furthest over its soft quota, requests admitted without a memory reservation before those
        admitted with one, then the newest admission. Requests the core does not hold as running
        (none in a consistent run) are kept first, in SGLang's order."""
        core = self.core
        at: dict[int, int] = {}
        entries = []
        unknown = []
        for i, req in enumerate(reqs):
            e = core.entries.get(getattr(req, "rid", None))
            if e is not None and e.running and id(e) not in at:
                at[id(e)] = i
                entries.append(e)
            else:
                unknown.append(i)
        entries.sort(key=lambda e: e.order)
        victims = [at[id(e)] for e in core.room.victims_in_order(entries, None, OUT_OF_BLOCKS)]
        return unknown + victims[::-1]

    # ---- introspection ----------------------------------------------------------------------
    def engine_snapshot(self) -> dict:
        """The scheduler's figures in the reference engine's `Engine.snapshot()` shape (what
        `worker.metrics.EngineCollector` exports): waiting / running requests, KV pages used and
        total, tokens in flight, iterations, preemptions by reason, the core's tier table, and per
        tenant its weight, tier, virtual counter, service, tokens, queue, running requests, KV pages
        held, finished requests, preemptions, quota waits (and the quota's figures with KV quotas).
        Plain numbers, strings and dicts only (SGLang sends it across processes with msgpack)."""
        core = self.core
        blocks: dict[str, int] = {}
        for e in core.running.values():
            blocks[e.tenant_id] = blocks.get(e.tenant_id, 0) + self.blocks_held(e.handle)
        tenants = []
        for tid, acct in sorted(self.policy.accounts.items()):
            ts = core.tenants.get(tid)
            t = {"tenant_id": tid, "weight": acct.weight, "tier": acct.tier,
                 "virtual_counter": acct.virtual_counter, "charged_service": acct.charged_service,
                 "prompt_tokens": acct.prompt_tokens, "output_tokens": acct.output_tokens,
                 "waiting": len(ts.waiting) if ts is not None else 0,
                 "running": len(ts.running) if ts is not None else 0, "kv_blocks": blocks.get(tid, 0),
                 "finished": self.finished.get(tid, 0), "preemptions": core.stats.preemptions_by_tenant.get(tid, 0),
                 "retractions": self.retractions.get(tid, 0), "quota_waits": core.stats.quota_waits.get(tid, 0),
                 "backlogged": acct.backlogged}
            if core.quota is not None:
                t.update(core.quota.state(tid, blocks.get(tid, 0)))
            tenants.append(t)
        total = core.ledger.total_blocks
        used = total - self._physical_free() // self.page_size if self.scheduler is not None else 0
        return {"waiting": core.num_waiting(), "running": len(core.running), "kv_blocks_used": max(0, used),
                "kv_blocks_total": total, "kv_block_size": self.page_size, "tenants": tenants,
                "policy": self.policy.name, "iterations": core.stats.iterations,
                "inflight_tokens": sum(max(0, tr.prompt_len + tr.max_new_tokens - tr.outputs_charged)
                                       for tr in self.tracked.values()),
                "kv_quota": core.quota is not None, "preemptions_by_reason": dict(core.stats.preemptions),
                "tier_scheduling": core.tiers.enabled, "tiers": core.tier_snapshot(),
                "plan_refusals": self.plan_refusals}

    def snapshot(self) -> dict:
        """Per-tenant counters (for logs and tests)."""
        out = {}
        for t, a in sorted(self.policy.accounts.items()):
            out[t] = {"weight": a.weight, "tier": a.tier, "virtual_counter": a.virtual_counter,
                      "charged_service": a.charged_service, "prompt_tokens": a.prompt_tokens,
                      "output_tokens": a.output_tokens, "backlogged": a.backlogged, "live": self.live.get(t, 0),
                      "finished": self.finished.get(t, 0), "retractions": self.retractions.get(t, 0)}
        return out


@dataclass
class PassPlan:
    """The core's plan for one SGLang scheduling pass: `admitted`, the waiting requests to admit,
    in order; `tokens`, prefill tokens per request id (new admissions and the partial prefill
    continued)."""

    admitted: list = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
