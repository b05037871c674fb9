"""Shared helper for tests that drive the real Scheduler without a model."""

from worker.engine.sequence import FinishReason


def step(sched):
    """One engine step: compute the scheduled tokens, commit one output at the end of each prefill or
    decode, finish at max_tokens. Returns the chunks."""
    chunks = sched.schedule()
    for c in chunks:
        s = c.seq
        s.num_computed_tokens += c.num_tokens
        if s.num_computed_tokens == s.num_tokens:
            s.output_token_ids.append(7)
            sched.policy.charge(s.tenant_id, sched.cost.decode(1), output_tokens=1)
            if len(s.output_token_ids) >= s.max_tokens:
                sched.finish(s, FinishReason.LENGTH)
    return chunks
