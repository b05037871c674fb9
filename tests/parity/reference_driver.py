"""Drive the reference scheduler (`worker/engine/scheduler.py`) through a scripted workload.

What is real: the `Scheduler` (per-tenant queues, the fairness policy's picks, admission,
eligibility, preemption, charging of prefill), its `BlockManager` (KV blocks) and the policy
objects of `worker.scheduling`, built the way `worker.engine.engine.Engine` builds them (its
defaults: 16-token prefill slices, 8 skips before a reservation, returning-tenant preemption for
every policy but FCFS; no prefix cache, no KV quotas), except the lower-tier token target, off
here: SGLang decodes every running request each step, so that rule cannot be carried out there
(docs/sglang-backend.md) and parity compares the decisions both executors can make.

What is simulated: the model. Each scheduled chunk is taken as computed; a sequence whose
prefill or decode reached its last token commits one output token, charged as the engine charges
it (`cost.decode(1, P, O)`, `Engine._commit`), and finishes after `output_tokens` of them (no EOS,
no stop strings). This is the step of `tests/unit/sched_steps.py` with the engine's charge.

Usage: `trace = run_reference(workload, policy="vtc")`, a `tests.parity.trace.Trace`.
"""

from __future__ import annotations

from worker.cache.namespace import derive_namespace
from worker.cache.radix import RadixCache
from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from worker.scheduling.cost import LinearCost
from worker.scheduling.policy import make_policy

from tests.parity.driver import ScriptedDriver
from tests.parity.trace import IterationRecord, Trace
from tests.parity.workloads import ScriptedWorkload

OUTPUT_TOKEN = 7  # what the fake model emits (the same in the SGLang driver)
CACHE_SECRET = b"parity-reference-driver"  # namespaces per tenant, as the engine derives them


class ReferenceDriver(ScriptedDriver):
    """The reference scheduler on `workload.engine`'s shape under `policy` (`vtc`, `vtc-pred`,
    `drr`, `fcfs`), with the engine's defaults (`prefill_slice`, `max_skips`,
    `returning_preemption`) unless overridden, and no lower-tier token target (None; the engine's
    default is `DEFAULT_LOWER_TIER_TOKEN_TARGET`, a rule SGLang cannot carry out). Cost: `LinearCost(alpha, beta)` (the engine's
    defaults 1, 2; the SGLang plugin's too)."""

    def __init__(self, workload: ScriptedWorkload, policy: str = "vtc", *, alpha: float = 1.0, beta: float = 2.0,
                 prefill_slice: int = 16, max_skips: int = 8, returning_preemption: bool | None = None,
                 drr_quantum: float = 512.0, lower_tier_token_target: int | None = None,
                 prefix_cache: bool = True, max_partial_prefills: int | None = None) -> None:
        super().__init__(workload, f"reference/{policy}")
        shape = workload.engine
        self.cost = LinearCost(alpha, beta)
        options = {"quantum": drr_quantum} if policy == "drr" else {}
        self.policy = make_policy(policy, self.cost, **options)
        self.cache = RadixCache(shape.page_size) if prefix_cache else None
        self.blocks = BlockManager(shape.kv_blocks, shape.page_size, cache=self.cache)
        if returning_preemption is None:
            returning_preemption = policy != "fcfs"  # as Engine builds it
        self.scheduler = Scheduler(self.policy, self.cost, self.blocks, shape.chunk_tokens, shape.max_running,
                                   prefill_slice=prefill_slice, max_skips=max_skips,
                                   returning_preemption=returning_preemption, clock=lambda: float(self.iteration),
                                   lower_tier_token_target=lower_tier_token_target,
                                   max_partial_prefills=max_partial_prefills)
        self.seqs: dict[str, Sequence] = {}

    def _arrive(self, iteration: int) -> None:
        for r in self._arrivals.get(iteration, ()):
            tenant = self.workload.tenant(r.tenant_id)
            seq = Sequence(r.request_id, r.tenant_id, self.workload.prompt(r), SamplingParams(max_tokens=r.output_tokens),
                           weight=tenant.weight, tier=tenant.tier, arrival_time=float(iteration),
                           max_tokens=r.output_tokens,
                           cache_namespace=derive_namespace(CACHE_SECRET, r.tenant_id))
            self.seqs[r.request_id] = seq
            self.scheduler.add(seq)

    def step(self) -> IterationRecord:
        """Arrivals of this iteration, one `schedule()`, the fake forward and commit."""
        self._arrive(self.iteration)
        before = {rid: (s.status, s.num_preemptions) for rid, s in self.seqs.items()}
        chunks = self.scheduler.schedule()
        rec = IterationRecord()
        # preempted (recompute) in this schedule(), whatever the reason
        rec.retracted = [rid for rid, s in self.seqs.items() if s.num_preemptions > before[rid][1]]
        for c in chunks:
            s = c.seq
            was = before[s.request_id][0]
            if s.status is SequenceStatus.RUNNING and (was is SequenceStatus.WAITING or s.request_id in rec.retracted):
                rec.admitted.append(s.request_id)
            rec.tokens[s.tenant_id] = rec.tokens.get(s.tenant_id, 0) + c.num_tokens
        for c in chunks:
            s = c.seq
            s.num_computed_tokens += c.num_tokens
            self.blocks.cache_computed(s)  # completed whole blocks join the prefix cache (Engine._commit_step)
            if s.num_computed_tokens == s.num_tokens:
                units = self.cost.decode(1, len(s.prompt_token_ids), len(s.output_token_ids))
                s.output_token_ids.append(OUTPUT_TOKEN)
                self.policy.charge(s.tenant_id, units, output_tokens=1, request_id=s.request_id)
                if len(s.output_token_ids) >= s.max_tokens:
                    self.scheduler.finish(s, FinishReason.LENGTH)
                    rec.finished.append(s.request_id)
        rec.tenant_of = {rid: self.seqs[rid].tenant_id for rid in rec.admitted + rec.retracted}
        rec.service = {t: a.charged_service for t, a in sorted(self.policy.accounts.items())}
        return self._close_step(rec, (s.tenant_id for s in self.seqs.values() if s.status is SequenceStatus.WAITING))

    def leaked_blocks(self) -> int:
        """KV blocks still held once every request has finished (0 when none leaked)."""
        if any(not s.is_finished for s in self.seqs.values()):
            raise RuntimeError("requests still live: run longer before checking for leaks")
        return self.blocks.num_used


def sglang_batching(workload: ScriptedWorkload) -> dict:
    """The reference engine's settings for SGLang's batching (`EngineConfig.prefill_slice`,
    `max_partial_prefills`): one pick may take a whole chunk of a request, and at most one request
    is left in partial prefill (SGLang's one `Scheduler.chunked_req`). Options for `run_reference`."""
    return {"prefill_slice": workload.engine.chunk_tokens, "max_partial_prefills": 1}


def run_reference(workload: ScriptedWorkload, policy: str = "vtc", **options) -> Trace:
    """Run `workload` through the reference scheduler; see `ReferenceDriver`."""
    return ReferenceDriver(workload, policy, **options).run()
