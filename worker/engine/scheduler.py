"""Iteration-level batching for the reference engine: which tokens are computed in the next step.

Continuous batching (Orca, Yu et al., OSDI 2022) with chunked prefill (Sarathi, Agrawal et al.,
2023): every iteration computes at most `max_num_batched_tokens` tokens (the prefill chunk,
default 512). Running sequences in decode take one token each first; the rest of the budget is
handed out in slices of `prefill_slice` tokens (default 16, one KV block), each charged at once, so
the policy's counters move between picks (water-filling among tenants; case SC2). Slices that land
on the same sequence in one iteration form one chunk.

Every *decision* (whose work gets the next slice, which tier, admission, KV quotas, the eligibility
gate, whom to preempt and why, which decodes run when they pass the decode target) is made by the
scheduling core, `worker.scheduling.core.SchedulingCore`, shared with the simulator and the SGLang
plugin. This module only carries them out: block tables, prefix-cache attach, chunk sizes and
charging (prefill slices when scheduled, for prompt positions never charged before, so recompute
after preemption is not charged twice; cached prompt positions at the cost function's cached
rate). It is the core's `Executor`: it reports a waiting request's KV need with the prefix cache
taken into account (`BlockManager.admission_need`), a running request's blocks held and promised,
its prefill left, and frees a preempted request's blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from worker.scheduling.core import OUT_OF_BLOCKS, SchedulingCore
from worker.scheduling.cost import CostFunction
from worker.scheduling.decode_share import (DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET, DEFAULT_LOWER_TIER_TOKEN_TARGET,
                                             DEFAULT_TIER_GRACE_ITERATIONS)
from worker.scheduling.handback import HandBackRule
from worker.scheduling.policy import SchedulingPolicy
from worker.scheduling.quota import KVQuota
from worker.scheduling.tiers import TierShares


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
    """The running set's batching mechanics over a `SchedulingCore` that decides.

    max_num_batched_tokens: token budget per iteration (= prefill chunk size), tokens.
    max_running: most sequences admitted at once. prefill_slice: tokens per policy pick when the
    prefill budget is split (>= 1). max_skips: memory skips before a reservation. clock: seconds,
    monotonic (the simulator passes a virtual clock). quota: `KVQuota` (None: off).
    returning_preemption: a returning tenant below its slot share gets a slot at once (the engine
    turns it off for FCFS). tiers: `TierShares` (default: strict priority with 5 % minimum shares).
    iteration_token_target: tokens per contended iteration beyond which they are shared by tier and
    weight (None: the token budget, i.e. never). lower_tier_token_target: tokens per iteration the
    lower tiers together may take while a higher tier has work (None: no limit; default 4;
    worker/scheduling/decode_share.py); tier_grace_iterations / lower_tier_idle_token_target: the
    grace after the higher tier's last work and the lower tiers' tokens meanwhile (`SchedulingCore`).
    max_partial_prefills: most requests in partial prefill at once (None: no limit; `SchedulingCore`). Raises ValueError on non-positive sizes (the core checks
    them: it names max_num_batched_tokens chunk_tokens).
    """

    def __init__(self, policy: SchedulingPolicy, cost: CostFunction, block_manager: BlockManager,
                 max_num_batched_tokens: int = 512, max_running: int = 64, *, prefill_slice: int = 16,
                 max_skips: int = 8, clock: Callable[[], float] = time.monotonic,
                 quota: KVQuota | None = None, returning_preemption: bool = True,
                 tiers: TierShares | None = None, iteration_token_target: int | None = None,
                 lower_tier_token_target: int | None = DEFAULT_LOWER_TIER_TOKEN_TARGET,
                 max_partial_prefills: int | None = None,
                 tier_grace_iterations: int = DEFAULT_TIER_GRACE_ITERATIONS,
                 lower_tier_idle_token_target: int = DEFAULT_LOWER_TIER_IDLE_TOKEN_TARGET) -> None:
        self.cost = cost
        self.blocks = block_manager
        self.clock = clock
        self.by_id: dict[str, Sequence] = {}
        self._may_hand_back: set[str] = set()  # waiting, never admitted, and the gateway lets them be handed back
        self.core = SchedulingCore(policy, cost, self, total_blocks=block_manager.num_blocks,
                                   max_running=max_running, chunk_tokens=max_num_batched_tokens,
                                   prefill_slice=prefill_slice, max_skips=max_skips, quota=quota,
                                   returning=returning_preemption, tiers=tiers,
                                   iteration_token_target=iteration_token_target,
                                   lower_tier_token_target=lower_tier_token_target,
                                   max_partial_prefills=max_partial_prefills,
                                   tier_grace_iterations=tier_grace_iterations,
                                   lower_tier_idle_token_target=lower_tier_idle_token_target)

    # ---- the core's Executor protocol -----------------------------------------------------------
    def admission_need(self, seq: Sequence) -> int:
        return self.blocks.admission_need(seq)

    def blocks_held(self, seq: Sequence) -> int:
        return len(seq.block_table)

    def blocks_promised(self, seq: Sequence) -> int:
        return max(0, self.blocks.blocks_for(seq.num_tokens) - len(seq.block_table))

    def prefill_left(self, seq: Sequence) -> int:
        n = seq.num_tokens - seq.num_computed_tokens
        return n if n > 1 else 0

    def prefill_room(self, seq: Sequence, have: int) -> int:
        return self._room(seq, have)

    def free_blocks(self) -> int:
        return self.blocks.num_free

    def preempt(self, seq: Sequence) -> None:
        self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption's mechanics: free the blocks, forget the computed tokens (the core
        requeues the request at the front of its tenant's queue)."""
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1

    # ---- views of the core's state (tests, snapshots) ---------------------------------------------
    @property
    def policy(self) -> SchedulingPolicy:
        return self.core.policy

    @property
    def gate(self):
        return self.core.gate

    @property
    def quota(self):
        return self.core.quota

    @property
    def returning(self):
        return self.core.returning

    @property
    def running(self) -> list[Sequence]:
        """Running sequences in admission order."""
        return [e.handle for e in self.core.running.values()]

    @property
    def waiting(self) -> dict[str, list[Sequence]]:
        """Per tenant with queued work: its waiting sequences, front first."""
        return {t: [e.handle for e in ts.waiting] for t, ts in self.core.tenants.items() if ts.waiting}

    @property
    def stats(self) -> SchedulerStats:
        st = self.core.stats
        return SchedulerStats(st.iterations, sum(st.preemptions.values()))

    @property
    def reclaim_preemptions(self) -> int:
        return self.core.stats.preemptions["reclaim"]

    def held_by_tenant(self, reclaimable: bool = False) -> dict[str, int]:
        """KV blocks held per tenant with running sequences (reclaimable: leave out requests
        admitted through a memory reservation)."""
        return self.core.room.held_by_tenant(reclaimable=reclaimable)

    # ---- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (the core and its policy see the arrival). Raises ValueError on a
        duplicate id or an unknown tier."""
        self.core.add(seq.request_id, seq.tenant_id, seq, weight=seq.weight, tier=seq.tier,
                      arrival=seq.arrival_time, prompt_tokens=len(seq.prompt_token_ids), max_tokens=seq.max_tokens)
        self.by_id[seq.request_id] = seq
        if seq.may_hand_back:
            self._may_hand_back.add(seq.request_id)

    def has_work(self) -> bool:
        return bool(self.core.running) or self.core.num_waiting() > 0

    def num_waiting(self) -> int:
        return self.core.num_waiting()

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark `seq` finished (any reason, abort included), free its KV blocks at once. What it
        consumed stays charged."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = self.clock()
        self.blocks.free(seq)
        self.by_id.pop(seq.request_id, None)
        self._may_hand_back.discard(seq.request_id)
        self.core.finish(seq.request_id, len(seq.prompt_token_ids), len(seq.output_token_ids))

    def hand_back(self, rule: HandBackRule, room_elsewhere=None) -> list[Sequence]:
        """The waiting, never-admitted sequences `rule` hands back now (`worker.scheduling.handback`;
        only those whose `may_hand_back` the gateway set), removed from the core (no block was held,
        nothing was charged) and marked finished with `FinishReason.HANDED_BACK`. room_elsewhere:
        (tenant id, tier) -> bool from the pool board, or None (no board read)."""
        out = []
        if not self._may_hand_back:  # (a lone worker's requests never may: the rule costs nothing there)
            return out
        for e in rule.choose(self.core, self.clock(), lambda seq: seq.may_hand_back, room_elsewhere):
            seq = e.handle
            self.core.hand_back(seq.request_id)
            self.blocks.free(seq)  # nothing held (never admitted); kept for the invariant
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.HANDED_BACK
            seq.finish_time = self.clock()
            self.by_id.pop(seq.request_id, None)
            self._may_hand_back.discard(seq.request_id)
            out.append(seq)
        return out

    def prefill_backlog(self) -> dict[str, int]:
        """Per tenant with pending prefill: prompt-side tokens not computed yet (waiting requests
        and running partial prefills), tokens."""
        out: dict[str, int] = {}
        for seq in self.by_id.values():
            if seq.status is SequenceStatus.WAITING or seq.num_uncomputed > 1:
                out[seq.tenant_id] = out.get(seq.tenant_id, 0) + seq.num_uncomputed
        return out

    # ---- one iteration --------------------------------------------------------------------------
    def _promised(self) -> int:
        return sum(self.blocks_promised(e.handle) for e in self.core.running.values())

    def schedule(self) -> list[ScheduledChunk]:
        """Pick this iteration's work: decodes first, then the prefill budget as the core splits it.

        Returns chunks (decodes first, then prefill chunks in the order they were first given a
        slice) whose token counts sum to at most `max_num_batched_tokens`. Prefill is charged here.
        """
        core = self.core
        core.begin_iteration(self.blocks.num_free, self._promised())
        budget = core.chunk_tokens
        chunks: dict[str, ScheduledChunk] = {}
        decoding = [e for e in core.running.values() if e.handle.num_uncomputed == 1]
        decodes, prefill_budget = core.plan_iteration(decoding, budget)
        for e in decodes:
            if budget == 0:
                break
            budget = self._decode(e, chunks, budget)
        prefill_budget = budget if prefill_budget is None else min(budget, prefill_budget)
        if prefill_budget > 0:
            self._schedule_prefill(prefill_budget, chunks)
        if not chunks and len(decodes) < len(decoding):
            # the iteration target left decodes out for prefill that could not be served: run them
            for e in decoding:
                if budget == 0:
                    break
                if e.running:
                    budget = self._decode(e, chunks, budget)
        if not chunks and core.running:
            # Stall (every running sequence is a partial prefill and the pool is full): free the
            # blocks of the core's victim so that the others can go on.
            victim = core.stall_victim()
            if victim.handle.block_table:
                core.preempt(victim, OUT_OF_BLOCKS)
                self._schedule_prefill(prefill_budget, chunks)
        core.end_iteration()
        return list(chunks.values())

    def _decode(self, e, chunks: dict[str, ScheduledChunk], budget: int) -> int:
        """One decode token for running entry `e` (preempting the core's victims while no block is
        free; `e` itself may be the victim, and a victim scheduled earlier in this step loses its
        chunk). Returns the budget left."""
        core = self.core
        seq = e.handle
        while e.running and not self.blocks.can_allocate(seq, 1):
            victim = core.decode_victim(e)
            core.preempt(victim, OUT_OF_BLOCKS, e)
            dropped = chunks.pop(victim.request_id, None)  # a lower tier's decode scheduled earlier this step
            if dropped is not None:
                budget += dropped.num_tokens
        if not e.running:
            return budget
        self.blocks.allocate(seq, 1)
        chunk = chunks[seq.request_id] = ScheduledChunk(seq, 1)
        self._charge_prefill(chunk, seq.num_computed_tokens, 1)  # a last prompt token, if any
        return budget - 1

    def _schedule_prefill(self, budget: int, chunks: dict[str, ScheduledChunk]) -> None:
        core = self.core
        core.begin_prefill(budget, self.blocks.num_free, self._promised())
        while (e := core.next_prefill()) is not None:
            seq = e.handle
            if not e.running:
                core.admit(e)
                self._admit(seq, e.order)
                self._charge_cached(chunks, seq)
            have = core.allocated(e)
            # a running partial prefill takes a smaller slice when memory is short
            n = min(core.prefill_slice, seq.num_uncomputed - have, core.prefill_budget, self._room(seq, have))
            if n <= 0:
                core.cannot_serve(e)
                continue
            self.blocks.allocate(seq, have + n)
            chunk = chunks.get(seq.request_id)
            if chunk is None:
                chunk = chunks[seq.request_id] = ScheduledChunk(seq, 0)
            chunk.num_tokens += n
            self._charge_prefill(chunk, seq.num_computed_tokens + have, n)
            core.served(e, n)
        core.end_prefill()

    def _room(self, seq: Sequence, have: int) -> int:
        """Tokens `seq` can still get into its blocks and the free pool (beyond `have` given)."""
        return (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size - seq.num_computed_tokens - have

    def _admit(self, seq: Sequence, order: int) -> None:
        """Admission's mechanics: a cached prefix is attached (its blocks shared, its tokens not
        recomputed), the sequence runs."""
        self.blocks.attach_prefix(seq)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = order
        self._may_hand_back.discard(seq.request_id)  # admitted once: never handed back
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
            seq.first_scheduled_iteration = self.core.iteration

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
        for tenant, ts in self.core.tenants.items():
            if ts.waiting or ts.running:
                out[tenant] = {"waiting": len(ts.waiting), "running": len(ts.running),
                               "kv_blocks": sum(len(e.handle.block_table) for e in ts.running.values())}
        if self.quota is not None:
            for tenant, c in out.items():
                c.update(self.quota.state(tenant, c["kv_blocks"]))
        return out
