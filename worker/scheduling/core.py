"""The scheduling core: every scheduling decision, framework-free, for every executor.

One core decides, the executors (the reference engine's `worker/engine/scheduler.py`, the simulator
through it, the SGLang plugin) report what they have and carry out the plan. The core imports no
torch, no grpc, no SGLang and no engine module; it works on opaque request *handles* (the
executor's own objects) and asks the executor, through the `Executor` protocol, for the few
figures only the executor knows (a waiting request's KV need with the prefix cache taken into
account, a running request's blocks, its prefill left) and to carry out a preemption.

What the core owns (docs/scheduling-core.md is the interface note):

- per-tenant waiting queues (a preempted request goes back to the front of its tenant's queue,
  ahead of the tenant's newer work) and the running set, in admission order;
- whose work takes the next slice of an iteration's prefill budget: the tier first
  (`worker.scheduling.tiers`: strict priority with minimum shares), then the tenant within the tier
  (the fairness policy, `worker.scheduling.policy`: weighted VTC by default), its running partial
  prefills before its next waiting request; candidates are kept in one heap per tier, keyed by the
  policy's key and re-keyed whenever a tenant is charged, so a pick costs O(log tenants);
- admission: a free running slot and KV room in the ledger (`worker.scheduling.ledger`), KV quota
  rules (`worker.scheduling.quota`), bounded skips then a reservation
  (`worker.scheduling.eligibility`);
- preemption: whom and why (`worker.scheduling.preemption`: out of blocks, stall, quota reclaim,
  tier, returning tenant);
- which decodes run and how much prefill follows when a contended iteration's tokens pass the
  iteration token target (`worker.scheduling.decode_share`);
- backlog: a tenant is backlogged while it has queued requests or prefill left (running decodes do
  not count, VTC Algorithm 2); the policy and the tier deficits hear every change.

One iteration, as an executor drives it (`worker/engine/scheduler.py` is the reference):

    core.begin_iteration(free, promised)      # preemptions for reclaim, tiers, returning tenants
    decodes, prefill_budget = core.plan_iteration(decoding_entries, budget)
    for entry in decodes:
        while the executor has no block for it:
            victim = core.decode_victim(entry); core.preempt(victim, OUT_OF_BLOCKS)
        ...allocate one token...
    core.begin_prefill(prefill_budget, free, promised)
    while (entry := core.next_prefill()) is not None:
        if not entry.running: core.admit(entry)   # then attach the cached prefix, etc.
        n = tokens the executor can give it (slice, budget, blocks); 0 -> core.cannot_serve(entry)
        ...allocate, charge through the policy...; core.served(entry, n)
    core.end_prefill()
    core.end_iteration()                      # tenants with no queued work and no prefill left go idle

Charges may come from anywhere (the engine commits output tokens, the executor charges prefill):
they go to `policy.charge`, and the core hears them through `policy.subscribe`.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from fairshare.checks import require_at_least
from worker.scheduling.cost import CostFunction
from worker.scheduling.decode_share import (DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET, DEFAULT_LOWER_TIER_TOKEN_TARGET,
                                             DEFAULT_TIER_GRACE_ITERATIONS, plan_iteration)
from worker.scheduling.eligibility import EligibilityGate
from worker.scheduling.ledger import KVLedger
from worker.scheduling.policy import TIERS, SchedulingPolicy, TenantAccount
from worker.scheduling.quota import KVQuota
from worker.scheduling.returning import ReturningAdmission
from worker.scheduling.tiers import RANK, TierShares

# preemption reasons
OUT_OF_BLOCKS = "out-of-blocks"   # a decode (or a stalled prefill) found no free block
RECLAIM = "reclaim"               # KV quotas: room for a within-quota tenant's head
TIER = "tier"                     # room for a higher tier's head
RETURNING = "returning"           # a returning tenant's slot share
REASONS = (OUT_OF_BLOCKS, RECLAIM, TIER, RETURNING)


class Executor(Protocol):
    """What the core asks of an executor about a request handle (all counts in KV blocks/tokens)."""

    def admission_need(self, handle) -> int:
        """Blocks a waiting request takes from the free room to finish its prefill (the part the
        prefix cache does not hold, plus cached blocks that are evictable now)."""

    def blocks_held(self, handle) -> int:
        """Blocks a running request holds (cached blocks it references included)."""

    def blocks_promised(self, handle) -> int:
        """Blocks a running request will still take to finish its prefill (0 once decoding)."""

    def prefill_left(self, handle) -> int:
        """Tokens a running request still has to prefill before it decodes (0 when decoding: one
        token left is a decode). For a waiting request: its whole prefill."""

    def prefill_room(self, handle, have: int) -> int:
        """Tokens a running prefill can still get into its blocks and the free pool, beyond the
        `have` tokens it was given this round (0: it cannot take a slice now)."""

    def free_blocks(self) -> int:
        """Blocks an allocation can get now (free list plus evictable cached blocks)."""

    def preempt(self, handle) -> None:
        """Carry out a recompute preemption: free the request's blocks, forget its computed tokens.
        (The core requeues it.)"""


@dataclass(eq=False)
class Entry:
    """The core's record of one request. handle: the executor's object. arrival: seconds (any
    monotonic scale the executor uses). order: admission order while running (newest = largest).
    protected: admitted through a memory reservation (preempted last). for_share: admitted while
    its tier was owed its minimum share (never taken back by a higher tier). need: blocks its
    admission takes (computed when it is considered). last_decode: iteration of its last decoded
    token."""

    request_id: str
    tenant: "TenantState"
    handle: object
    arrival: float
    prompt_tokens: int
    max_tokens: int
    running: bool = False
    order: int = -1
    protected: bool = False
    for_share: bool = False
    need: int = 0
    last_decode: int = -1
    preemptions: int = 0
    admitted_once: bool = False

    @property
    def tenant_id(self) -> str:
        return self.tenant.tenant_id


@dataclass(eq=False)
class TenantState:
    """Per tenant: identity, queues, and heap bookkeeping. tier: the declared tier; sched_tier:
    the tier it is scheduled in (the top tier when scheduling is tier-blind)."""

    tenant_id: str
    weight: float
    tier: str
    sched_tier: str
    waiting: deque = field(default_factory=deque)
    running: dict = field(default_factory=dict)     # request id -> Entry, admission order
    partials: deque = field(default_factory=deque)  # running entries that may have prefill left
    backlogged: bool = False
    ver: int = 0                                     # heap entries with another version are stale
    index: int = 0                                   # order in which the core first saw the tenant

    def has_candidates(self) -> bool:
        return bool(self.waiting) or bool(self.partials)


@dataclass
class CoreStats:
    """Counters: iterations, preemptions by reason and by tenant, finished, quota waits and
    hand-backs by tenant, skips counted against the tier order, blocked iterations per tier (in `TierShares`)."""

    iterations: int = 0
    preemptions: dict = field(default_factory=lambda: {r: 0 for r in REASONS})
    preemptions_by_tenant: dict = field(default_factory=dict)
    finished_by_tenant: dict = field(default_factory=dict)
    quota_waits: dict = field(default_factory=dict)
    handed_back_by_tenant: dict = field(default_factory=dict)  # never-admitted requests given back to be re-routed


class SchedulingCore:
    """Queues, tiers, fairness, admission, the KV ledger and preemption for one executor.

    policy: a `SchedulingPolicy` (its accounts hold weights, tiers and counters). cost: the cost
    function (estimates and slack in service units). executor: an `Executor`. total_blocks: KV pool
    size (blocks). max_running: running slots. chunk_tokens: the iteration's token budget (the
    prefill chunk). prefill_slice: tokens per pick (for bounds and estimates). max_skips: memory
    skips before a reservation. quota: `KVQuota` or None (off). returning: give returning tenants a
    slot at once (`worker.scheduling.returning`). tiers: `TierShares` (default: strict priority,
    5 % minimum shares, floor α·chunk/2). iteration_token_target: tokens per contended iteration
    beyond which they are shared by tier and weight (None: the token budget, i.e. never).
    lower_tier_token_target: tokens an iteration the lower tiers together take while a higher tier
    has work (None: no limit); tier_grace_iterations: iterations after it last had work during which
    the lower tiers still take at most lower_tier_idle_token_target tokens an iteration
    (`worker.scheduling.decode_share`).
    max_partial_prefills: most running requests left with prefill to do at the end of a round
    (None: no limit). A waiting head is admitted while fewer running requests than that have prefill
    left, or when this pick finishes its whole prefill (`admissible`). SGLang keeps one
    `Scheduler.chunked_req` (its plugin passes 1); vLLM calls the same limit
    `max_num_partial_prefills`. Raises ValueError on bad sizes.
    """

    def __init__(self, policy: SchedulingPolicy, cost: CostFunction, executor: Executor, *, total_blocks: int,
                 max_running: int, chunk_tokens: int = 512, prefill_slice: int = 16, max_skips: int = 8,
                 quota: KVQuota | None = None, returning: bool = True, tiers: TierShares | None = None,
                 iteration_token_target: int | None = None,
                 lower_tier_token_target: int | None = DEFAULT_LOWER_TIER_TOKEN_TARGET,
                 max_partial_prefills: int | None = None,
                 tier_grace_iterations: int = DEFAULT_TIER_GRACE_ITERATIONS,
                 lower_tier_idle_token_target: int = DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET) -> None:
        require_at_least(1, chunk_tokens=chunk_tokens, prefill_slice=prefill_slice,
                         iteration_token_target=iteration_token_target, lower_tier_token_target=lower_tier_token_target,
                         max_partial_prefills=max_partial_prefills, lower_tier_idle_token_target=lower_tier_idle_token_target)
        require_at_least(0, tier_grace_iterations=tier_grace_iterations)
        self.policy = policy
        self.cost = cost
        self.executor = executor
        self.quota = quota if quota is not None and quota.enabled else None
        self.ledger = KVLedger(total_blocks, max_running, self.quota.headroom_blocks if self.quota else 0)
        self.gate = EligibilityGate(max_skips, ledger=self.ledger)
        self.returning = ReturningAdmission() if returning else None
        self.tiers = tiers if tiers is not None else TierShares(floor_units=cost.max_prefill_rate * chunk_tokens / 2)
        self.chunk_tokens = chunk_tokens
        self.prefill_slice = prefill_slice
        self.iteration_token_target = iteration_token_target or chunk_tokens
        self.lower_tier_token_target = lower_tier_token_target
        self.max_partial_prefills = max_partial_prefills
        self.tier_grace_iterations = tier_grace_iterations
        self.lower_tier_idle_token_target = lower_tier_idle_token_target
        self._tier_last_work: dict[str, int] = {}   # tier -> last iteration it had work (decode_share)
        self._prefill_wait: dict[str, int] = {}     # held tier -> since when its prefill got no token (decode_share)
        self._tier_prefill_cap: dict[str, int] | None = None
        self._partial_heaps: dict[str, list] | None = None
        self._partial_tenants: set[str] = set()      # tenants that may have a running partial prefill
        self._no_slot_now: bool | None = None         # `_no_slot`, until a slot or a hold changes
        self._sticky: TenantState | None = None
        self.tenants: dict[str, TenantState] = {}
        self.entries: dict[str, Entry] = {}
        self.running: dict[str, Entry] = {}            # admission order
        self.stats = CoreStats()
        self.iteration = 0
        self._admit_counter = 0
        self._waiting = 0
        self._heaps: dict[str, list] = {t: [] for t in TIERS}
        self._pending: dict[str, set[str]] = {t: set() for t in TIERS}  # tenants with candidates, per tier
        self._dirty: set[str] = set()
        self._keyed = type(policy).key is not SchedulingPolicy.key  # VTC, FCFS: heaps; DRR: asked
        self._lazy = self._keyed and policy.key_rises_with_charges
        self._key_uses_arrival = policy.key_uses_arrival
        self._backlogged_by_tier = {t: 0 for t in TIERS}
        self._running_by_tier = {t: 0 for t in TIERS}
        # per prefill round
        self._budget = 0
        self._alloc: dict[str, int] = {}
        self._out: set[str] = set()        # tenants taken out of the round (stashed or without work)
        self._partial_wait: set[str] = set()  # of those, tenants whose head waits for the partial-prefill limit
        self._dead: set[str] = set()       # tiers with no candidate left this round
        self._unfit: dict[str, tuple[str, int]] = {}
        self._touched: set[str] = set()
        self.no_burst: set[str] = set()    # tenants preempted by reclaim this iteration (quota rule)
        self._listeners: list = []
        policy.subscribe(self._on_policy_change)
        from worker.scheduling.preemption import RoomMaker

        self.room = RoomMaker(self)

    # ---- events ---------------------------------------------------------------------------------
    def add(self, request_id: str, tenant_id: str, handle, *, weight: float = 1.0, tier: str = TIERS[0],
            arrival: float = 0.0, prompt_tokens: int = 0, max_tokens: int = 0) -> Entry:
        """Queue a new request (the policy sees the arrival). Raises ValueError on a duplicate id,
        a non-positive weight or an unknown tier."""
        if request_id in self.entries:
            raise ValueError(f"duplicate request id {request_id!r}")
        if tier not in RANK:
            raise ValueError(f"tenant {tenant_id!r}: unknown tier {tier!r}")
        ts = self._tenant(tenant_id, weight, tier)
        if self.returning is not None:
            acct = self.policy.accounts.get(tenant_id)
            self.returning.on_arrival(tenant_id, acct is not None and acct.backlogged)
        self._set_backlogged(ts)
        if self.quota is not None:
            self.quota.observe(tenant_id, weight, tier)
        e = Entry(request_id, ts, handle, arrival, prompt_tokens, max_tokens)
        self.entries[request_id] = e
        ts.waiting.append(e)
        self._waiting += 1
        self._dirty.add(tenant_id)
        return e

    def finish(self, request_id: str, prompt_tokens: int = 0, output_tokens: int = 0) -> Entry | None:
        """A request ended (any reason, abort included); the executor frees its blocks. What it
        consumed stays charged. Returns its entry (None when unknown)."""
        return self._drop_entry(request_id, prompt_tokens, output_tokens, self.stats.finished_by_tenant)

    def hand_back(self, request_id: str) -> Entry | None:
        """A waiting, never-admitted request leaves this worker to be re-routed
        (`worker.scheduling.handback`): removed like an abort before admission (nothing was charged,
        no block is held), counted in `stats.handed_back_by_tenant`, not as finished. Returns its
        entry (None when unknown). Raises ValueError for a request that was admitted."""
        e = self.entries.get(request_id)
        if e is not None and (e.running or e.admitted_once):
            raise ValueError(f"request {request_id!r} was admitted: only a never-admitted request is handed back")
        return self._drop_entry(request_id, 0, 0, self.stats.handed_back_by_tenant)

    def _drop_entry(self, request_id: str, prompt_tokens: int, output_tokens: int, count: dict) -> Entry | None:
        e = self.entries.pop(request_id, None)
        if e is None:
            return None
        ts = e.tenant
        if e.running:
            self._leave_running(e)
        else:
            _remove(ts.waiting, e)
            self._waiting -= 1
            self.gate.on_drop(ts.tenant_id, request_id)
        count[ts.tenant_id] = count.get(ts.tenant_id, 0) + 1
        self.policy.on_request_finish(ts.tenant_id, request_id, prompt_tokens, output_tokens)
        if not self._has_pending(ts):
            self._set_idle(ts)
        self._dirty.add(ts.tenant_id)
        return e

    def subscribe(self, listener) -> None:
        """Call `listener(victim, reason, requester)` on every preemption, before it is carried out
        (`requester`: the entry the room was made for, None for a stall)."""
        self._listeners.append(listener)

    def preempt(self, e: Entry, reason: str, requester: Entry | None = None) -> None:
        """Recompute preemption of running `e` for `reason` (on behalf of `requester`): the
        executor frees its blocks, it goes back to the front of its tenant's queue (ahead of the
        tenant's newer work)."""
        assert e.running, "only running requests are preempted"
        for listener in self._listeners:
            listener(e, reason, requester)
        blocks = self.executor.blocks_held(e.handle)
        promise = self.executor.blocks_promised(e.handle)
        self.executor.preempt(e.handle)
        self._leave_running(e)
        self.ledger.on_release(blocks, promise)
        self._no_slot_now = None
        self.ledger.free = self.executor.free_blocks()
        e.protected = e.for_share = False
        e.preemptions += 1
        ts = e.tenant
        ts.waiting.appendleft(e)
        self._waiting += 1
        self.stats.preemptions[reason] = self.stats.preemptions.get(reason, 0) + 1
        self.stats.preemptions_by_tenant[ts.tenant_id] = self.stats.preemptions_by_tenant.get(ts.tenant_id, 0) + 1
        self._set_backlogged(ts)  # backlogged again (lifted if it was not)
        self.gate.on_preempt(ts.tenant_id)  # not skipped max_skips times again
        self._dirty.add(ts.tenant_id)

    def _leave_running(self, e: Entry) -> None:
        self._no_slot_now = None
        ts = e.tenant
        del self.running[e.request_id]
        del ts.running[e.request_id]
        _remove(ts.partials, e)
        e.running = False
        self._running_by_tier[ts.tier] -= 1

    # ---- tenants and backlog --------------------------------------------------------------------
    def _tenant(self, tenant_id: str, weight: float, tier: str) -> TenantState:
        self.policy.account(tenant_id, weight, tier)  # validates weight and tier
        ts = self.tenants.get(tenant_id)
        sched_tier = self.tiers.tier_of(tier)
        if ts is None:
            ts = self.tenants[tenant_id] = TenantState(tenant_id, float(weight), tier, sched_tier,
                                                       index=len(self.tenants))
        elif ts.tier != tier:
            # a tier change takes effect for the tenant's queued work at once
            if ts.backlogged:
                self._backlogged_by_tier[ts.tier] -= 1
                self.tiers.set_backlogged(ts.tier, self._backlogged_by_tier[ts.tier] > 0)
                self._backlogged_by_tier[tier] += 1
                self.tiers.set_backlogged(tier, True)
            for e in ts.running.values():
                self._running_by_tier[ts.tier] -= 1
                self._running_by_tier[tier] += 1
            self._pending[ts.sched_tier].discard(tenant_id)
            ts.tier, ts.sched_tier = tier, sched_tier
        ts.weight = float(weight)
        return ts

    def _set_backlogged(self, ts: TenantState) -> None:
        self.policy.on_arrival(ts.tenant_id, ts.weight, ts.tier)
        if not ts.backlogged:
            ts.backlogged = True
            self._backlogged_by_tier[ts.tier] += 1
            self.tiers.set_backlogged(ts.tier, True)

    def _set_idle(self, ts: TenantState) -> None:
        self.policy.on_idle(ts.tenant_id)
        if ts.backlogged:
            ts.backlogged = False
            self._backlogged_by_tier[ts.tier] -= 1
            if self._backlogged_by_tier[ts.tier] == 0:
                self.tiers.set_backlogged(ts.tier, False)

    def _has_pending(self, ts: TenantState) -> bool:
        """Queued requests or prefill left (what makes a tenant backlogged)."""
        return bool(ts.waiting) or any(self.executor.prefill_left(e.handle) > 0 for e in ts.running.values())

    def _on_policy_change(self, acct: TenantAccount, units: float) -> None:
        if units:
            self.tiers.charge(acct.tier, units)
            if self._lazy:
                return  # the key only rose: re-keyed when it reaches the top of its heap (`_pop`)
        self._dirty.add(acct.tenant_id)

    def end_iteration(self) -> None:
        """Tell the policy which tenants stopped being backlogged: no queued request and no
        prefill left beyond this iteration's step (a running request with at most one token left
        to compute decodes next). Only tenants served or admitted this iteration can change. The
        lower tiers still owed now were blocked this iteration (counted)."""
        self.tiers.end_round()
        left = self.executor.prefill_left
        # in the order tenants were first seen (not set order, which differs between processes: the
        # last tenant of a tier to go idle sets the counter the next arrival is lifted to)
        for tid in sorted(self._touched, key=lambda t: self.tenants[t].index):
            ts = self.tenants[tid]
            if ts.backlogged and not ts.waiting and not any(
                    e.running and left(e.handle) - self._alloc.get(e.request_id, 0) > 1 for e in ts.partials):
                self._set_idle(ts)
        self._touched = set()
        self._alloc = {}

    # ---- one iteration: room first ---------------------------------------------------------------
    def begin_iteration(self, free_blocks: int, promised_blocks: int) -> None:
        """Start an iteration: the executor's free and promised blocks; holds of the last iteration
        end; room is held for a lower tier owed its minimum share; quota reclaim, tier preemption
        and returning tenants make room (preempting through the executor)."""
        self.iteration += 1
        self.stats.iterations += 1
        self.ledger.new_iteration()
        self.ledger.sync(free_blocks, promised_blocks, len(self.running))
        self.no_burst = set()
        self._refresh()
        self.room.for_owed_tiers()
        if self.quota is not None:
            self.room.reclaim()
        self.room.for_higher_tiers()
        if self.returning is not None:
            self.room.for_returning()
        self._no_slot_now = None

    # ---- the iteration's tokens: decodes, then prefill -----------------------------------------------
    def plan_iteration(self, decoding: list[Entry], budget: int) -> tuple[list[Entry], int | None]:
        """Which decodes run and how many prefill tokens may follow, out of `budget` tokens
        (`worker.scheduling.decode_share.plan_iteration`: the iteration token target's rule).
        decoding: running entries with one token to compute, in admission order. Returns the decodes
        (admission order) and the prefill budget (None: whatever the decodes leave)."""
        return plan_iteration(self, decoding, budget)

    def prefill_demand(self, tier: str, limit: int) -> int:
        """Prefill tokens the tier's tenants have pending (running partial prefills and waiting
        requests), counted up to `limit` (the result, min(pending, limit), does not depend on the
        order the tenants are visited in)."""
        total = 0
        left = self.executor.prefill_left
        for tid in self._pending[tier]:
            ts = self.tenants[tid]
            for e in ts.partials:
                if e.running:
                    total += left(e.handle)
            for e in ts.waiting:
                if total >= limit:
                    return limit
                total += max(1, e.prompt_tokens)
            if total >= limit:
                return limit
        return total

    def decode_victim(self, requester: Entry) -> Entry:
        """Out of blocks for `requester`'s next token: the request to preempt (possibly itself)."""
        return self.room.victim(requester)

    def stall_victim(self) -> Entry | None:
        """Every running request is a partial prefill and none can get a block: the one to free."""
        return self.room.victim(None)

    # ---- the prefill round -----------------------------------------------------------------------
    def begin_prefill(self, budget: int, free_blocks: int, promised_blocks: int) -> None:
        """Start handing out `budget` prefill tokens (the executor's free and promised blocks now)."""
        self._budget = budget
        self._alloc = {}
        self._partial_heaps: dict[str, list] | None = None
        self._sticky: TenantState | None = None
        self._out = set()
        self._dead = set()
        self._unfit = {}
        self._partial_wait = set()
        self.ledger.sync(free_blocks, promised_blocks, len(self.running))
        self._no_slot_now = None
        self._refresh()

    def next_prefill(self) -> Entry | None:
        """The request that gets the next slice: a running partial prefill or a waiting head (which
        the executor must then `admit`). None when the budget is spent or nothing can be served."""
        caps, dead, pending = self._tier_prefill_cap, self._dead, self._pending
        while self._budget > 0:
            live = [t for t in TIERS if pending[t] and t not in dead and (caps is None or caps[t] > 0)]
            tier = self.tiers.pick(live)
            if tier is None:
                return None
            sticky = self._sticky
            if sticky is not None:
                # the tenant served last keeps the turn while it is still the policy's first (water-
                # filling slice by slice, without a heap round trip per slice)
                self._sticky = None
                if sticky.sched_tier == tier and sticky.tenant_id not in self._out:
                    head = self._sticky_head(sticky)
                    if head is not None:
                        return head
                if sticky.tenant_id not in self._out:
                    self._repush(sticky)
            head = self._pop(tier)
            if head is None:
                self._dead.add(tier)
                continue
            return head
        return None

    def _sticky_head(self, ts: TenantState) -> Entry | None:
        """`ts`'s servable head if `ts` is still first in its tier's heap (else None)."""
        head = self._head(ts)
        if head is None:
            return None
        key = self.policy.key(ts.tenant_id, head.arrival)
        no_slot = self._no_slot()
        if no_slot:
            top = self._top(self._partial_heap(ts.sched_tier), partial=True)
        else:
            top = self._top(self._heaps[ts.sched_tier], partial=False)
        if top is not None and top < key:
            return None
        if head.running:
            if self.executor.prefill_room(head.handle, self._alloc.get(head.request_id, 0)) > 0:
                return head
        elif no_slot and ts.tenant_id not in self._slot_holders():
            return None
        elif self.admissible(head):
            return head
        self._out.add(ts.tenant_id)
        return None

    def _top(self, heap: list, partial: bool):
        """The smallest valid key in `heap` (fixing stale entries on the way), or None."""
        while heap:
            entry = heap[0]
            key, tid = entry[0], entry[-1]
            ts = self.tenants[tid]
            if tid in self._out or (not partial and entry[1] != ts.ver):
                heapq.heappop(heap)
                continue
            if self._lazy:
                current = self._key(ts)
                if current > key:
                    heapq.heapreplace(heap, (current, tid) if partial else (current, entry[1], tid))
                    continue
            return key
        return None

    def _repush(self, ts: TenantState) -> None:
        """Put a tenant taken out of its heap back in (at its current key)."""
        if self._partial_heaps is not None:
            heapq.heappush(self._partial_heaps[ts.sched_tier], (self._key(ts), ts.tenant_id))
        self._push(ts)

    def _servable_head(self, ts: TenantState) -> Entry | None:
        """The tenant's head if it can be served now (else the tenant leaves this round)."""
        head = self._head(ts)
        if head is not None and (self.executor.prefill_room(head.handle, self._alloc.get(head.request_id, 0)) > 0
                                 if head.running else self.admissible(head)):
            return head
        self._out.add(ts.tenant_id)
        return None

    def admissible(self, e: Entry) -> bool:
        """Whether waiting `e` may be admitted now: a free slot, the quota rules, KV room in the
        ledger. A head that does not fit is recorded for the eligibility gate's skip count."""
        ts = e.tenant
        tid, rid = ts.tenant_id, e.request_id
        if self.ledger.free_slots(tid, rid) <= 0:
            return False
        if self.max_partial_prefills is not None and not self._partial_fits(e):
            self._partial_wait.add(tid)  # back in the round once a partial prefill finishes (`served`)
            return False
        need = e.need = self.executor.admission_need(e.handle)
        if self.quota is not None and not self.gate.holds(rid):
            why = self.room.quota_refusal(ts, need)
            if why is not None:
                self.stats.quota_waits[tid] = self.stats.quota_waits.get(tid, 0) + 1
                if self.room.committed(ts) == 0:
                    # it holds nothing, so its quota cannot fall further: the request is larger than
                    # what the quota rules leave it. A memory skip, so that after max_skips memory is
                    # reserved for it (which lifts the quota check).
                    self._unfit[tid] = (rid, need)
                return False
        if need > self.ledger.room(tid, rid):
            self._unfit[tid] = (rid, need)
            return False
        return True

    def _partial_fits(self, e: Entry) -> bool:
        """The partial-prefill limit (`max_partial_prefills`): waiting `e` may be admitted while
        fewer running requests than the limit have prefill left beyond what they were given this
        round, or when this pick can finish its whole prefill (the slice, the budget and the room
        the executor reports all cover it)."""
        left, alloc = self.executor.prefill_left, self._alloc
        open_ = 0
        for tid in self._partial_tenants:
            for p in self.tenants[tid].partials:
                if p.running and left(p.handle) - alloc.get(p.request_id, 0) > 0:
                    open_ += 1
        if open_ < self.max_partial_prefills:
            return True
        need = max(1, left(e.handle))
        return need <= min(self.prefill_slice, self._budget) and need <= self.executor.prefill_room(e.handle, 0)

    def admit(self, e: Entry) -> None:
        """Admit waiting head `e` (returned by `next_prefill`): it takes a slot and its need."""
        ts = e.tenant
        assert ts.waiting and ts.waiting[0] is e, "only a tenant's head is admitted"
        for tid, (rid, need) in self._unfit.items():
            if tid != ts.tenant_id and self._skips_for(tid, ts):
                self.gate.on_skip(tid, rid, need, self.iteration)
        self.ledger.on_admit(ts.tenant_id, e.request_id, e.need)
        self._no_slot_now = None
        ts.waiting.popleft()
        self._waiting -= 1
        e.running = True
        e.order = self._admit_counter
        self._admit_counter += 1
        self.running[e.request_id] = e
        ts.running[e.request_id] = e
        ts.partials.appendleft(e)
        self._partial_tenants.add(ts.tenant_id)
        self._running_by_tier[ts.tier] += 1
        if self.gate.holds(e.request_id):
            e.protected = True
        e.for_share = self.tiers.owed(ts.tier)
        self.gate.on_admit(ts.tenant_id, e.request_id)
        self._touched.add(ts.tenant_id)
        if not e.admitted_once:
            e.admitted_once = True
            self.policy.on_admit(ts.tenant_id, e.request_id, e.prompt_tokens, e.max_tokens)

    def _skips_for(self, unfit_tenant: str, admitted: TenantState) -> bool:
        """An admission of `admitted` counts as a memory skip for `unfit_tenant` when it is not of a
        tier ahead of it in the tier order (an owed tier is ahead of everyone)."""
        other = self.tenants[unfit_tenant]
        if other.sched_tier == admitted.sched_tier or self.tiers.owed(other.tier):
            return True
        return RANK[admitted.sched_tier] > RANK[other.sched_tier]

    def served(self, e: Entry, tokens: int) -> None:
        """`tokens` prefill tokens of `e` were scheduled this iteration (already charged)."""
        self._alloc[e.request_id] = self._alloc.get(e.request_id, 0) + tokens
        self._budget -= tokens
        ts = e.tenant
        if self._tier_prefill_cap is not None:
            self._tier_prefill_cap[ts.sched_tier] -= tokens
        self._touched.add(ts.tenant_id)
        self._sticky = ts  # back in its heap when another tenant gets the turn (`next_prefill`)
        if self._partial_wait and self.executor.prefill_left(e.handle) - self._alloc[e.request_id] <= 0:
            # a partial prefill finished: heads held back by the partial-prefill limit may start now
            for tid in sorted(self._partial_wait):
                self._out.discard(tid)
                self._dead.discard(self.tenants[tid].sched_tier)
                if tid != ts.tenant_id:
                    self._repush(self.tenants[tid])
            self._partial_wait = set()

    @property
    def prefill_budget(self) -> int:
        """Prefill tokens left to hand out this round (to the request `next_prefill` returned)."""
        return self._budget

    def allocated(self, e: Entry) -> int:
        """Tokens given to `e` so far this round."""
        return self._alloc.get(e.request_id, 0)

    def cannot_serve(self, e: Entry) -> None:
        """The executor found no room for another token of running `e` this round."""
        self._out.add(e.tenant_id)

    def end_prefill(self) -> list[str]:
        """End of the prefill round. Returns the lower tiers still owed (blocked, unless a second
        round follows)."""
        if self._sticky is not None:
            self._push(self._sticky)
            self._sticky = None
        self._dirty.update(self._out)
        self._touched.update(self._out)
        self._out = set()
        self._unfit = {}
        return self.tiers.owed_tiers()

    # ---- candidate heaps --------------------------------------------------------------------------
    def _head(self, ts: TenantState) -> Entry | None:
        """The tenant's next prefill candidate this round: its oldest running partial prefill with
        tokens left, else its waiting head."""
        q = ts.partials
        while q:
            e = q[0]
            if e.running and self.executor.prefill_left(e.handle) - self._alloc.get(e.request_id, 0) > 0:
                return e
            q.popleft()
        return ts.waiting[0] if ts.waiting else None

    def _key(self, ts: TenantState) -> tuple:
        if not self._key_uses_arrival:
            return self.policy.key(ts.tenant_id, 0.0)
        head = self._head(ts)
        return self.policy.key(ts.tenant_id, head.arrival if head is not None else 0.0)

    def _refresh(self) -> None:
        """Re-key every tenant whose counter, head or candidacy may have changed."""
        for tid in sorted(self._dirty):  # sorted: the same heap on every tensor-parallel rank
            ts = self.tenants.get(tid)
            if ts is None:
                continue
            pending = self._pending[ts.sched_tier]
            if ts.has_candidates():
                pending.add(tid)
                self._push(ts)
            else:
                pending.discard(tid)
                ts.ver += 1
        self._dirty = set()
        for tier, heap in self._heaps.items():
            if len(heap) > 4 * len(self._pending[tier]) + 64:  # drop stale entries
                self._heaps[tier] = []
                for tid in sorted(self._pending[tier]):
                    self._push(self.tenants[tid])

    def _push(self, ts: TenantState) -> None:
        ts.ver += 1
        if self._keyed:
            heapq.heappush(self._heaps[ts.sched_tier], (self._key(ts), ts.ver, ts.tenant_id))

    def _pop(self, tier: str) -> Entry | None:
        """The servable head of the policy's first tenant of `tier` still in this round (None when
        there is none). Keyed policies: the heap's first tenant whose head is servable. Others
        (DRR): the policy picks among the tenants whose heads are servable now, as DRR rounds need."""
        if not self._keyed:
            cands, arrival, heads = [], {}, {}
            for t in sorted(self._pending[tier]):
                if t in self._out:
                    continue
                head = self._servable_head(self.tenants[t])
                if head is not None:
                    cands.append(t)
                    heads[t] = head
                    arrival[t] = head.arrival
            return heads[self.policy.pick(cands, arrival)] if cands else None
        if self._no_slot():
            return self._pop_partial(tier)
        heap = self._heaps[tier]
        while heap:
            key, ver, tid = heapq.heappop(heap)
            ts = self.tenants[tid]
            if ver != ts.ver or tid in self._out:
                continue
            if self._lazy:
                current = self._key(ts)
                if current > key:  # charged since it was pushed: back in at its place
                    heapq.heappush(heap, (current, ver, tid))
                    continue
            head = self._servable_head(ts)
            if head is not None:
                return head
        return None

    def _no_slot(self) -> bool:
        """No running slot is free for a waiting request without a hold: every slot is taken or
        held (only running partial prefills, and the heads of tenants room is held for, can be
        served then)."""
        if self._no_slot_now is None:
            led = self.ledger
            held = 0
            for h in led.holds:
                if h.slots > 0:
                    held += h.slots
            self._no_slot_now = led.running + held >= led.max_running
        return self._no_slot_now

    def _slot_holders(self) -> set[str]:
        """Tenants a running slot is held for this iteration (their heads may take one even when
        `_no_slot`)."""
        return {h.tenant_id for h in self.ledger.holds if h.slots > 0}

    def _partial_heap(self, tier: str) -> list:
        """The heap of tenants of `tier` with a running partial prefill, built once per round from
        the running set (tenants taken out this round, e.g. the one holding the turn, left out)."""
        if self._partial_heaps is None:
            heaps: dict[str, list] = {t: [] for t in TIERS}
            left, alloc, seen = self.executor.prefill_left, self._alloc, set(self._out)
            if self._sticky is not None:
                seen.add(self._sticky.tenant_id)
            # the tenants admitted with prefill to do (`admit` adds them), not the whole running set
            for tid in list(self._partial_tenants):
                ts = self.tenants.get(tid)
                if ts is not None and ts.partials:
                    live = [e for e in ts.partials if e.running and left(e.handle) > 0]  # done ones for good
                    if len(live) != len(ts.partials):
                        ts.partials = deque(live)
                if ts is None or not ts.partials:
                    self._partial_tenants.discard(tid)
                    continue
                if tid not in seen and any(left(e.handle) - alloc.get(e.request_id, 0) > 0 for e in ts.partials):
                    seen.add(tid)
                    heaps[ts.sched_tier].append((self._key(ts), tid))
            for tid in sorted(self._slot_holders() - seen):
                ts = self.tenants.get(tid)
                if ts is not None and ts.waiting:
                    heaps[ts.sched_tier].append((self._key(ts), tid))
            for h in heaps.values():
                heapq.heapify(h)
            self._partial_heaps = heaps
        return self._partial_heaps[tier]

    def _pop_partial(self, tier: str) -> Entry | None:
        """With no slot free: the policy's first tenant of `tier` with a running partial prefill
        that can take a slice. Its candidates come from the running set (built once per round, at
        most `max_running` entries), not from every queued tenant."""
        heap = self._partial_heap(tier)
        while heap:
            key, tid = heapq.heappop(heap)
            if tid in self._out:
                continue
            ts = self.tenants[tid]
            if self._lazy:
                current = self._key(ts)
                if current > key:
                    heapq.heappush(heap, (current, tid))
                    continue
            head = self._head(ts)
            if head is None:
                continue
            if not head.running:
                # no partial prefill left: its waiting head needs a slot, held for it or none
                if tid in self._slot_holders() and self.admissible(head):
                    return head
                self._out.add(tid)
                continue
            if self.executor.prefill_room(head.handle, self._alloc.get(head.request_id, 0)) > 0:
                return head
            self._out.add(tid)
        return None

    # ---- projections (what the policy would admit, memory aside) ---------------------------------
    def projected_heads(self, tier: str, tenant_filter=None):
        """Waiting requests of scheduling tier `tier` in the order the core would admit them if
        memory allowed: VTC-like policies by counter plus the estimated prefill cost of the heads
        already yielded; DRR by its rounds (`DRRPolicy.project`: quanta granted, deficits less the
        heads' estimated prefill cost); other policies by their order, each tenant's queue in turn.
        A generator."""
        tenants = [self.tenants[t] for t in sorted(self._pending[tier]) if self.tenants[t].waiting
                   and (tenant_filter is None or tenant_filter(self.tenants[t]))]
        if not tenants:
            return
        if self._keyed:
            heap = []
            for ts in tenants:
                heap.append((self._key_with(ts, 0, 0.0), ts.tenant_id, 0, 0.0))
            heapq.heapify(heap)
            while heap:
                _, tid, k, ahead = heapq.heappop(heap)
                ts = self.tenants[tid]
                if k >= len(ts.waiting):
                    continue
                e = ts.waiting[k]
                yield e
                ahead += self.cost.prefill(e.prompt_tokens)
                if k + 1 < len(ts.waiting):
                    heapq.heappush(heap, (self._key_with(ts, k + 1, ahead), tid, k + 1, ahead))
        elif hasattr(self.policy, "project"):  # DRR: its rounds, quanta granted (state untouched)
            queues = {ts.tenant_id: list(ts.waiting) for ts in tenants}
            costs = {tid: [self.cost.prefill(e.prompt_tokens) for e in q] for tid, q in queues.items()}
            for tid, k in self.policy.project(costs):
                yield queues[tid][k]
        else:
            arrival = {ts.tenant_id: ts.waiting[0].arrival for ts in tenants}
            for tid in self.policy.order([ts.tenant_id for ts in tenants], arrival):
                yield from list(self.tenants[tid].waiting)

    def first_waiting_head(self, tier: str) -> Entry | None:
        """The first of `projected_heads(tier)` (the waiting head the core would admit first in
        the tier, memory aside), or None. For VTC-like policies it is read off the tier's candidate
        heap (the smallest counter among tenants with a waiting request: the few entries popped on
        the way, partial-only tenants and stale entries, are put back or dropped), not by keying
        every tenant of the tier."""
        if not (self._lazy and not self._key_uses_arrival) or self._dirty:
            return next(self.projected_heads(tier), None)
        heap, kept, found = self._heaps[tier], [], None
        while heap:
            entry = heapq.heappop(heap)
            key, ver, tid = entry
            ts = self.tenants[tid]
            if ver != ts.ver:
                continue  # stale for good
            current = self._key(ts)
            if current > key:
                heapq.heappush(heap, (current, ver, tid))
                continue
            kept.append(entry)
            if ts.waiting:
                found = ts.waiting[0]
                break
        for entry in kept:
            heapq.heappush(heap, entry)
        return found

    def _key_with(self, ts: TenantState, k: int, ahead_units: float) -> tuple:
        key = self.policy.key(ts.tenant_id, ts.waiting[k].arrival)
        if self.policy.name.startswith("vtc"):
            key = (key[0] + ahead_units / ts.weight,) + tuple(key[1:])
        return key

    def admission_order(self) -> list:
        """Every waiting request's handle in the order the core would admit them, memory aside:
        owed lower tiers first, then tiers by priority, within a tier `projected_heads` (what an
        executor with its own waiting queue, e.g. SGLang's `calc_priority`, sorts by)."""
        self._refresh()
        order = self.tiers.owed_tiers() + [t for t in TIERS if t not in self.tiers.owed_tiers()]
        return [e.handle for tier in order for e in self.projected_heads(tier)]

    # ---- introspection -----------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return self._waiting

    def tier_snapshot(self) -> dict[str, dict]:
        """Per tier: service units charged, share of all service, minimum share, deficit, whether
        backlogged, blocked iterations, waiting and running requests, preemptions of its requests."""
        shares = self.tiers.shares_of_service()
        waiting = {t: 0 for t in TIERS}
        preemptions = {t: 0 for t in TIERS}
        for ts in self.tenants.values():
            waiting[ts.tier] += len(ts.waiting)
            preemptions[ts.tier] += self.stats.preemptions_by_tenant.get(ts.tenant_id, 0)
        return {t: {"service": self.tiers.service.get(t, 0.0), "service_share": shares[t],
                    "min_share": self.tiers.min_share.get(t, 0.0), "deficit": self.tiers.deficit.get(t, 0.0),
                    "backlogged": self.tiers.backlogged.get(t, False),
                    "blocked_iterations": self.tiers.blocked_iterations.get(t, 0),
                    "waiting": waiting[t], "running": self._running_by_tier[t],
                    "preemptions": preemptions[t]} for t in TIERS}


def _remove(items: deque, e: Entry) -> None:
    """Remove `e` itself (by identity) from a deque, if present."""
    for i, item in enumerate(items):
        if item is e:
            del items[i]
            return
