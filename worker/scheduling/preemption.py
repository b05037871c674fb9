"""Whom to preempt and why: one victim rule for every reason, and the rules that make room.

Every preemption is a recompute preemption (the victim's blocks are freed, it goes back to the
front of its tenant's queue, ahead of that tenant's newer work, and its recomputed prefill is not
charged again). Four reasons, one victim rule:

- **out of blocks** (a running decode finds no free block; or every running request is a partial
  prefill and none can get one, a *stall*);
- **reclaim** (KV quotas): a waiting head of a tenant within its soft quota does not fit, and
  over-quota tenants hold enough blocks to make the difference;
- **tier**: a waiting head of a higher tier finds no slot or KV room while running work of a lower
  tier could give it one;
- **returning**: a tenant returning below its weighted slot share (`worker.scheduling.returning`).

Who may be taken (`may_take`): work of the requester's own tier, or of a lower tier that is
*preemptible* (it has no minimum share, or it is not backlogged, or it is half a deficit floor
ahead of its minimum share: `TierShares.preemptible`), except requests admitted while their tier
was owed its minimum share. So a lower tier near its minimum share keeps its room, and a flood of
background work that had the server to itself yields at once. A higher tier is never taken for a
lower one. Among those (`victim`): the lowest tier first; within it, with KV
quotas, the tenant furthest over its soft quota; then requests not admitted through a memory
reservation before those that were (so that such a request is not admitted and preempted over and
over); then the newest admission.

Room made by reclaim, tier or returning preemption is held in the ledger for the request (or
tenant) it was made for during this iteration, so that a third party cannot take it (which left a
head waiting and the preemption wasted: the livelock the ledger replaced). Preemptions are planned
first and carried out only when the plan makes the room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator

from worker.scheduling import ledger as L
from worker.scheduling.tiers import RANK

if TYPE_CHECKING:
    from worker.scheduling.core import Entry, SchedulingCore, TenantState


class RoomMaker:
    """The preemption rules of one `SchedulingCore` (they read its ledger, tiers and quotas)."""

    def __init__(self, core: "SchedulingCore") -> None:
        self.core = core

    # ---- who may be taken --------------------------------------------------------------------
    def may_take(self, requester_tier: str | None, victim: "Entry") -> bool:
        """Whether running `victim` may be preempted for work of `requester_tier` (None: for no one
        in particular, a stall)."""
        if requester_tier is None:
            return True
        vt = victim.tenant.sched_tier
        if vt == requester_tier:
            return True
        return (RANK[vt] > RANK[requester_tier] and not victim.for_share
                and self.core.tiers.preemptible(victim.tenant.tier))

    def victim(self, requester: "Entry | None") -> "Entry":
        """Out of blocks (for `requester`'s next token, or a stall when None): the request to
        preempt (possibly the requester itself): the first of `victims_in_order`."""
        return next(self.victims_in_order(requester=requester))

    def victims_in_order(self, running: "Iterable[Entry] | None" = None, requester: "Entry | None" = None,
                         reason: str = "out-of-blocks") -> "Iterator[Entry]":
        """The running requests in the order to preempt them, first victim first: the one victim
        rule of every executor (the reference engine's out-of-blocks and tier preemptions, the SGLang
        plugin's decode retraction order, `ScheduleBatch._get_decode_retraction_order`).

        running: the candidates, in admission order (default: every running request of the core);
        requester: whose room is made (None: nobody in particular, e.g. SGLang's decode batch as a
        whole). reason: `out-of-blocks` (and `stall`): the candidates `may_take` allows for the
        requester, then the requester itself last; `tier`: only candidates of tiers strictly below
        the requester's that `may_take` allows (never the requester). Order: the lowest tier first;
        within it, with KV quotas, the tenant furthest over its soft quota (recomputed as its
        requests are taken); then requests not admitted through a memory reservation before those
        that were; then the newest admission. Lazy: the first victim costs one pass over the
        candidates. Raises StopIteration at once when there is nobody (no candidate, no requester).
        """
        core = self.core
        pool = list(core.running.values() if running is None else running)
        req_tier = requester.tenant.sched_tier if requester is not None else None
        if reason == "tier":
            pool = [e for e in pool if e is not requester and RANK[e.tenant.sched_tier] > RANK[req_tier]
                    and self.may_take(req_tier, e)]
        else:
            pool = [e for e in pool if self.may_take(req_tier, e)]
        if core.quota is None:  # a fixed order: one sort
            ranked = sorted(enumerate(pool), key=lambda ie: (-RANK[ie[1].tenant.sched_tier], ie[1].protected, -ie[0]))
            for _, e in ranked:
                yield e
                if e is requester:
                    return
            pool = []
        while pool:  # with KV quotas the tenant furthest over its quota changes as requests go
            lowest = max(RANK[e.tenant.sched_tier] for e in pool)
            tier_pool = [e for e in pool if RANK[e.tenant.sched_tier] == lowest]
            e = None
            if core.quota is not None:
                tenant = core.quota.pick_victim_tenant(self.held_by_tenant(tier_pool, reclaimable=True))
                if tenant is not None:
                    e = self._latest_with_blocks(tier_pool, tenant)
            if e is None:
                e = next((x for x in reversed(tier_pool) if not x.protected), tier_pool[-1])
            yield e
            pool = [x for x in pool if x is not e]
            if e is requester:
                return
        if requester is not None and reason != "tier":
            yield requester

    def _latest_with_blocks(self, pool, tenant_id: str) -> "Entry | None":
        blocks = self.core.executor.blocks_held
        for e in reversed(pool):
            if e.tenant_id == tenant_id and not e.protected and blocks(e.handle):
                return e
        return None

    # ---- KV quota figures ---------------------------------------------------------------------
    def held_by_tenant(self, pool=None, reclaimable: bool = False) -> dict[str, int]:
        """KV blocks held per tenant by running requests (of `pool`, default all; reclaimable:
        leave out requests admitted through a memory reservation)."""
        blocks = self.core.executor.blocks_held
        out: dict[str, int] = {}
        for e in (self.core.running.values() if pool is None else pool):
            if not (reclaimable and e.protected):
                out[e.tenant_id] = out.get(e.tenant_id, 0) + blocks(e.handle)
        return out

    def committed(self, ts: "TenantState") -> int:
        """Blocks the tenant holds plus those its running prefills will still take."""
        ex = self.core.executor
        return sum(ex.blocks_held(e.handle) + ex.blocks_promised(e.handle) for e in ts.running.values())

    def quota_refusal(self, ts: "TenantState", need: int) -> str | None:
        """Why the quota rules refuse an admission of `need` blocks for the tenant now (None: they
        allow it): hard cap, headroom, over its soft quota above the watermark, or just preempted
        by reclaim for a within-quota tenant (no burst back in the same iteration)."""
        core = self.core
        quota = core.quota
        committed = self.committed(ts)
        why = quota.admission_allowed(ts.tenant_id, committed, need, core.ledger.committed, bool(core.running))
        if why is None and ts.tenant_id in core.no_burst and committed + need > quota.soft_blocks(ts.tenant_id):
            why = "over-quota"
        return why

    # ---- carrying out a plan --------------------------------------------------------------------
    def _freed(self, e: "Entry") -> int:
        """Blocks preempting `e` gives back to the room: what it holds and what it was promised."""
        ex = self.core.executor
        return ex.blocks_held(e.handle) + ex.blocks_promised(e.handle)

    def _carry_out(self, plan: list, reason: str, requester: "Entry") -> None:
        core = self.core
        for e in plan:
            core.preempt(e, reason, requester)
        core.ledger.free = core.executor.free_blocks()

    def _room_for(self, e: "Entry", need: int, freed: int = 0, freed_slots: int = 0) -> bool:
        """A slot and `need` blocks for `e`, after the room already held for its tenant's other
        heads this iteration and `freed` blocks / `freed_slots` slots a plan would give back."""
        ledger = self.core.ledger
        tid, rid = e.tenant_id, e.request_id
        mine_slots, mine_blocks = ledger.held_for(tid, rid)
        room = ledger.room(tid, rid, freed=freed) - mine_blocks
        slots = ledger.free_slots(tid, rid) - mine_slots + freed_slots
        return need <= room and slots > 0

    # ---- quota reclaim ---------------------------------------------------------------------------
    def reclaim(self) -> None:
        """Preempt over-quota tenants' requests so that waiting heads of tenants within their soft
        quota fit (only when the over-quota tenants they may take from hold enough blocks), and
        hold the room made for that tenant this iteration."""
        core = self.core
        quota, ledger = core.quota, core.ledger
        for ts in list(core.tenants.values()):
            if not ts.waiting or ledger.running >= ledger.max_running:
                continue
            head = ts.waiting[0]
            need = core.executor.admission_need(head.handle)
            if self.committed(ts) + need > quota.soft_blocks(ts.tenant_id):
                continue  # over (or would go over) its quota: no reclaim on its behalf
            room = ledger.room(ts.tenant_id, head.request_id)
            if need <= room:
                continue
            pool = [e for e in core.running.values() if e.tenant is not ts and self.may_take(ts.sched_tier, e)]
            held = self.held_by_tenant(pool, reclaimable=True)
            over = {t: b for t, b in held.items() if quota.over_soft(t, b)}
            if sum(over.values()) < need - room:
                continue
            while need > ledger.room(ts.tenant_id, head.request_id):
                victim_tenant = quota.pick_victim_tenant(over)
                victim = self._latest_with_blocks(pool, victim_tenant) if victim_tenant is not None else None
                if victim is None:
                    break
                over[victim_tenant] -= core.executor.blocks_held(victim.handle)
                pool.remove(victim)
                self._carry_out([victim], "reclaim", head)
                core.no_burst.add(victim_tenant)
            if need <= ledger.room(ts.tenant_id, head.request_id):
                ledger.hold(L.RECLAIM, ts.tenant_id, None, 1, need)

    # ---- tier preemption -------------------------------------------------------------------------
    def for_higher_tiers(self) -> None:
        """Strict priority when slots or KV blocks are short: for the heads of each tier above the
        lowest, in the order the core would admit them and up to one prefill chunk of their
        prompts, where no slot or KV room is free (after the room the heads before it will take),
        preempt running work of lower, preemptible tiers (lowest tier first, newest admission
        first) if that makes the room, and hold it for that head."""
        core = self.core
        if not core.tiers.enabled:
            return
        from worker.scheduling.policy import TIERS

        for tier in TIERS[:-1]:
            lower = [k for k in TIERS if RANK[k] > RANK[tier] and core._running_by_tier[k] > 0
                     and core.tiers.preemptible(k)]
            if not lower or not core._pending[tier]:
                continue
            candidates = [e for e in core.running.values() if e.tenant.sched_tier in lower and not e.for_share]
            if not candidates:
                continue
            # the victim rule's order (lowest tier, over-quota tenant, unreserved, newest first),
            # taken lazily as victims are needed
            victims = _Lookahead(self.victims_in_order(candidates, None))
            budget = core.chunk_tokens
            planned_slots = planned_blocks = 0  # taken by the heads before this one that fit as it is
            for head in core.projected_heads(tier):
                if budget <= 0 or not victims:
                    break
                need = core.executor.admission_need(head.handle)
                if core.quota is not None and not core.gate.holds(head.request_id) \
                        and self.quota_refusal(head.tenant, need) is not None:
                    break  # its quota holds it back: not a case for preemption
                budget -= max(1, core.executor.prefill_left(head.handle))
                if self._room_for(head, need + planned_blocks, 0, -planned_slots):
                    planned_slots, planned_blocks = planned_slots + 1, planned_blocks + need
                    continue
                plan, freed = [], 0
                while not self._room_for(head, need + planned_blocks, freed, len(plan) - planned_slots) and victims:
                    v = victims.take()   # lowest tier, then newest admission (reserved ones last)
                    plan.append(v)
                    freed += self._freed(v)
                if not self._room_for(head, need + planned_blocks, freed, len(plan) - planned_slots):
                    break  # the lower tiers cannot make the room: preempt nothing for it
                self._carry_out(plan, "tier", head)
                core.ledger.hold(L.TIER, head.tenant_id, head.request_id, 1, need)

    # ---- minimum shares --------------------------------------------------------------------------
    def for_owed_tiers(self) -> None:
        """Hold a slot and KV room for the next head of the lower tier most owed its minimum
        share, so that higher tiers' admissions (and their tier preemptions, planned after this
        hold) do not take the room before it, and the room that frees up goes to it."""
        core = self.core
        owed = core.tiers.owed_tiers()
        if not owed:
            return
        head = core.first_waiting_head(owed[0])
        if head is None:
            return  # its work is running prefills: the round serves them first
        need = core.executor.admission_need(head.handle)
        if core.quota is not None and not core.gate.holds(head.request_id) \
                and self.quota_refusal(head.tenant, need) is not None:
            return
        core.ledger.hold(L.MIN_SHARE, head.tenant_id, head.request_id, 1, need)

    # ---- returning tenants -----------------------------------------------------------------------
    def for_returning(self) -> None:
        """Hold a running slot and KV room for the heads of returning tenants below their slot
        share, preempting over-share tenants' latest admissions where there is none (see
        `worker.scheduling.returning`): heads in queue order while the policy would still serve
        the tenant first among its tier's rivals after charging the heads held before it (one
        chunk of slack; policies without counters: one head per iteration), rivals being the
        tenants whose heads could take a slot now (none when every slot is taken)."""
        core = self.core
        ret = core.returning
        for tenant in [t for t in ret.returning if not core.tenants[t].waiting]:
            ret.done(tenant)
        if not ret.returning:
            return
        weights: dict[str, float] = {}
        tiers: dict[str, str] = {}
        running: dict[str, int] = {}
        for e in core.running.values():
            running[e.tenant_id] = running.get(e.tenant_id, 0) + 1
            weights[e.tenant_id], tiers[e.tenant_id] = e.tenant.weight, e.tenant.sched_tier
        heads = {}
        for ts in core.tenants.values():
            if ts.waiting:
                heads[ts.tenant_id] = ts.waiting[0]
                weights[ts.tenant_id], tiers[ts.tenant_id] = ts.weight, ts.sched_tier
        batch = max(1, len(core.running))  # the batch the pool holds now
        shares = ret.slot_shares(weights, batch)
        arrival = {t: h.arrival for t, h in heads.items()}
        slack = core.cost.prefill(core.chunk_tokens)  # one chunk: within VTC's bound
        for tenant in core.policy.order(list(ret.returning), arrival):
            ts = core.tenants[tenant]
            promised = -slack
            for head in list(ts.waiting):
                if not ret.below_share(running.get(tenant, 0), shares[tenant]):
                    ret.done(tenant)  # at its share: the policy alone from here on
                    break
                if core.ledger.running < core.ledger.max_running:
                    rivals = [t for t in heads if tiers[t] == ts.sched_tier]
                else:
                    rivals = [tenant]
                if not core.policy.is_first(tenant, rivals, arrival, ahead_units=promised):
                    break
                if not self._held_for_request(head) and not self._hold_for_returning(head, running, weights, tiers,
                                                                                      batch):
                    break
                running[tenant] = running.get(tenant, 0) + 1
                promised += core.cost.prefill(core.executor.prefill_left(head.handle))

    def _held_for_request(self, head: "Entry") -> bool:
        """Whether room is already held for this very request (e.g. by tier preemption)."""
        return any(h.request_id == head.request_id and h.slots > 0 for h in self.core.ledger.holds)

    def _hold_for_returning(self, head: "Entry", running: dict, weights: dict, tiers: dict, batch: int) -> bool:
        """Hold one slot and `head`'s blocks for its tenant, preempting victims if needed. Returns
        False (preempting nothing) when the victims available cannot make the room."""
        core = self.core
        ret = core.returning
        ts = head.tenant
        need = core.executor.admission_need(head.handle)
        if core.quota is not None and self.committed(ts) + need > core.quota.soft_blocks(ts.tenant_id):
            return False  # it would go over its soft quota: not a case for preemption
        pool = [e for e in core.running.values() if self.may_take(ts.sched_tier, e)]
        allowed = {e.tenant_id for e in pool}
        if core.quota is not None:
            over = {t for t, b in self.held_by_tenant(pool, reclaimable=True).items() if core.quota.over_soft(t, b)}
            allowed = over or allowed
        plan: list = []
        sim_running = dict(running)
        freed = 0
        while not self._room_for(head, need, freed, len(plan)):
            victim_tenant = ret.victim_tenant(ts.tenant_id, sim_running, weights, tiers, batch, allowed)
            victim = next((e for e in reversed(pool) if e.tenant_id == victim_tenant and not e.protected
                           and all(e is not p for p in plan)), None)
            if victim is None:
                return False
            plan.append(victim)
            sim_running[victim.tenant_id] -= 1
            freed += self._freed(victim)
        if plan:
            self._carry_out(plan, "returning", head)
        for victim in plan:
            running[victim.tenant_id] -= 1
            ret.preemptions += 1
        core.ledger.hold(L.RETURNING, ts.tenant_id, None, 1, need)
        return True


class _Lookahead:
    """An iterator that can say whether it has a next item (truthy while it does); `take()` returns it."""

    def __init__(self, it: Iterator) -> None:
        self._it = it
        self._next = next(it, None)

    def __bool__(self) -> bool:
        return self._next is not None

    def take(self):
        item, self._next = self._next, next(self._it, None)
        return item
