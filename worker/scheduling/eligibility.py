"""Eligibility: a tenant whose head request does not fit memory is skipped, but not forever.

DESIGN.md, "Eligibility": a tenant whose head request does not fit its KV memory is skipped for
that iteration instead of blocking everyone (the others' work goes ahead: work-conserving, as in
VTC's admission loop, Sheng et al. OSDI 2024 §4.2), and it is not starved either: after
`max_skips` iterations in which its head was skipped for memory (it did not fit while another
tenant's request was admitted: the scheduler reports that), that head gets a *reservation*:
from then on, new admissions of other tenants may only use the KV blocks left over after the
reserved head's need, so running work drains into the reserved room and the head is admitted as
soon as it fits. One reservation is held at a time (the first tenant to reach the limit); the
next one is granted when it is released. Running sequences (decodes, admitted prefills) are never
blocked by a reservation: they already hold their place.

The gate only decides *when* a reservation is granted and released; the room itself is held in
the scheduling core's ledger (`worker.scheduling.ledger`, hold kind "reservation"), which every
admission reads. Pure bookkeeping on tenant ids, request ids and block counts (no engine types, no
torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Reservation:
    """KV memory promised to one waiting request: `blocks` blocks for `request_id` of `tenant_id`."""

    tenant_id: str
    request_id: str
    blocks: int
    granted_iteration: int


class EligibilityGate:
    """Bounded skips, then a memory reservation.

    max_skips: iterations a tenant's head may be skipped for memory before memory is reserved for
    it (>= 0; 0 reserves at the first skip). ledger: a `KVLedger` that holds the reserved room
    (None: the gate only keeps its own record). Raises ValueError on a negative value.
    """

    def __init__(self, max_skips: int = 8, ledger=None) -> None:
        if max_skips < 0:
            raise ValueError("max_skips must be >= 0")
        self.max_skips = max_skips
        self.ledger = ledger
        self.skips: dict[str, int] = {}
        self.reservation: Reservation | None = None
        self.total_skips: dict[str, int] = {}
        self.reservations_granted = 0
        self._last_skip_iteration: dict[str, int] = {}

    def available_blocks(self, tenant_id: str, request_id: str, free_blocks: int) -> int:
        """Free KV blocks a new admission of `request_id` may use: all of them for the reserved
        request (or when nothing is reserved), the rest after the reservation for anyone else."""
        r = self.reservation
        if r is None or r.request_id == request_id:
            return free_blocks
        return max(0, free_blocks - r.blocks)

    def holds(self, request_id: str) -> bool:
        """Whether memory is reserved for `request_id` now."""
        return self.reservation is not None and self.reservation.request_id == request_id

    def on_skip(self, tenant_id: str, request_id: str, blocks_needed: int, iteration: int) -> None:
        """The tenant's head `request_id` (needing `blocks_needed` blocks) did not fit in iteration
        `iteration`. Counted once per tenant per iteration; grants the reservation at the limit."""
        if self._last_skip_iteration.get(tenant_id) == iteration:
            return
        self._last_skip_iteration[tenant_id] = iteration
        n = self.skips[tenant_id] = self.skips.get(tenant_id, 0) + 1
        self.total_skips[tenant_id] = self.total_skips.get(tenant_id, 0) + 1
        r = self.reservation
        if r is not None and r.request_id == request_id:
            r.blocks = blocks_needed  # keep the reservation in step with the head's current need
        elif r is None and n > self.max_skips:
            r = self.reservation = Reservation(tenant_id, request_id, blocks_needed, iteration)
            self.reservations_granted += 1
        else:
            return
        self._publish()

    def _publish(self) -> None:
        """Mirror the reservation into the ledger (the room every admission reads)."""
        if self.ledger is None:
            return
        from worker.scheduling.ledger import RESERVATION

        self.ledger.release(RESERVATION)
        r = self.reservation
        if r is not None:
            self.ledger.hold(RESERVATION, r.tenant_id, r.request_id, 0, r.blocks)

    def on_admit(self, tenant_id: str, request_id: str) -> None:
        """`request_id` was admitted: its tenant's skip count restarts, its reservation is released."""
        self.skips[tenant_id] = 0
        if self.reservation is not None and self.reservation.request_id == request_id:
            self.reservation = None
            self._publish()

    def on_preempt(self, tenant_id: str) -> None:
        """A running request of `tenant_id` was preempted back to the front of its queue: it had its
        turn already, so it is not skipped `max_skips` times again; at its next skip memory is
        reserved for it (when no other reservation is held), and the room it gave up goes to it, not
        to whoever is admitted next."""
        self.skips[tenant_id] = max(self.skips.get(tenant_id, 0), self.max_skips)

    def on_drop(self, tenant_id: str, request_id: str) -> None:
        """`request_id` left without being admitted (cancelled): release a reservation it held."""
        if self.reservation is not None and self.reservation.request_id == request_id:
            self.reservation = None
            self.skips[tenant_id] = 0
            self._publish()
