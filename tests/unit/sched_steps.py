"""Shared helpers for tests that drive the real Scheduler without a model."""

import itertools

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from worker.engine.sequence import FinishReason, SamplingParams, Sequence

_ids = itertools.count(1)


def make_seq(tenant: str, prompt_len: int, max_tokens: int = 8, weight: float = 1.0,
             tier: str = "interactive") -> Sequence:
    """A request of `tenant` (in `tier`) with prompt tokens 1..prompt_len and at most `max_tokens`
    output tokens; request ids q1, q2, ... are unique across the test session."""
    return Sequence(f"q{next(_ids)}", tenant, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    weight=weight, max_tokens=max_tokens, tier=tier)


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


class CancelAndStepRules:
    """Hypothesis rules the scheduler state machines share (mixed into a RuleBasedStateMachine that
    sets `self.sched` and `self.live`, the requests not yet finished, and defines `_step()`)."""

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def cancel(self, i):
        """The client of one live request goes away."""
        s = self.live.pop(i % len(self.live))
        self.sched.finish(s, FinishReason.ABORT)

    @rule(k=st.integers(1, 12))
    def steps(self, k):
        """`k` engine steps."""
        for _ in range(k):
            self._step()
