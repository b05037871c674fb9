"""Iteration-level scheduler: which tokens are computed in the next engine step.

Continuous batching (Orca, Yu et al., OSDI 2022) with chunked prefill (Sarathi, Agrawal et al.,
2023): every iteration computes at most `max_num_batched_tokens` tokens (the prefill chunk,
default 512). Running sequences in decode take one token each first; the rest of the budget goes to
prefill chunks, handed out tenant by tenant in the order the fairness policy gives (VTC: smallest
virtual counter first), re-asking the policy after every chunk because the charge moves counters.

A waiting request is admitted only when its whole remaining prefill fits in free KV blocks; a
tenant whose head request does not fit (or meets the running-slot limit) is skipped for this
iteration instead of blocking everyone. When decodes cannot get a block, the most
recently admitted running sequence is preempted by recompute (its blocks freed, it re-enters the
front of its tenant's queue, ahead of that tenant's newer work).

Prefill charges are made here, when the chunk is scheduled into the step that computes it; decode
charges are made by the engine when a token is committed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import SchedulingPolicy


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at position `seq.num_computed_tokens`."""

    seq: Sequence
    num_tokens: int


@dataclass
class SchedulerStats:
    iterations: int = 0
    preemptions: int = 0


class Scheduler:
    """Per-tenant waiting queues, the running set and the per-iteration token budget.

    max_num_batched_tokens: token budget per iteration (= prefill chunk size), tokens.
    max_running: most sequences admitted at once.
    """

    def __init__(self, policy: SchedulingPolicy, cost: LinearCost, block_manager: BlockManager,
                 max_num_batched_tokens: int = 512, max_running: int = 64) -> None:
        if max_num_batched_tokens < 1 or max_running < 1:
            raise ValueError("max_num_batched_tokens and max_running must be >= 1")
        self.policy = policy
        self.cost = cost
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_running = max_running
        self.waiting: dict[str, deque[Sequence]] = {}
        self.running: list[Sequence] = []          # in admission order
        self.by_id: dict[str, Sequence] = {}
        self.stats = SchedulerStats()
        self.preemptions_by_tenant: dict[str, int] = {}
        self.finished_by_tenant: dict[str, int] = {}
        self._admit_counter = 0

    # ---- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (the policy sees the arrival). Raises ValueError on a duplicate id."""
        if seq.request_id in self.by_id:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.policy.on_arrival(seq.tenant_id, seq.weight, seq.tier)
        self.by_id[seq.request_id] = seq
        self.waiting.setdefault(seq.tenant_id, deque()).append(seq)

    def has_work(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark `seq` finished (any reason, abort included), free its KV blocks at once."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        queue = self.waiting.get(seq.tenant_id)
        if queue is not None and seq in queue:
            queue.remove(seq)
        self.by_id.pop(seq.request_id, None)
        self.finished_by_tenant[seq.tenant_id] = self.finished_by_tenant.get(seq.tenant_id, 0) + 1
        if not self._tenant_has_work(seq.tenant_id):
            self.policy.on_idle(seq.tenant_id)

    def _tenant_has_work(self, tenant_id: str) -> bool:
        return bool(self.waiting.get(tenant_id)) or any(s.tenant_id == tenant_id for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, requeue at the front of its tenant's queue."""
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.preemptions_by_tenant[seq.tenant_id] = self.preemptions_by_tenant.get(seq.tenant_id, 0) + 1
        self.waiting.setdefault(seq.tenant_id, deque()).appendleft(seq)

    # ---- one iteration --------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        """Pick this iteration's work: decodes first, then prefill chunks in policy order.

        Returns chunks whose token counts sum to at most `max_num_batched_tokens`. Prefill chunks
        are charged to their tenant here.
        """
        self.stats.iterations += 1
        budget = self.max_num_batched_tokens
        batch: list[ScheduledChunk] = []
        scheduled: set[str] = set()

        # 1. Decodes (one token each), oldest admission first; preempt the newest when out of blocks.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed != 1:
                continue
            while not self.blocks.can_allocate(seq, 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.blocks.allocate(seq, 1)
            batch.append(ScheduledChunk(seq, 1))
            scheduled.add(seq.request_id)
            budget -= 1

        # 2. Prefill chunks, tenant by tenant in policy order.
        skipped: set[str] = set()
        while budget > 0:
            heads = self._prefill_heads(scheduled, skipped)
            if not heads:
                break
            arrival = {t: s.arrival_time for t, s in heads.items()}
            progressed = False
            for tenant in self.policy.order(heads.keys(), arrival):
                seq = heads[tenant]
                n = min(seq.num_uncomputed, budget)
                if seq.status is SequenceStatus.WAITING and len(self.running) >= self.max_running:
                    skipped.add(tenant)
                    continue
                if seq.status is SequenceStatus.WAITING and not self.blocks.can_allocate(seq, seq.num_uncomputed):
                    # Admit only what can finish its prefill; otherwise skip the tenant this iteration.
                    skipped.add(tenant)
                    continue
                if not self.blocks.can_allocate(seq, n):
                    # A running partial prefill takes a smaller chunk into what is free, or waits.
                    room = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size
                    n = min(n, room - seq.num_computed_tokens)
                    if n <= 0:
                        skipped.add(tenant)
                        continue
                self._take_chunk(seq, n)
                batch.append(ScheduledChunk(seq, n))
                scheduled.add(seq.request_id)
                budget -= n
                progressed = True
                break
            if not progressed:
                break
        return batch

    def _prefill_heads(self, scheduled: set[str], skipped: set[str]) -> dict[str, Sequence]:
        """Each tenant's next prefill candidate: a running partial prefill, else its queue head."""
        heads: dict[str, Sequence] = {}
        for seq in self.running:
            if seq.request_id in scheduled or seq.num_uncomputed <= 1 or seq.tenant_id in skipped:
                continue
            heads.setdefault(seq.tenant_id, seq)
        for tenant, queue in self.waiting.items():
            if tenant in heads or tenant in skipped or not queue:
                continue
            heads[tenant] = queue[0]
        return heads

    def _take_chunk(self, seq: Sequence, n: int) -> None:
        if seq.status is SequenceStatus.WAITING:
            self.waiting[seq.tenant_id].popleft()
            seq.status = SequenceStatus.RUNNING
            seq.admitted_order = self._admit_counter
            self._admit_counter += 1
            self.running.append(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
        self.blocks.allocate(seq, n)
        # Charge only prompt-side tokens not charged before (recompute is not charged twice).
        end = seq.num_computed_tokens + n
        new = max(0, end - seq.num_charged_prefill)
        if new:
            seq.num_charged_prefill = end
            self.policy.charge(seq.tenant_id, self.cost.prefill(new), prompt_tokens=new)

    def tenant_counts(self) -> dict[str, dict[str, int]]:
        """Per tenant: waiting and running sequences and KV blocks held."""
        out: dict[str, dict[str, int]] = {}
        for tenant, queue in self.waiting.items():
            out.setdefault(tenant, {"waiting": 0, "running": 0, "kv_blocks": 0})["waiting"] = len(queue)
        for seq in self.running:
            c = out.setdefault(seq.tenant_id, {"waiting": 0, "running": 0, "kv_blocks": 0})
            c["running"] += 1
            c["kv_blocks"] += len(seq.block_table)
        return out
