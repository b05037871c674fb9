"""Iteration-level scheduler: which tokens are computed in the next engine step.

Continuous batching (Orca, Yu et al., OSDI 2022) with chunked prefill (Sarathi, Agrawal et al.,
2023): every iteration computes at most `max_num_batched_tokens` tokens (the prefill chunk,
default 512). Running sequences in decode take one token each first. The rest of the budget is
*split* among the tenants with pending prefill: it is handed out in slices of `prefill_slice`
tokens (default 16, one KV block), each slice to the tenant the fairness policy picks, and each
slice is charged at once, so the policy's counters move between picks. Under VTC this is
water-filling on the virtual counters: tenants at equal counters share an iteration's prefill in
proportion to their weights, a tenant behind catches up first, and a tenant with prompts many
times longer than the chunk cannot take every chunk (case SC2). Under FCFS the earliest head takes
the budget. Slices that land on the same sequence in one iteration form one chunk.

Admission: a waiting request is admitted only when its whole remaining prefill fits in the free
KV blocks it may use, not counting blocks already promised to the prefills of running requests
(several prefills progress side by side, so without that promise they could fill the pool and all
wait on each other) nor what the `EligibilityGate` reserves: a tenant whose head does not fit (or
meets the running-slot limit) is passed over for this iteration instead of blocking everyone. An iteration
counts as a *skip* for it when another tenant's request is admitted while its head did not fit
(memory being full for everyone is no skip); after `max_skips` skipped iterations memory is
reserved for that head. When decodes cannot get a block,
the most recently admitted running sequence is preempted by recompute (its blocks freed, it
re-enters the front of its tenant's queue, ahead of that tenant's newer work).

Backlogged (for the policy's lifting rule): a tenant is backlogged while it has queued requests or
prefill left; once all its requests are past prefill it is idle even if they are still decoding
(VTC, Sheng et al. OSDI 2024 Algorithm 2: a client leaves the queue when its requests are admitted),
so credit for a stretch without queued work is never banked.

KV quotas (optional, `quota`: a `worker.scheduling.quota.KVQuota`): admissions also obey the
tenant's hard cap, the reserved headroom and, above the safety watermark, its soft quota (a tenant
over its soft quota waits; below the watermark it may burst). Preemption (decodes out of blocks,
or *reclaim*: a waiting head of a tenant within its soft quota that does not fit) takes the
latest-admitted request of the tenant furthest over its soft quota; a tenant within quota is never
preempted while an over-quota tenant holds blocks (without an over-quota tenant, decodes fall back
to the newest admission; reclaim never preempts then). Quota refusals are not memory skips for the
eligibility gate. Without `quota` (or with it disabled) the behaviour is the quota-less one.

Charges: prefill slices are charged here, when scheduled into the step that computes them, for
prompt positions never charged before (recompute after preemption is not charged twice); output
tokens are charged by the engine when committed.

Prefix cache (`BlockManager.cache`, docs/cache-isolation.md): admission needs room only for the
part of the prompt the tenant's cache namespace does not hold (`BlockManager.admission_need`;
unreferenced cached blocks count as free and are evicted on demand); on admission the cached prefix
is attached (shared blocks, `num_computed_tokens` starts after it) and its prompt positions are
charged at the cost function's cached rate. Preemption and finishing release the request's
references; shared blocks stay cached. KV quotas count a request's referenced cached blocks to its
tenant (as `held_by_tenant` counts block tables); unreferenced cached blocks count to no quota.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from worker.scheduling.cost import CostFunction
from worker.scheduling.eligibility import EligibilityGate
from worker.scheduling.policy import SchedulingPolicy
from worker.scheduling.quota import KVQuota
from worker.scheduling.returning import ReturningAdmission


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at position `seq.num_computed_tokens`.

    prefill_units / prefill_tokens: service units and prompt tokens charged for this chunk when it
    was scheduled (0 for decodes and for recomputed positions).
    """

    seq: Sequence
    num_tokens: int
    prefill_units: float = 0.0
    prefill_tokens: int = 0


@dataclass
class SchedulerStats:
    iterations: int = 0
    preemptions: int = 0


class Scheduler:
    """Per-tenant waiting queues, the running set and the per-iteration token budget.

    max_num_batched_tokens: token budget per iteration (= prefill chunk size), tokens.
    max_running: most sequences admitted at once. prefill_slice: tokens per policy pick when the
    prefill budget is split (>= 1). max_skips: memory skips before a reservation (see
    `EligibilityGate`). clock: seconds, monotonic (the simulator passes a virtual clock).
    returning_preemption: give a returning tenant below its slot share a running slot at once,
    preempting an over-share tenant if needed (`worker.scheduling.returning`; the engine turns it
    off for FCFS). Raises ValueError on non-positive sizes.
    """

    def __init__(self, policy: SchedulingPolicy, cost: CostFunction, block_manager: BlockManager,
                 max_num_batched_tokens: int = 512, max_running: int = 64, *, prefill_slice: int = 16,
                 max_skips: int = 8, clock: Callable[[], float] = time.monotonic,
                 quota: KVQuota | None = None, returning_preemption: bool = True) -> None:
        if max_num_batched_tokens < 1 or max_running < 1 or prefill_slice < 1:
            raise ValueError("max_num_batched_tokens, max_running and prefill_slice must be >= 1")
        self.policy = policy
        self.cost = cost
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_running = max_running
        self.prefill_slice = prefill_slice
        self.gate = EligibilityGate(max_skips)
        self.clock = clock
        self.waiting: dict[str, deque[Sequence]] = {}
        self.running: list[Sequence] = []          # in admission order
        self.by_id: dict[str, Sequence] = {}
        self.stats = SchedulerStats()
        self.preemptions_by_tenant: dict[str, int] = {}
        self.finished_by_tenant: dict[str, int] = {}
        self._admit_counter = 0
        self._unfit: dict[str, tuple[str, int]] = {}
        self._uncommitted = 0
        self.quota = quota if quota is not None and quota.enabled else None
        self.reclaim_preemptions = 0
        self.quota_waits: dict[str, int] = {}      # tenant -> iterations its head waited on its quota
        self._no_burst: set[str] = set()           # tenants preempted by reclaim this iteration
        self.returning = ReturningAdmission() if returning_preemption else None
        self._reserved: dict[str, list[int]] = {}  # returning tenant -> [slots, blocks] held for it
        self._protected: set[str] = set()          # admitted through a memory reservation (see _pick_victim)

    # ---- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (the policy sees the arrival). Raises ValueError on a duplicate id."""
        if seq.request_id in self.by_id:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if self.returning is not None:
            acct = self.policy.accounts.get(seq.tenant_id)
            self.returning.on_arrival(seq.tenant_id, acct is not None and acct.backlogged)
        self.policy.on_arrival(seq.tenant_id, seq.weight, seq.tier)
        if self.quota is not None:
            self.quota.observe(seq.tenant_id, seq.weight, seq.tier)
        self.by_id[seq.request_id] = seq
        self.waiting.setdefault(seq.tenant_id, deque()).append(seq)

    def has_work(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark `seq` finished (any reason, abort included), free its KV blocks at once. What it
        consumed stays charged."""
        if seq.is_finished:
            return
        was_waiting = seq.status is SequenceStatus.WAITING
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = self.clock()
        self.blocks.free(seq)
        self._protected.discard(seq.request_id)
        _remove_identical(self.running, seq)
        queue = self.waiting.get(seq.tenant_id)
        if queue is not None:
            _remove_identical(queue, seq)
        if was_waiting:
            self.gate.on_drop(seq.tenant_id, seq.request_id)
        self.by_id.pop(seq.request_id, None)
        self.finished_by_tenant[seq.tenant_id] = self.finished_by_tenant.get(seq.tenant_id, 0) + 1
        self.policy.on_request_finish(seq.tenant_id, seq.request_id, len(seq.prompt_token_ids),
                                      len(seq.output_token_ids))
        if not self._tenant_has_pending(seq.tenant_id):
            self.policy.on_idle(seq.tenant_id)

    def _tenant_has_pending(self, tenant_id: str) -> bool:
        """Queued requests or prefill left (what makes a tenant backlogged for the policy)."""
        return bool(self.waiting.get(tenant_id)) or any(
            s.tenant_id == tenant_id and s.num_uncomputed > 1 for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, requeue at the front of its tenant's queue."""
        self._protected.discard(seq.request_id)
        self.blocks.free(seq)
        _remove_identical(self.running, seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.preemptions_by_tenant[seq.tenant_id] = self.preemptions_by_tenant.get(seq.tenant_id, 0) + 1
        self.waiting.setdefault(seq.tenant_id, deque()).appendleft(seq)
        self.policy.on_arrival(seq.tenant_id, seq.weight, seq.tier)  # backlogged again (lifted if it was not)

    def prefill_backlog(self) -> dict[str, int]:
        """Per tenant with pending prefill: prompt-side tokens not computed yet (waiting requests
        and running partial prefills), tokens."""
        out: dict[str, int] = {}
        for seq in self.running:
            if seq.num_uncomputed > 1:
                out[seq.tenant_id] = out.get(seq.tenant_id, 0) + seq.num_uncomputed
        for tenant, queue in self.waiting.items():
            for seq in queue:
                out[tenant] = out.get(tenant, 0) + seq.num_uncomputed
        return out

    # ---- one iteration --------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        """Pick this iteration's work: decodes first, then the prefill budget split by the policy.

        Returns chunks (decodes first, then prefill chunks in the order they were first given a
        slice) whose token counts sum to at most `max_num_batched_tokens`. Prefill is charged here.
        """
        self.stats.iterations += 1
        budget = self.max_num_batched_tokens
        chunks: dict[str, ScheduledChunk] = {}
        self._no_burst = set()
        self._reserved = {}
        if self.quota is not None:
            self._reclaim()
        if self.returning is not None:
            self._make_room_for_returning()

        # 1. Decodes (one token each), oldest admission first; preempt the newest when out of blocks.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed != 1:
                continue
            while not self.blocks.can_allocate(seq, 1):
                victim = self._pick_victim()
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.blocks.allocate(seq, 1)
            chunk = chunks[seq.request_id] = ScheduledChunk(seq, 1)
            self._charge_prefill(chunk, seq.num_computed_tokens, 1)  # a last prompt token, if any
            budget -= 1

        # 2. Prefill, split slice by slice among tenants in policy order.
        if budget > 0:
            self._schedule_prefill(budget, chunks)
        if not chunks and self.running:
            # Stall (every running sequence is a partial prefill and the pool is full): free the
            # blocks of the victim (with quotas, of the tenant furthest over quota) so that the
            # others can go on.
            victim = self._pick_victim()
            if victim.block_table:
                self._preempt(victim)
                self._schedule_prefill(budget, chunks)
        self._mark_idle(chunks)
        return list(chunks.values())

    def _mark_idle(self, chunks: dict[str, ScheduledChunk]) -> None:
        """Tell the policy which tenants stopped being backlogged: no queued request and no
        prefill left beyond this iteration (their running decodes do not count, as in VTC, where
        a client leaves the queue once its requests are admitted)."""
        pending = {t for t, q in self.waiting.items() if q}
        for seq in self.running:
            c = chunks.get(seq.request_id)
            if seq.num_uncomputed - (c.num_tokens if c is not None else 0) > 1:
                pending.add(seq.tenant_id)
        for acct in self.policy.backlogged():
            if acct.tenant_id not in pending:
                self.policy.on_idle(acct.tenant_id)

    def _schedule_prefill(self, budget: int, chunks: dict[str, ScheduledChunk]) -> None:
        partials: dict[str, deque[Sequence]] = {}
        for seq in self.running:
            if seq.request_id not in chunks and seq.num_uncomputed > 1:
                partials.setdefault(seq.tenant_id, deque()).append(seq)
        alloc: dict[str, int] = {}  # request id -> tokens given this iteration
        self._unfit = {}  # tenant -> (head request id, blocks needed) for heads that did not fit
        # Free blocks not yet promised to running prefills. Slices given to admitted prefills leave
        # it unchanged (a block leaves the free list and the promise alike); an admission lowers it.
        self._uncommitted = self.blocks.num_free - self._outstanding_prefill_blocks()

        def next_head(tenant: str) -> Sequence | None:
            queue = partials.get(tenant)
            while queue:
                if queue[0].num_uncomputed - alloc.get(queue[0].request_id, 0) > 0:
                    return queue[0]
                queue.popleft()
            waiting = self.waiting.get(tenant)
            return waiting[0] if waiting else None

        heads: dict[str, Sequence] = {}
        for tenant in list(partials) + [t for t, q in self.waiting.items() if q and t not in partials]:
            head = next_head(tenant)
            if head is not None:
                heads[tenant] = head
        while budget > 0 and heads:
            for tenant, seq in list(heads.items()):  # the policy only chooses among servable heads
                if not self._servable(seq, alloc.get(seq.request_id, 0)):
                    del heads[tenant]
            if not heads:
                break
            tenant = self.policy.pick(heads.keys(), {t: s.arrival_time for t, s in heads.items()})
            seq = heads[tenant]
            if seq.status is SequenceStatus.WAITING:
                self._admit(seq)
                partials.setdefault(tenant, deque()).appendleft(seq)
                self._charge_cached(chunks, seq)
            have = alloc.get(seq.request_id, 0)
            # a running partial prefill takes a smaller slice when memory is short
            n = min(self.prefill_slice, seq.num_uncomputed - have, budget, self._room(seq, have))
            self.blocks.allocate(seq, have + n)
            alloc[seq.request_id] = have + n
            chunk = chunks.get(seq.request_id)
            if chunk is None:
                chunk = chunks[seq.request_id] = ScheduledChunk(seq, 0)
            chunk.num_tokens += n
            self._charge_prefill(chunk, seq.num_computed_tokens + have, n)
            budget -= n
            head = next_head(tenant)
            if head is None:
                del heads[tenant]
            else:
                heads[tenant] = head

    def _room(self, seq: Sequence, have: int) -> int:
        """Tokens `seq` can still get into its blocks and the free pool (beyond `have` given)."""
        return (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size - seq.num_computed_tokens - have

    def _servable(self, seq: Sequence, have: int) -> bool:
        """Whether `seq` can take a prefill slice now. A waiting head needs a running slot and room
        for its whole remaining prefill in the blocks it may use (else its tenant is skipped for
        this iteration, counted by the gate); a running partial prefill needs one free token slot."""
        if seq.status is not SequenceStatus.WAITING:
            return self._room(seq, have) > 0
        held_slots, held_blocks = self._held_for_others(seq.tenant_id)
        if len(self.running) + held_slots >= self.max_running:
            return False
        need = self.blocks.admission_need(seq)  # the part not served by the prefix cache
        # blocks already promised to running prefills, or held for a returning tenant, are not free
        free = self._uncommitted - held_blocks
        if self.quota is not None and not self.gate.holds(seq.request_id):
            why = self._quota_refusal(seq, need)
            if why is not None:
                self.quota_waits[seq.tenant_id] = self.quota_waits.get(seq.tenant_id, 0) + 1
                if self._committed(seq.tenant_id) == 0:
                    # the tenant holds nothing, so its quota cannot fall further: the request is
                    # larger than what the quota rules leave it. Count it as a memory skip, so that
                    # after max_skips memory is reserved for it (which then lifts the quota check).
                    self._unfit[seq.tenant_id] = (seq.request_id, need)
                return False
        if need > self.gate.available_blocks(seq.tenant_id, seq.request_id, free):
            self._unfit[seq.tenant_id] = (seq.request_id, need)
            return False
        return True

    # ---- KV quotas ------------------------------------------------------------------------------
    def held_by_tenant(self, reclaimable: bool = False) -> dict[str, int]:
        """KV blocks held per tenant with running sequences (reclaimable: leave out requests
        admitted through a memory reservation, which quota preemption does not take)."""
        out: dict[str, int] = {}
        for s in self.running:
            if not (reclaimable and s.request_id in self._protected):
                out[s.tenant_id] = out.get(s.tenant_id, 0) + len(s.block_table)
        return out

    def _outstanding_prefill_blocks(self) -> int:
        """Blocks running sequences will still take to finish their prefill."""
        return sum(max(0, self.blocks.blocks_for(s.num_tokens) - len(s.block_table)) for s in self.running)

    def _committed(self, tenant_id: str) -> int:
        """Blocks the tenant holds plus those its running prefills will still take."""
        return sum(max(len(s.block_table), self.blocks.blocks_for(s.num_tokens))
                   for s in self.running if s.tenant_id == tenant_id)

    def _quota_refusal(self, seq: Sequence, need: int) -> str | None:
        assert self.quota is not None
        tenant = seq.tenant_id
        committed = self._committed(tenant)
        why = self.quota.admission_allowed(tenant, committed, need, self.blocks.num_used, bool(self.running))
        if why is None and tenant in self._no_burst and committed + need > self.quota.soft_blocks(tenant):
            why = "over-quota"  # just preempted to make room for a within-quota tenant: no burst back
        return why

    def _latest_with_blocks(self, tenant_id: str) -> Sequence | None:
        """The tenant's latest admission holding blocks, requests admitted through a reservation aside."""
        for s in reversed(self.running):
            if s.tenant_id == tenant_id and s.block_table and s.request_id not in self._protected:
                return s
        return None

    def _pick_victim(self) -> Sequence:
        """Preemption victim: with quotas, the latest admitted request (holding blocks) of the tenant
        furthest over its soft quota; otherwise (or when nobody is over quota) the newest admission.
        A request admitted through a memory reservation (it waited its bounded number of skips) is
        taken last, so that it is not admitted and preempted over and over."""
        if self.quota is not None:
            tenant = self.quota.pick_victim_tenant(self.held_by_tenant(reclaimable=True))
            if tenant is not None:
                victim = self._latest_with_blocks(tenant)
                if victim is not None:
                    return victim
        return next((s for s in reversed(self.running) if s.request_id not in self._protected), self.running[-1])

    def _reclaim(self) -> None:
        """Preempt over-quota tenants' requests so that waiting heads of tenants within their soft
        quota fit (only when the over-quota tenants hold enough blocks to make the difference). The
        room made is held for that tenant for the iteration, so that a third tenant's admission
        cannot take it (which would leave the head waiting and the preemption wasted)."""
        assert self.quota is not None
        quota = self.quota

        def room() -> int:  # blocks an admission may use: free, less promised and headroom
            return self.blocks.num_free - self._outstanding_prefill_blocks() - quota.headroom_blocks
        for tenant, queue in list(self.waiting.items()):
            if not queue or len(self.running) >= self.max_running:
                continue
            head = queue[0]
            need = self.blocks.admission_need(head)
            if self._committed(tenant) + need > quota.soft_blocks(tenant):
                continue  # over (or would go over) its quota: no reclaim on its behalf
            if need <= room():
                continue
            held = self.held_by_tenant(reclaimable=True)
            held.pop(tenant, None)
            over = {t: b for t, b in held.items() if quota.over_soft(t, b)}
            if sum(over.values()) < need - room():
                continue
            while need > room():
                victim_tenant = quota.pick_victim_tenant(over)
                victim = self._latest_with_blocks(victim_tenant) if victim_tenant is not None else None
                if victim is None:
                    break
                over[victim_tenant] -= len(victim.block_table)
                self._preempt(victim)
                self.reclaim_preemptions += 1
                self._no_burst.add(victim_tenant)
            if need <= room():
                held_for = self._reserved.setdefault(tenant, [0, 0])
                held_for[0], held_for[1] = held_for[0] + 1, held_for[1] + need

    # ---- returning tenants -----------------------------------------------------------------------
    def _held_for_others(self, tenant_id: str) -> tuple[int, int]:
        """(slots, blocks) held this iteration for returning tenants other than `tenant_id`."""
        slots = blocks = 0
        for tenant, (s, b) in self._reserved.items():
            if tenant != tenant_id:
                slots, blocks = slots + s, blocks + b
        return slots, blocks

    def _make_room_for_returning(self) -> None:
        """Hold a running slot and KV room for the heads of returning tenants below their slot
        share, preempting over-share tenants' latest admissions where there is none (see
        `worker.scheduling.returning`): heads in queue order while the policy would still serve the
        tenant first, after charging the heads held before it (one chunk of slack; policies without
        counters: one head per iteration), among the tenants whose heads could take a slot now
        (none when every slot is taken: the others wait for a slot anyway)."""
        assert self.returning is not None
        ret = self.returning
        for tenant in [t for t in ret.returning if not self.waiting.get(t)]:
            ret.done(tenant)
        if not ret.returning:
            return
        weights: dict[str, float] = {}
        tiers: dict[str, str] = {}
        running: dict[str, int] = {}
        for seq in self.running:
            running[seq.tenant_id] = running.get(seq.tenant_id, 0) + 1
        for seq in list(self.running) + [q[0] for q in self.waiting.values() if q]:
            weights[seq.tenant_id], tiers[seq.tenant_id] = seq.weight, seq.tier
        # the batch the pool holds now: max_running when slots bind, fewer when KV memory does
        batch = max(1, len(self.running))
        shares = ret.slot_shares(weights, batch)
        heads = {t: q[0] for t, q in self.waiting.items() if q}
        arrival = {t: h.arrival_time for t, h in heads.items()}
        slack = self.cost.prefill(self.max_num_batched_tokens)  # one chunk: within VTC's bound
        for tenant in self.policy.order(list(ret.returning), arrival):
            promised = -slack
            for head in list(self.waiting[tenant]):
                if not ret.below_share(running.get(tenant, 0), shares[tenant]):
                    ret.done(tenant)  # at its share: VTC alone from here on
                    break
                # only while the policy would still serve it first among the rivals once the heads
                # already held for it are charged (beyond one chunk of slack)
                # rivals: the tenants whose heads could take a slot now (none while every slot is taken)
                rivals = list(heads) if len(self.running) < self.max_running else [tenant]
                if not self.policy.is_first(tenant, rivals, arrival, ahead_units=promised):
                    break
                if not self._hold_room(tenant, head, running, weights, tiers, batch):
                    break
                running[tenant] = running.get(tenant, 0) + 1
                promised += self.cost.prefill(head.num_uncomputed)

    def _hold_room(self, tenant: str, head: Sequence, running: dict[str, int], weights: dict[str, float],
                   tiers: dict[str, str], batch: int) -> bool:
        """Reserve one slot and `head`'s blocks for `tenant`, preempting victims if needed. Returns
        False (preempting nothing) when the victims available cannot make the room."""
        assert self.returning is not None
        need = self.blocks.admission_need(head)
        if self.quota is not None and self._committed(tenant) + need > self.quota.soft_blocks(tenant):
            return False  # it would go over its soft quota: not a case for preemption
        slots, blocks = self._held_for_others(tenant)
        mine = self._reserved.get(tenant, [0, 0])
        headroom = self.quota.headroom_blocks if self.quota is not None else 0

        def fits(freed_blocks: int) -> bool:
            free = self.blocks.num_free + freed_blocks - self._outstanding_prefill_blocks() - blocks - mine[1] - headroom
            return need <= self.gate.available_blocks(tenant, head.request_id, free)

        allowed = None
        if self.quota is not None:
            over = {t for t, b in self.held_by_tenant(reclaimable=True).items() if self.quota.over_soft(t, b)}
            allowed = over or None
        # plan the victims first; preempt only if the plan makes the room
        plan: list[Sequence] = []
        sim_running = dict(running)
        freed = 0
        no_slot = len(self.running) + slots + mine[0] >= self.max_running
        while no_slot or not fits(freed):
            victim_tenant = self.returning.victim_tenant(tenant, sim_running, weights, tiers, batch, allowed)
            victim = next((s for s in reversed(self.running) if s.tenant_id == victim_tenant
                           and s.request_id not in self._protected and all(s is not p for p in plan)), None)
            if victim is None:
                return False
            plan.append(victim)
            sim_running[victim.tenant_id] -= 1
            # its blocks return to the pool and the blocks its prefill was promised are no longer owed
            freed += max(len(victim.block_table), self.blocks.blocks_for(victim.num_tokens))
            no_slot = False
        for victim in plan:
            self._preempt(victim)
            running[victim.tenant_id] -= 1
            self.returning.preemptions += 1
        self._reserved[tenant] = [mine[0] + 1, mine[1] + need]
        return True

    def _admit(self, seq: Sequence) -> None:
        # Tenants whose head did not fit this iteration are skipped in favour of this admission.
        for tenant, (request_id, need) in self._unfit.items():
            if tenant != seq.tenant_id:
                self.gate.on_skip(tenant, request_id, need, self.stats.iterations)
        need = self.blocks.admission_need(seq)
        self._uncommitted -= need
        self.blocks.attach_prefix(seq)  # a cached prefix: its blocks shared, its tokens not recomputed
        queue = self.waiting[seq.tenant_id]
        assert queue[0] is seq
        queue.popleft()
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = self._admit_counter
        self._admit_counter += 1
        self.running.append(seq)
        if self.gate.holds(seq.request_id):
            self._protected.add(seq.request_id)
        self.gate.on_admit(seq.tenant_id, seq.request_id)
        held = self._reserved.get(seq.tenant_id)
        if held is not None:
            held[0] -= 1
            held[1] -= need
            if held[0] <= 0:
                del self._reserved[seq.tenant_id]
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
            self.policy.on_admit(seq.tenant_id, seq.request_id, len(seq.prompt_token_ids), seq.max_tokens)

    def _charge_cached(self, chunks: dict[str, ScheduledChunk], seq: Sequence) -> None:
        """Charge, at the cost function's cached rate, the prompt positions just served from the
        prefix cache (those in [0, num_computed_tokens) never charged before); they count in
        `num_cached_tokens`, reported as the request's cached prompt tokens."""
        lo = seq.num_charged_prefill
        hi = min(seq.num_computed_tokens, len(seq.prompt_token_ids))
        if hi <= lo:
            return
        units = self.cost.prefill(0, hi - lo, start=lo)
        seq.num_charged_prefill = hi
        seq.num_cached_tokens += hi - lo
        chunk = chunks.get(seq.request_id)
        if chunk is None:
            chunk = chunks[seq.request_id] = ScheduledChunk(seq, 0)
        if units:
            self.policy.charge(seq.tenant_id, units, request_id=seq.request_id)
            chunk.prefill_units += units

    def _charge_prefill(self, chunk: ScheduledChunk, start: int, n: int) -> None:
        """Charge the prompt positions in [start, start+n) never charged before."""
        seq = chunk.seq
        lo = max(start, seq.num_charged_prefill)
        hi = min(start + n, len(seq.prompt_token_ids))
        if hi <= lo:
            return
        units = self.cost.prefill(hi - lo, 0, start=lo)
        seq.num_charged_prefill = hi
        self.policy.charge(seq.tenant_id, units, prompt_tokens=hi - lo, request_id=seq.request_id)
        chunk.prefill_units += units
        chunk.prefill_tokens += hi - lo

    def tenant_counts(self) -> dict[str, dict[str, int]]:
        """Per tenant: waiting and running sequences and KV blocks held (plus, with quotas, the
        soft quota and hard cap in blocks and whether it is over its soft quota)."""
        out: dict[str, dict[str, int]] = {}
        for tenant, queue in self.waiting.items():
            out.setdefault(tenant, {"waiting": 0, "running": 0, "kv_blocks": 0})["waiting"] = len(queue)
        for seq in self.running:
            c = out.setdefault(seq.tenant_id, {"waiting": 0, "running": 0, "kv_blocks": 0})
            c["running"] += 1
            c["kv_blocks"] += len(seq.block_table)
        if self.quota is not None:
            for tenant, c in out.items():
                c.update(self.quota.state(tenant, c["kv_blocks"]))
        return out


def _remove_identical(items, seq: Sequence) -> None:
    """Remove `seq` itself (by identity, not dataclass equality) from a list or deque, if present."""
    for i, item in enumerate(items):
        if item is seq:
            del items[i]
            return
