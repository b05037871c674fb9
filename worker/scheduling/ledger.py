"""The one ledger of KV room and running slots that every scheduling rule reads.

Before this ledger the reference scheduler kept six overlapping notions of held room (blocks not
promised to running prefills, the eligibility reservation, room held for returning tenants, room
made by quota reclaim, requests admitted through a reservation, tenants that may not burst back)
and computed free room three ways; a livelock came from two of them disagreeing. Now there is one
account, in KV blocks and running slots:

    free       blocks an allocation can get now (free list + evictable cached blocks), reported
               by the executor at each `sync`
    promised   blocks running prefills will still take to finish (reported at `sync`; raised by
               each admission's need, lowered as prefill blocks are allocated)
    holds      room held for one tenant or one request: the eligibility reservation (bounded
               skips, then memory is reserved: kept across iterations), and for this iteration
               only, room made by quota reclaim, by a returning tenant's preemption, by tier
               preemption, or held for a lower tier owed its minimum share
    headroom   blocks admissions may never use (KV quotas: the reserved system headroom)

    room for an admission of request r of tenant t = free − promised − headroom − holds ahead of r
    free slots for r                               = max_running − running − slot holds ahead of r

Holds are kept in the order they were made, and *ahead of r* means: every hold made before the
first hold for r (or for its tenant), or every hold when r has none. A hold is made either for room
that is there when it is made (reclaim, tier, returning: the holds ahead of it already counted) or
for room that is not free yet (the reservation, a minimum share); a holder never waits on a hold
made after its own, so holds cannot wait on each other in a circle (a deadlock the state machine in
tests/unit/test_core_properties.py found when every hold counted against every other).

Running requests (decodes, admitted prefills) never ask the ledger: they already hold their place
(their promised blocks are theirs). Pure bookkeeping on ids and counts (no torch, no grpc).
"""

from __future__ import annotations

from dataclasses import dataclass

from fairshare.checks import require_at_least

# hold kinds
RESERVATION = "reservation"   # eligibility: bounded skips, then memory reserved (kept across iterations)
RECLAIM = "reclaim"           # KV quotas: room made for a within-quota tenant's head
RETURNING = "returning"       # a returning tenant's slot share
TIER = "tier"                 # room made by preempting lower-tier work for a higher tier's head
MIN_SHARE = "min-share"       # room held for the head of a lower tier owed its minimum share


@dataclass
class Hold:
    """Room held for `request_id` (or, when None, any request of `tenant_id`): `slots` running
    slots and `blocks` KV blocks. kind: one of the kinds above."""

    kind: str
    tenant_id: str
    request_id: str | None
    slots: int
    blocks: int

    def is_for(self, tenant_id: str, request_id: str) -> bool:
        return self.request_id == request_id if self.request_id is not None else self.tenant_id == tenant_id


class KVLedger:
    """KV room and running slots (see the module docstring).

    total_blocks: the pool (> 0). max_running: running slots (> 0). headroom_blocks: blocks
    admissions may not use (>= 0). Raises ValueError on bad sizes.
    """

    def __init__(self, total_blocks: int, max_running: int, headroom_blocks: int = 0) -> None:
        require_at_least(1, total_blocks=total_blocks, max_running=max_running)
        require_at_least(0, headroom_blocks=headroom_blocks)
        self.total_blocks = total_blocks
        self.max_running = max_running
        self.headroom = headroom_blocks
        self.holds: list[Hold] = []
        self.sync(free=total_blocks, promised=0, running=0)  # an empty pool until the executor reports

    # ---- what the executor reports ----------------------------------------------------------
    def sync(self, free: int, promised: int, running: int) -> None:
        """The executor's figures now: free blocks, blocks promised to running prefills, running
        requests."""
        self.free, self.promised, self.running = int(free), int(promised), int(running)

    def on_admit(self, tenant_id: str, request_id: str, need: int) -> None:
        """A waiting request needing `need` blocks was admitted: it takes a slot, its need becomes
        promised, and the room held for it (if any) is used up by that much."""
        self.running += 1
        self.promised += need
        for h in list(self.holds):
            if h.kind != RESERVATION and h.is_for(tenant_id, request_id):
                h.slots -= 1
                h.blocks -= need
                if h.slots <= 0 or h.request_id is not None:
                    self.holds.remove(h)
                break
        self.release(RESERVATION, request_id=request_id)

    def on_prefill_alloc(self, blocks: int) -> None:
        """`blocks` promised blocks were allocated to a running prefill (room is unchanged)."""
        self.free -= blocks
        self.promised -= blocks

    def on_alloc(self, blocks: int) -> None:
        """`blocks` blocks were allocated outside a promise (a decode growing, a prefill past its
        promise)."""
        self.free -= blocks

    def on_release(self, blocks: int, promise: int) -> None:
        """A running request left (finished or preempted): its `blocks` return, its unfulfilled
        `promise` is dropped, its slot frees."""
        self.free += blocks
        self.promised -= promise
        self.running -= 1

    # ---- holds --------------------------------------------------------------------------------
    def hold(self, kind: str, tenant_id: str, request_id: str | None, slots: int, blocks: int) -> Hold:
        """Hold room; a second hold of the same kind for the same holder adds up."""
        for h in self.holds:
            if h.kind == kind and h.tenant_id == tenant_id and h.request_id == request_id:
                h.slots += slots
                h.blocks += blocks
                return h
        h = Hold(kind, tenant_id, request_id, slots, blocks)
        self.holds.append(h)
        return h

    def release(self, kind: str, tenant_id: str | None = None, request_id: str | None = None) -> None:
        """Drop holds of `kind` (for that tenant and/or request when given)."""
        self.holds = [h for h in self.holds if not (
            h.kind == kind and (tenant_id is None or h.tenant_id == tenant_id)
            and (request_id is None or h.request_id == request_id))]

    def reservation(self) -> Hold | None:
        """The eligibility reservation, if one is held."""
        return next((h for h in self.holds if h.kind == RESERVATION), None)

    def new_iteration(self) -> None:
        """Drop the holds that last one iteration (everything but the eligibility reservation)."""
        self.holds = [h for h in self.holds if h.kind == RESERVATION]

    def held_for_others(self, tenant_id: str, request_id: str) -> tuple[int, int]:
        """(slots, blocks) held ahead of this request of this tenant: by the holds made before its
        own first hold (all holds when it has none)."""
        slots = blocks = 0
        for h in self.holds:
            if h.is_for(tenant_id, request_id):
                break
            slots += h.slots
            blocks += h.blocks
        return slots, blocks

    def held_for(self, tenant_id: str, request_id: str) -> tuple[int, int]:
        """(slots, blocks) held for this request or its tenant."""
        slots = blocks = 0
        for h in self.holds:
            if h.is_for(tenant_id, request_id):
                slots += h.slots
                blocks += h.blocks
        return slots, blocks

    # ---- what every rule reads ----------------------------------------------------------------
    @property
    def uncommitted(self) -> int:
        """Free blocks not promised to running prefills."""
        return self.free - self.promised

    @property
    def committed(self) -> int:
        """Blocks in use or promised (the pool less the uncommitted blocks)."""
        return self.total_blocks - self.uncommitted

    def room(self, tenant_id: str, request_id: str, *, freed: int = 0) -> int:
        """Blocks an admission of this request may use (after `freed` more blocks came back). The
        request memory is reserved for (it waited its bounded skips) may use the headroom too: the
        reservation lifts the quota rules for it, and the headroom is one of them."""
        _, held = self.held_for_others(tenant_id, request_id)
        r = self.reservation()
        headroom = 0 if r is not None and r.request_id == request_id else self.headroom
        return self.free + freed - self.promised - headroom - held

    def free_slots(self, tenant_id: str, request_id: str) -> int:
        """Running slots an admission of this request may take."""
        held, _ = self.held_for_others(tenant_id, request_id)
        return self.max_running - self.running - held

    def fits(self, tenant_id: str, request_id: str, need: int, *, freed: int = 0, freed_slots: int = 0) -> bool:
        """Whether a slot and `need` blocks are there for this request (after preempting victims
        that free `freed` blocks and `freed_slots` slots)."""
        return (need <= self.room(tenant_id, request_id, freed=freed)
                and self.free_slots(tenant_id, request_id) + freed_slots > 0)
